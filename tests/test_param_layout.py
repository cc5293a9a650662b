"""The params' layout stated once (`MeshLayout(mesh, params=shardings)`) or seen at init:
every layout users train in updates as one device does, in the collectives of an
Explicit mesh, on Auto meshes too; a guess that may be wrong says so."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import float32_bound, rel
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import compiled_update_text

import muon_optax as mo
from benchmarks.common import (
  LAYOUTS,
  gpt2_tree,
  layout_data_axis,
  layout_mesh,
  layout_shardings,
  layout_specs,
)
from benchmarks.hlo import collective_stats

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
STEPS = 2
# Two float32 evaluations of Newton–Schulz, each within float32_bound of float64's.
TOLERANCE = 2 * float32_bound()


def small_model(kind, key=0):
  """A 2-layer GPT-2-shaped tree (width 16) with biases and norms; EP adds 8 experts."""
  params = gpt2_tree(2, jax.random.key(key), d=16, vocab=64, ctx=0)
  if kind == "ep":
    params["moe"] = {"experts": {"kernel": 0.1 * jax.random.normal(jax.random.key(9), (8, 16, 32))}}
  return params


def optimizer(mesh):
  return mo.muon(0.05, weight_decay=0.01, mesh=mesh, adam=mo.AuxAdam(1e-2, backend="optax"))


def grads(params, step):
  return jax.tree.map(lambda p: jax.random.normal(jax.random.key(10 + step), p.shape), params)


def updates(tx, params, pshard=None, sshard=None, init=None):
  """Each step's updates from the same params (they depend on the momentum, which sums
  exactly, so every step's error is one Newton–Schulz's), and the last state."""
  if pshard is not None:
    params = jax.device_put(params, pshard)
  state = (init or tx.init)(params)
  step = jax.jit(tx.update, out_shardings=None if pshard is None else (pshard, sshard))
  out = []
  for s in range(STEPS):
    g = grads(params, s) if pshard is None else jax.device_put(grads(params, s), pshard)
    u, state = step(g, state, params)
    out.append(u)
  return out, state


def assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    g, w = g.reshape(1, -1), w.reshape(1, -1)
    if not np.any(w):
      np.testing.assert_array_equal(g, w)
    else:
      assert rel(g, w) <= TOLERANCE, (rel(g, w), TOLERANCE)


def stated(kind, types, params, exchanges=1):
  mesh = layout_mesh(kind, types)
  pshard = layout_shardings(kind, params, mesh)
  return mo.MeshLayout(mesh, params=pshard, data_axis=layout_data_axis(kind),
                       exchanges=exchanges), pshard


def collectives(tx, params, layout, pshard):
  """{collective: count} of the compiled update, state laid out by `state_shardings`."""
  text = compiled_update_text(tx, params, layout, pshard)
  return {k: n for k, (n, _) in collective_stats(text).items() if n}


# One all-to-all in, one out (exchanges=1). Where some leaves are replicated over the
# data axes (tensor-parallel layouts' biases and norms; under TP alone the embedding too),
# split there in the state, their AdamW updates come back in one packed all-gather.
# ZeRO-1's Muon updates come back in one all-gather instead of an all-to-all.
GATHER = {"all-to-all": 2, "all-gather": 1}
EXPECTED = {"fsdp": {"all-to-all": 2}, "ep": {"all-to-all": 2}, "fsdp_tp": GATHER, "3d": GATHER,
            "tp": GATHER, "zero1": {"all-to-all": 1, "all-gather": 2}}


@pytest.mark.parametrize("kind", LAYOUTS)
def test_every_layout_updates_as_one_device_in_the_collectives_of_an_explicit_mesh(kind):
  params = small_model(kind)
  want, want_state = updates(optimizer(None), params)
  counts = {}
  for types in (AUTO, EXPLICIT):
    layout, pshard = stated(kind, types, params)
    tx = optimizer(layout)
    sshard = mo.state_shardings(tx, jax.device_put(params, pshard), layout.mesh,
                                layout.data_axis)
    got, got_state = updates(tx, params, pshard, sshard,
                             jax.jit(tx.init, out_shardings=sshard))
    assert_close(got, want)
    assert_close(got_state, want_state)
    for u, h in zip(jax.tree.leaves(got[-1]), jax.tree.leaves(pshard)):
      assert u.sharding.is_equivalent_to(h, u.ndim), (u.sharding, h)
    counts[types] = collectives(tx, params, layout, pshard)
  assert counts[AUTO] == EXPECTED[kind], counts
  assert sum(counts[AUTO].values()) <= sum(counts[EXPLICIT].values()), counts


def test_an_expert_stack_whole_on_its_devices_moves_nothing():
  params = {"experts": small_model("ep")["moe"]["experts"]}
  for types in (AUTO, EXPLICIT):
    layout, pshard = stated("ep", types, params)
    assert collectives(optimizer(layout), params, layout, pshard) == {}


def test_a_bare_mesh_takes_the_layout_of_concrete_params_at_init():
  params = small_model("tp")
  layout, pshard = stated("tp", AUTO, params)
  bare = mo.MeshLayout(layout.mesh, exchanges=1)
  tx = optimizer(bare)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # seen, not guessed: no warning
    tx.init(jax.device_put(params, pshard))
    sshard = mo.state_shardings(tx, jax.device_put(params, pshard), layout.mesh)
    assert collectives(tx, params, bare, pshard) == EXPECTED["tp"]
  want, _ = updates(optimizer(None), params)
  got, _ = updates(tx, params, pshard, sshard)
  assert_close(got, want)


def test_a_guess_that_may_be_wrong_warns_once_and_names_the_fix():
  params = small_model("tp")
  layout, pshard = stated("tp", AUTO, params)
  tx = optimizer(mo.MeshLayout(layout.mesh, exchanges=1))
  abstract = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h),
                          params, pshard)
  jax.eval_shape(tx.init, abstract)  # traced: nothing to see
  with pytest.warns(UserWarning, match=r"MeshLayout\(mesh, params=<your param shardings>\)"):
    guessed = collectives(tx, params, layout, pshard)
  # The guess (FSDP) is wrong here, and costs collectives: the warning was due.
  assert sum(guessed.values()) > sum(EXPECTED["tp"].values())
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once per optimizer
    collectives(tx, params, layout, pshard)


def test_a_layout_string_the_params_contradict_at_init_warns():
  params = small_model("tp")
  layout, pshard = stated("tp", AUTO, params)
  placed = jax.device_put(params, pshard)
  with pytest.warns(UserWarning, match=r"params='sharded'\) says parameter '.*' lies as .*"
                                       r"MeshLayout\(mesh, params=<your param shardings>\)"):
    optimizer(mo.MeshLayout(layout.mesh, params="sharded")).init(placed)
  fsdp = mo.fsdp_shardings(params, layout.mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # FSDP params are what "sharded" says
    optimizer(mo.MeshLayout(layout.mesh, params="sharded")).init(jax.device_put(params, fsdp))


def test_logical_axis_rules_update_as_the_layout_they_resolve_to():
  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.initializers.normal(0.1)
      h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
      return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)

  mesh = layout_mesh("fsdp_tp")
  rules = (("embed", "data"), ("mlp", "model"))
  boxed = Mlp().init(jax.random.key(0), jnp.ones((1, 16)))["params"]
  params = nn.meta.unbox(boxed)
  logical = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  layout = mo.MeshLayout(mesh, params=logical, exchanges=1)
  resolved = {"Dense_0": {"kernel": P("data", "model"), "bias": P()},  # biases: no rule
              "Dense_1": {"kernel": P("model", "data"), "bias": P()}}
  assert jax.tree.map(lambda s: s.spec, logical) == resolved
  by_hand = mo.MeshLayout(mesh, params=resolved, exchanges=1)
  pshard = jax.tree.map(lambda s: NamedSharding(mesh, s), resolved)
  assert (collectives(optimizer(layout), params, layout, pshard)
          == collectives(optimizer(by_hand), params, by_hand, pshard))
  tx = optimizer(layout)
  want, _ = updates(optimizer(None), params)
  got, _ = updates(tx, params, pshard, mo.state_shardings(tx, params, layout))
  assert_close(got, want)


def test_nnx_sharding_metadata_states_the_layout_it_names():
  from flax import nnx

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.normal(0.1)
      self.fc = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("data", "model")),
                           rngs=rngs)
      self.proj = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, ("model", "data")),
                             rngs=rngs)

  mesh = layout_mesh("fsdp_tp")
  with jax.set_mesh(mesh):
    state = nnx.state(Mlp(nnx.Rngs(0)), nnx.Param)
  layout = mo.MeshLayout(mesh, params=nnx.get_named_sharding(state, mesh))
  assert layout.params.by_path == {"fc/kernel": P("data", "model"), "fc/bias": P(),
                                   "proj/kernel": P("model", "data"), "proj/bias": P()}
  for params in (state, nnx.to_pure_dict(state)):  # the paths of either form match
    optimizer(layout).init(params)


def test_state_shardings_follow_the_stated_layout():
  params = small_model("fsdp_tp")
  layout, pshard = stated("fsdp_tp", AUTO, params)
  tx = optimizer(layout)
  from_layout = mo.state_shardings(tx, params, layout)  # params carry no sharding
  from_params = mo.state_shardings(tx, jax.device_put(params, pshard), layout.mesh)
  assert from_layout == from_params
  mu = from_layout.inner_states["muon"].inner_state[0][0].mu
  assert mu["h_0"]["attn"]["qkv"]["kernel"].spec == P("data", "model")  # TP kept


def test_a_layout_that_does_not_fit_the_params_is_a_clear_error():
  params = small_model("tp")
  mesh = layout_mesh("tp")
  specs = layout_specs("tp", params, mesh)
  with pytest.raises(ValueError, match=r"no layout for parameter 'h_0/.*'params/h_0/.*pass "
                                       r"the shardings of the params tree the optimizer updates"):
    optimizer(mo.MeshLayout(mesh, params={"params": specs})).init(params)
  with pytest.raises(ValueError, match=r"splits dimension 6 of parameter 'w/kernel' 4 ways"):
    optimizer(mo.MeshLayout(mesh, params={"w": {"kernel": P("data")}})).init(
        {"w": {"kernel": jnp.ones((6, 10))}})
  with pytest.raises(ValueError, match=r"'embed', which is not an axis of the mesh.*"
                                       r"nn.logical_to_mesh_sharding"):
    mo.MeshLayout(mesh, params={"w": P("embed", None)})
  with pytest.raises(ValueError, match=r"the leaf at 'w' is a str; pass a pytree of "
                                       r"NamedSharding or PartitionSpec"):
    mo.MeshLayout(mesh, params={"w": "data"})
  other = layout_mesh("fsdp")
  with pytest.raises(ValueError, match=r"'w' is laid out on mesh \{'data': 8\}, not on"):
    mo.MeshLayout(mesh, params={"w": NamedSharding(other, P())})


def test_gpt2_small_tree_layouts_meet_their_collective_targets():
  # 12 layers, no biases: compile-only, Auto meshes, one exchange (all the tree needs).
  params = gpt2_tree(12, d=768, vocab=50304, ctx=0, small_leaves=False)
  targets = {"fsdp": 4, "fsdp_tp": 4, "3d": 4, "tp": 6, "zero1": 5}
  for kind, target in targets.items():
    layout, pshard = stated(kind, AUTO, params)
    auto = collectives(optimizer(layout), params, layout, pshard)
    assert sum(auto.values()) <= target, (kind, auto)
