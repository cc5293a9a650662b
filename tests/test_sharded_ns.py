"""The sharded solver's pieces on their own: the factor mesh whose trailing axes name the
device groups, and the layouts of stacks (the exchange itself runs on 8 devices in
test_distributed.py and for TPU in test_tpu_compile.py)."""

import math

import jax
import numpy as np
import pytest

from muon_optax._distributed.plan import (
  padded_cols,
)
from muon_optax._distributed.sharded_ns import FactorMesh, by_blocks, layout_of


@pytest.mark.parametrize("shape, axes, groups", [
    ((8,), ("data",), (2, 4, 8)),
    ((4, 2), ("data", "model"), (2, 4, 8)),
    ((12,), ("data",), (2, 4, 12)),  # 12 = 3 · 2 · 2: the 2s last
])
def test_factor_mesh_keeps_device_order_and_names_groups(shape, axes, groups):
  devices = np.asarray(jax.devices()[:1] * math.prod(shape), dtype=object)
  mesh = jax.sharding.Mesh(devices.reshape(shape), axes)
  factors = FactorMesh.of(mesh)
  assert factors.groups() == groups
  assert math.prod(factors.mesh.shape.values()) == math.prod(shape)
  # Consecutive devices in the mesh's row-major order differ in the trailing axes.
  for g in groups:
    names = factors.group_axes(g)
    assert math.prod(factors.mesh.shape[a] for a in names) == g
    assert names == factors.mesh.axis_names[-len(names):]
  assert factors.spec(jax.sharding.PartitionSpec(None, axes[0])) == jax.sharding.PartitionSpec(
      None, factors.factors[axes[0]])


def test_column_parts_take_whole_blocks_when_the_blocks_are_narrow():
  # 24 columns over 8 devices: blocks of 3. A split of 8 cannot slice a block of 3, so
  # part p takes the blocks p, p + 8, …: exact, no padding, and the plan costs it so.
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("data",))
  factors = FactorMesh.of(mesh)
  spec = factors.spec(jax.sharding.PartitionSpec(None, None, "data"))
  lay = layout_of(jax.sharding.NamedSharding(factors.mesh, spec), (1, 16, 24), factors.mesh)
  assert lay.grid == (1, 8) and lay.block == (16, 3)
  assert by_blocks(lay, 8, 8) and by_blocks(lay, 2, 8)
  assert not by_blocks(lay, 1, 8)
  assert padded_cols(24, 8, 8) == 24 and padded_cols(24, 8, 16) == 8 * 16  # 1 column a slice
  wide = layout_of(jax.sharding.NamedSharding(factors.mesh, spec), (1, 16, 64), factors.mesh)
  assert not by_blocks(wide, 8, 8)  # blocks of 8 columns: sliced, 1 column per part
