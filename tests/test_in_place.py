"""Owned stacks: matrices that lie whole on their devices, or will once the devices of a
count block swap shards, are orthogonalized there, as on one device: with no exchange,
or with one all-to-all inside each block and one back."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_trees_close, float32_bound, rel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import (
  AUTO,
  EXPLICIT,
  compiled_update_text,
  mesh_of,
  optimizer,
  param_shardings,
  placed,
  run_steps,
)

import muon_optax as mo
from benchmarks.hlo import collective_ops, collective_stats
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


# Stacks of matrices on their last two axes: scanned experts, (layers, experts, d, ffn),
# are one matrix per layer and expert.
SCANNED = mo.Routing.from_labels(
    lambda p: jax.tree.map(lambda _: "muon", p),
    views=lambda path, shape: mo.MatrixView(tuple(range(len(shape) - 2)), (-2,), (-1,)))


@pytest.mark.parametrize("types", [AUTO, EXPLICIT])
@pytest.mark.parametrize("experts, spec, swaps", [
    (8, P(None, ("expert", "data")), 0),  # each device holds its expert's layers whole
    (4, P(None, "expert", "data", None), 2),  # FSDP splits them over an expert's 2 devices
])
def test_scanned_experts_split_on_their_expert_axis_stay_on_their_devices(types, experts, spec,
                                                                           swaps):
  """The layer axis leads the leaf, the expert axis is split: the matrices are stacked
  experts first, so that each expert's stay on its devices, swapped at most among them."""
  mesh = mesh_of((2, 4), ("data", "expert"), types)
  params = {"experts": {"kernel": 0.1 * jax.random.normal(jax.random.key(3),
                                                          (2, experts, 16, 32))}}
  pshard = {"experts": {"kernel": NamedSharding(mesh, spec)}}
  layout = mo.MeshLayout(mesh, params=pshard)
  tx = mo.muon(0.05, weight_decay=0.01, mesh=layout, routing=SCANNED)
  want_p, want_s = run_steps(mo.muon(0.05, weight_decay=0.01, routing=SCANNED), params, 3)
  got_p, got_s = run_steps(tx, params, 3, (mesh, pshard))
  # Each step's error is one float32 Newton–Schulz's, and they add up.
  tolerance = 3 * 2 * float32_bound()
  for got, want in [(got_p, want_p), (got_s, want_s)]:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel(np.asarray(g).reshape(1, -1), np.asarray(w).reshape(1, -1)) <= tolerance
  text = compiled_update_text(tx, params, layout, pshard)
  moved = [(op, group) for op, group, _, _ in collective_ops(text)]
  # Only all-to-alls, in and out, each among one expert's 2 devices.
  assert moved == [("all-to-all", 2)] * swaps, moved


def test_the_rest_is_dealt_around_the_work_of_owned_stacks():
  """Three small matrices beside experts whose Newton–Schulz work on every device is 17
  times one of theirs: whole, in a round of their own, they leave the plan 3.5% over its
  ideal, within tolerance, so they are not split, even where splits cost nothing
  (flops_per_byte=0). Nor does the memory cap make them split: it is twice the whole
  Muon state's shard, the experts' included. Unsplit, no collective runs inside an
  iteration: only the exchanges' all-to-alls."""
  mesh = mesh_of((2, 4), ("data", "expert"))
  key = jax.random.split(jax.random.key(5))
  params = {"experts": {"kernel": 0.1 * jax.random.normal(key[0], (16, 4, 32, 128))},
            "attn": {"kernel": 0.1 * jax.random.normal(key[1], (3, 32, 32))}}
  pshard = {"experts": {"kernel": NamedSharding(mesh, P(None, "expert", "data", None))},
            "attn": {"kernel": NamedSharding(mesh, P(None, "data"))}}
  layout = mo.MeshLayout(mesh, params=pshard, flops_per_byte=0, memory=2.0)
  tx = mo.muon(0.05, mesh=layout, routing=SCANNED)
  want_p, _ = run_steps(mo.muon(0.05, routing=SCANNED), params, 2)
  got_p, _ = run_steps(tx, params, 2, (mesh, pshard))
  for g, w in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
    assert rel(np.asarray(g).reshape(1, -1), np.asarray(w).reshape(1, -1)) <= 4 * float32_bound()
  text = compiled_update_text(tx, params, layout, pshard)
  assert {op for op, _, _, _ in collective_ops(text)} == {"all-to-all"}
