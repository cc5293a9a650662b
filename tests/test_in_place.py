"""Owned stacks: matrices that lie whole on their devices are orthogonalized where they
lie, with no exchange, as on one device."""

import math

import jax
import jax.numpy as jnp
import pytest
from _helpers import assert_trees_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import (
  AUTO,
  EXPLICIT,
  mesh_of,
  optimizer,
  param_shardings,
  placed,
  run_steps,
)

import muon_optax as mo
from benchmarks.hlo import collective_stats
from muon_optax._newton_schulz.variant import newton_schulz_flops


def owned_tree(key=4):
  """Stacks whose devices hold whole matrices: experts sharded on their stack axis (the
  params say so), and 16 small matrices whose state the data axis splits by count."""
  ks = jax.random.split(jax.random.key(key), 3)
  n = lambda k, s: jax.random.normal(k, s) * 0.1
  return {"experts": {"kernel": n(ks[0], (8, 16, 32))}, "heads": {"kernel": n(ks[1], (16, 8, 12))},
          "w": {"kernel": n(ks[2], (16, 64))}}


@pytest.mark.parametrize("layout, types", [("fsdp", AUTO), ("fsdp", EXPLICIT), ("zero1", AUTO),
                                           ("zero1", EXPLICIT)])
def test_owned_stacks_are_orthogonalized_where_they_lie(layout, types):
  mesh, params = mesh_of(types=types), owned_tree()
  pshard = param_shardings(params, mesh, layout)
  if layout == "fsdp":
    pshard = {**pshard, "experts": {"kernel": NamedSharding(mesh, P("data"))}}
  want_p, want_s = run_steps(optimizer(), params, 5)
  got_p, got_s = run_steps(optimizer(placed(mesh, layout)), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)
  assert_trees_close(got_s, want_s, rtol=0, atol=1e-5)


@pytest.mark.parametrize("types, shape", [
    (EXPLICIT, (8, 16, 32)),  # experts sharded on their stack axis: the types say so
    (AUTO, (16, 8, 12)),  # Auto axes: where fsdp_shardings puts the data axis, the count
])
def test_an_owned_stack_moves_nothing(types, shape):
  mesh = mesh_of(types=types)
  s = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("data")))
  params = {"experts": {"kernel": s}}
  tx = optimizer(placed(mesh))
  sshard = mo.state_shardings(tx, params, mesh)
  state = jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                       jax.eval_shape(tx.init, params), sshard)
  compiled = jax.jit(tx.update, out_shardings=(jax.tree.map(lambda x: x.sharding, params),
                                               sshard)).lower(params, state, params).compile()
  stats = collective_stats(compiled.as_text())
  assert all(count == 0 for count, _ in stats.values()), stats
  # Its Newton–Schulz work is each device's own matrices: one eighth of the stack's.
  own = shape[0] // 8 * newton_schulz_flops(*shape[1:])
  assert own <= compiled.cost_analysis()["flops"] < 1.1 * own + 50 * math.prod(shape) / 8
