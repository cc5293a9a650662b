"""The exchange in: every owner assembles its matrix, or the part of it its device
holds, from the pieces every device sent. A kernel that returns each matrix's squared
norm (summed over the group's parts where split) checks that the parts together hold
the whole matrix, against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import mesh_of

import muon_optax as mo
from muon_optax._newton_schulz.kernel import Kernel
from muon_optax._newton_schulz.settings import DEFAULT_NS
from muon_optax._sharded_ns.solver import sharded_solver

norm = lambda x: jnp.sum(x * x, axis=(-2, -1), keepdims=True)
KERNEL = Kernel(lambda x: x * 0 + norm(x),
                lambda x, parts, reduce, rows=None: x * 0 + reduce(norm(x), jnp.add), DEFAULT_NS)


@pytest.mark.parametrize("spec", [P(None, None, "data"), P(None, "data"), P()])
def test_every_owner_assembles_its_whole_matrix_or_its_group_s_parts(spec):
  # 11 matrices 32×64 on 8 devices: a round of 8 whole, 3 left, split with traffic free.
  mesh = mesh_of()
  x = jax.random.normal(jax.random.key(1), (11, 32, 64))
  solve = sharded_solver(KERNEL, mo.MeshLayout(mesh, flops_per_byte=0))
  y = jax.jit(lambda x: solve([x], [spec], [spec])[0])(jax.device_put(x, NamedSharding(mesh, spec)))
  want = np.sum(np.asarray(x, np.float64) ** 2, axis=(1, 2))
  # A float32 sum of 32·64 squares: within that many roundings of the float64 one.
  bound = 32 * 64 * np.finfo(np.float32).eps
  np.testing.assert_allclose(np.asarray(y)[:, 0, 0], want, rtol=bound)
  assert np.all(np.asarray(y) == np.asarray(y)[:, :1, :1])  # one value a matrix
