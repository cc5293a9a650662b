"""The stacks one exchange moves: which lie alike, and the per-device choices made from
that (no exchange runs here; it does in test_sharded_ns_solver.py)."""

import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import mesh_of

from muon_optax._sharded_ns.exchange_stacks import ExchangeStacks
from muon_optax._sharded_ns.factor_mesh import FactorMesh
from muon_optax._sharded_ns.rounds import Round
from muon_optax._sharded_ns.stack_shards import shards_of


def stacks_of(specs, shapes, gather=False):
  fmesh = FactorMesh.of(mesh_of())
  lie = lambda spec, shape: shards_of(NamedSharding(fmesh.mesh, fmesh.spec(spec)), shape,
                                      fmesh.mesh)
  ins = [lie(spec, shape) for spec, shape in zip(specs, shapes)]
  outs = [lie(P(), shape) for shape in shapes] if gather else ins
  return ExchangeStacks.of(fmesh, shapes, [jnp.float32] * len(shapes), ins, outs, gather)


def test_stacks_that_lie_alike_share_a_kind_and_one_variant_a_round():
  columns, rows = P(None, None, "data"), P(None, "data")
  stacks = stacks_of([columns, rows, columns], [(4, 16, 64), (4, 16, 64), (4, 16, 64)])
  assert stacks.kind == [0, 1, 0]
  assert (stacks.devices, stacks.axes) == (8, ("data.0", "data.1", "data.2"))
  # Devices 0-3 hold matrices of stacks 0 and 2 (alike), 4-5 of stack 1, 6-7 none.
  slots = ((0, 0), (0, 1), (2, 0), (2, 1), (1, 0), (1, 1), None, None)
  keys, table = stacks.variants(Round(16, 64, slots))
  assert keys == [0, 1] and table == [0, 0, 0, 0, 1, 1, 0, 0]
  # One kind: one variant, every device's index 0, so no switch is traced.
  keys, table = stacks.variants(Round(16, 64, ((0, 0), (2, 3)) + (None,) * 6))
  assert keys == [0] and table == [0] * 8
  assert stacks.switch(table, [lambda x: x + 1, lambda x: x - 1], jnp.zeros(2)).tolist() == [1, 1]


def test_buffers_carry_every_stack_s_dtype_promoted_or_the_wire_s_each_way():
  stacks = stacks_of([P(), P()], [(1, 8, 8), (1, 8, 8)])
  assert stacks._replace(dtypes=[jnp.bfloat16, jnp.float32]).dtype == jnp.float32
  assert stacks._replace(dtypes=[jnp.bfloat16, jnp.bfloat16]).dtype == jnp.bfloat16
  assert stacks.result_dtype == jnp.float32  # the matrices' own, both ways
  wired = stacks._replace(wire_back=jnp.bfloat16)
  assert (wired.dtype, wired.result_dtype) == (jnp.float32, jnp.bfloat16)
  wired = stacks._replace(wire=jnp.bfloat16)
  assert (wired.dtype, wired.result_dtype) == (jnp.bfloat16, jnp.bfloat16)
