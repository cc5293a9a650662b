"""The exchange out: each result goes back where it is wanted, laid out as asked
(scattered) or on every device (gathered). An identity kernel makes the whole exchange
the identity, exactly, for whole matrices, column parts and whole-shard parts alike."""

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

# 3 + 5 + 1 matrices of three shapes on 8 devices, some left over in every shape: with
# traffic free (flops_per_byte=0) the leftovers are split, the 24×40 ones by whole
# shards of 5 columns.
SHAPES = [(3, 16, 64), (5, 24, 40), (1, 32, 32)]
SPECS = [P(None, None, "data"), P(None, None, "data"), P(None, "data")]


def exchanged(kernel, gather):
  mesh = mesh_of()
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  arrays = [jax.device_put(jax.random.normal(k, s), NamedSharding(mesh, spec))
            for k, s, spec in zip(keys, SHAPES, SPECS)]
  solve = sharded_solver(kernel, mo.MeshLayout(mesh, flops_per_byte=0))
  out = jax.jit(lambda xs: solve(xs, SPECS, None if gather else SPECS))(arrays)
  return [np.asarray(x) for x in arrays], [np.asarray(y) for y in out]


@pytest.mark.parametrize("gather", [False, True])
def test_an_identity_kernel_hands_every_matrix_back_unchanged(gather):
  identity = Kernel(lambda x: x, lambda x, parts, reduce, rows=None: x, DEFAULT_NS)
  arrays, out = exchanged(identity, gather)
  for x, y in zip(arrays, out):
    np.testing.assert_array_equal(y, x)


def test_results_come_back_in_their_stack_s_dtype():
  # A bfloat16 stack travels in the float32 buffers of its float32 neighbour, exactly,
  # and comes back bfloat16.
  mesh, spec = mesh_of(), P(None, None, "data")
  x16 = jax.random.normal(jax.random.key(2), (3, 16, 64)).astype(jnp.bfloat16)
  x32 = jax.random.normal(jax.random.key(3), (5, 16, 64))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  identity = Kernel(lambda x: x, None, DEFAULT_NS)
  solve = sharded_solver(identity, mo.MeshLayout(mesh))
  y16, y32 = jax.jit(lambda a, b: solve([a, b], [spec] * 2, [spec] * 2))(put(x16), put(x32))
  assert (y16.dtype, y32.dtype) == (jnp.bfloat16, jnp.float32)
  np.testing.assert_array_equal(np.asarray(y16, np.float32), np.asarray(x16, np.float32))
  np.testing.assert_array_equal(np.asarray(y32), np.asarray(x32))
