"""How a stack lies on the mesh: its block, and column parts cut from narrow blocks as
whole blocks (the exchange itself runs on 8 devices in test_sharded_ns_solver.py and for TPU
in test_tpu_compile.py)."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import mesh_of

from muon_optax._sharded_ns.factor_mesh import FactorMesh
from muon_optax._sharded_ns.rounds import padded_cols
from muon_optax._sharded_ns.stack_shards import owned, shards_of, takes_whole_shards


def test_column_parts_take_whole_shards_where_the_split_divides_the_shard_count():
  # 24 columns over 8 devices: shards of 3. A split of 8 cannot slice a shard of 3, so
  # part p takes the shards p, p + 8, …: exact, no padding, and the plan costs it so.
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("data",))
  factors = FactorMesh.of(mesh)
  spec = factors.spec(jax.sharding.PartitionSpec(None, None, "data"))
  shards = shards_of(jax.sharding.NamedSharding(factors.mesh, spec), (1, 16, 24), factors.mesh)
  assert shards.grid == (1, 8) and shards.shard == (16, 3)
  assert takes_whole_shards(shards, 8, 8) and takes_whole_shards(shards, 2, 8)
  assert not takes_whole_shards(shards, 1, 8)
  assert padded_cols(24, 8, 8) == 24 and padded_cols(24, 8, 16) == 8 * 16  # 1 column a slice
  # Shards of 8 columns could be sliced, 1 column per part, but whole shards go to one
  # owner each, among 8 / g devices, not to g owners among all 8.
  wide = shards_of(jax.sharding.NamedSharding(factors.mesh, spec), (1, 16, 64), factors.mesh)
  assert takes_whole_shards(wide, 8, 8) and takes_whole_shards(wide, 4, 8)
  assert not takes_whole_shards(wide, 3, 8)  # 3 does not divide the 8 shards: sliced, padded
  rows = shards_of(jax.sharding.NamedSharding(factors.mesh, factors.spec(
      jax.sharding.PartitionSpec(None, "data"))), (1, 64, 64), factors.mesh)
  assert not takes_whole_shards(rows, 8, 8)  # shards of rows: every part is a slice of every shard


def test_shards_keep_the_matrix_axes_it_can_and_finds_replicas():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  shards = shards_of(NamedSharding(mesh, P(None, "data", "model")), (3, 16, 10), mesh)
  assert (shards.grid, shards.shard, shards.replicas) == ((4, 2), (4, 5), 1)
  # 10 columns do not split over 4: that axis is dropped, its devices hold replicas.
  shards = shards_of(NamedSharding(mesh, P(None, "model", "data")), (3, 16, 10), mesh)
  assert (shards.spec, shards.grid, shards.shard, shards.replicas) == (P(None, "model", None), (2, 1),
                                                           (8, 10), 4)
  # Device s (row-major over data × model) holds row shard s % 2, replica s // 2.
  assert [w[0] for w in shards.where] == [0, 1] * 4 and [w[2] for w in shards.where] == [
      0, 0, 1, 1, 2, 2, 3, 3]


def test_a_stack_is_owned_when_its_devices_hold_or_can_swap_into_whole_matrices():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  assert owned(P("data"), (8, 16, 32), mesh)
  assert owned(P(("data", "model")), (16, 4, 4), mesh)
  # A matrix axis split too: whole once each count block's 2 devices swap their shards.
  assert owned(P("data", None, "model"), (8, 16, 32), mesh)
  assert not owned(P("data", None, "model"), (4, 16, 32), mesh)  # 1 matrix, 2 shards
  assert not owned(P(None, "data", "model"), (8, 16, 32), mesh)  # the count whole
  assert not owned(P(), (8, 16, 32), mesh)  # replicated: every device has every matrix
  assert not owned(P(("data", "model")), (4, 16, 32), mesh)  # 4 matrices for 8 devices


def test_shards_of_splits_replicated_shards_between_replicas():
  mesh = mesh_of((4, 2), ("data", "model"))
  # Rows split over "data" only: each shard is shared by the 2 "model" replicas.
  shards = shards_of(NamedSharding(mesh, P(None, "data")), (3, 32, 20), mesh)
  assert shards.grid == (4, 1) and shards.shard == (8, 20) and shards.replicas == 2
  assert shards.where[:4] == ((0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1))
  # A split the shape does not allow, or a split stack axis, is dropped.
  shards = shards_of(NamedSharding(mesh, P("model", "data")), (2, 10, 20), mesh)
  assert shards.spec == P(None, None, None) and shards.replicas == 8 and shards.shard == (10, 20)
