"""The factor mesh: every mesh axis cut into its primes, in the same device order, so
that groups of consecutive devices are trailing axes collectives can name."""

import math

import jax
import numpy as np
import pytest

from muon_optax._distributed.factor_mesh import FactorMesh


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

