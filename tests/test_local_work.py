"""The local work: each round runs the kernel its plan says, whole or by column parts
over its group, one unit after another."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import mesh_of

import muon_optax as mo
from muon_optax._newton_schulz.kernel import Kernel
from muon_optax._newton_schulz.settings import DEFAULT_NS
from muon_optax._sharded_ns.factor_mesh import FactorMesh
from muon_optax._sharded_ns.local_work import MeshKernel
from muon_optax._sharded_ns.rounds import plan_rounds
from muon_optax._sharded_ns.solver import sharded_solver


def test_each_round_runs_whole_or_split_as_the_plan_says():
  # Whole matrices come back + 1, split ones + 2 (with the split added): 11 matrices on
  # 8 devices with traffic free are a round of 8 whole and 3 split over groups.
  mesh = mesh_of()
  kernel = Kernel(lambda x: x + 1, lambda x, parts, reduce, rows=None: x + 1 + parts,
                  DEFAULT_NS)
  spec = P(None, None, "data")
  x = jax.device_put(jnp.zeros((11, 32, 64)), NamedSharding(mesh, spec))
  solve = sharded_solver(kernel, mo.MeshLayout(mesh, flops_per_byte=0))
  y = np.asarray(jax.jit(lambda x: solve([x], [spec], [spec])[0])(x))
  rounds = plan_rounds([(11, 32, 64)], 8, flops_per_byte=0, col_shards=[8])
  want = np.zeros(11)
  for r in rounds:
    for item in r.slots:
      if item is not None:
        want[item[1]] = 1 if r.split == 1 else 1 + r.split
  assert sorted({r.split for r in rounds}) != [1], rounds  # some are split
  np.testing.assert_array_equal(y[:, 0, 0], want)
  assert np.all(y == y[:, :1, :1])


def test_a_kernel_without_column_parts_splits_nothing():
  fmesh = FactorMesh.of(mesh_of())
  whole_only = MeshKernel(Kernel(lambda x: x * 2, None, DEFAULT_NS), fmesh)
  assert not whole_only.splits and whole_only.priced is DEFAULT_NS
  assert whole_only(jnp.ones((1, 2, 2)), 1, 1).tolist() == [[[2.0, 2.0], [2.0, 2.0]]]
  assert MeshKernel(Kernel.of(DEFAULT_NS), fmesh).splits
