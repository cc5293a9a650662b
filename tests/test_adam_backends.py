"""The aux AdamW backends: same losses as the reference, state convertible between them."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close

import muon_optax as mo

VOCAB, D, HIDDEN, BATCH = 32, 16, 32, 16


def commit(tree):
  """Arrays committed to the default device, as a step returns them: jit specializes on
  committed vs not once some state lives in host memory."""
  return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, jax.devices()[0]), tree)


def make_params():
  k = jax.random.split(jax.random.key(0), 5)
  return commit({
      "embed": {"embedding": jax.random.normal(k[0], (VOCAB, D))},
      "mlp_in": {"kernel": jax.random.normal(k[1], (D, HIDDEN)) / D**0.5, "bias": jnp.zeros(HIDDEN)},
      "mlp_out": {"kernel": jax.random.normal(k[2], (HIDDEN, D)) / HIDDEN**0.5},
      "norm": {"scale": jnp.ones(D)},
      "lm_head": {"kernel": jax.random.normal(k[3], (D, VOCAB)) / D**0.5},
  })


def loss_fn(params, step):
  """Next-token cross-entropy of a one-block model on a batch fixed by `step`."""
  x = jax.random.randint(jax.random.fold_in(jax.random.key(1), step), (BATCH,), 0, VOCAB)
  y = (3 * x + 1) % VOCAB  # a rule to learn
  h = params["embed"]["embedding"][x] * params["norm"]["scale"]
  h = h + jnp.tanh(h @ params["mlp_in"]["kernel"] + params["mlp_in"]["bias"]) @ params["mlp_out"]["kernel"]
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["lm_head"]["kernel"], y).mean()


# Weight decay on everything but the norm scale and the bias; schedules for lr and decay.
MASK = {"embed": {"embedding": True}, "mlp_in": {"kernel": True, "bias": False},
        "mlp_out": {"kernel": True}, "norm": {"scale": False}, "lm_head": {"kernel": True}}


def make_tx(backend, *, nesterov=True, offload_momentum=False):
  adam = mo.AuxAdam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 100), weight_decay=
                    optax.linear_schedule(0.1, 0.01, 100), mask=MASK, nesterov=nesterov)
  return mo.muon(0.02, weight_decay=0.01, adam=adam, adam_backend=backend,
                 offload_momentum=offload_momentum)


# Every arm of the comparison, run side by side in one jitted step so that the whole
# file compiles the model and optimizer once: (backend, nesterov, offload_momentum).
# Nesterov off is compared on AdamW alone (test_standalone_backends_equal_optax_adamw).
ARMS = tuple((b, True, False) for b in mo.BACKENDS) + (("offload", True, True),)


def arm(backend, nesterov=True, offload_momentum=False):
  return ARMS.index((backend, nesterov, offload_momentum))


@functools.cache
def arms_step():
  txs = tuple(make_tx(b, nesterov=n, offload_momentum=o) for b, n, o in ARMS)

  @jax.jit
  def step(params, states, i):
    out = []
    for tx, p, s in zip(txs, params, states):
      loss, grads = jax.value_and_grad(loss_fn)(p, i)
      updates, s = tx.update(grads, s, p)
      out.append((optax.apply_updates(p, updates), s, loss))
    return tuple(zip(*out))

  return txs, step


def run_arms(steps, params=None, states=None, start=0):
  """`steps` training steps of every arm -> (params, states, losses of shape (steps, arms))."""
  txs, step = arms_step()
  params = tuple(make_params() for _ in ARMS) if params is None else tuple(params)
  states = tuple(commit(tx.init(p)) for tx, p in zip(txs, params)) if states is None else tuple(states)
  losses = []
  for i in range(start, start + steps):
    params, states, loss = step(params, states, i)
    losses.append(loss)
  return params, states, np.array(losses)


@functools.cache
def hundred_steps():
  return run_arms(100)


def adam_state(state):
  return state.inner_states["adam"].inner_state


def test_every_backend_matches_reference_for_100_steps():
  _, states, losses = hundred_steps()
  ref = losses[:, arm("reference")]
  assert ref[-1] < ref[0] - 0.5  # it trains
  for backend, state_type in [("optax", optax.ScaleByAdamState), ("flat", mo.FlatAdamState),
                              ("offload", mo.OffloadAdamState)]:
    np.testing.assert_allclose(losses[:, arm(backend)], ref, rtol=0, atol=1e-5, err_msg=backend)
    assert isinstance(adam_state(states[arm(backend)]), state_type)


def test_offloaded_muon_momentum_matches_reference():
  _, states, losses = hundred_steps()
  np.testing.assert_allclose(losses[:, arm("offload", True, True)], losses[:, arm("reference")],
                             rtol=0, atol=1e-5)
  state = states[arm("offload", True, True)]
  momentum = state.inner_states["muon"].inner_state[0][0].mu["mlp_in"]["kernel"]
  assert momentum.sharding.memory_kind == "pinned_host"
  assert momentum.shape == (D, HIDDEN)  # whole matrices, orthogonalized as such
  for leaf in jax.tree.leaves(adam_state(state).mu):
    assert leaf.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("nesterov", [True, False])
def test_standalone_backends_equal_optax_adamw(nesterov):
  params = make_params()
  sched = optax.linear_schedule(1e-2, 1e-3, 20)
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)
  txs = [optax.adamw(sched, weight_decay=0.1, mask=MASK, nesterov=nesterov)] + [
      mo.adamw(sched, weight_decay=0.1, mask=MASK, nesterov=nesterov, backend=b)
      for b in mo.BACKENDS]

  @jax.jit
  def run_three():
    results = []
    for tx in txs:
      p, s = params, tx.init(params)
      for _ in range(3):
        u, s = tx.update(grads, s, p)
        p = optax.apply_updates(p, u)
      results.append(p)
    return results

  expected, *results = run_three()
  for result in results:
    assert_trees_close(result, expected, rtol=0, atol=1e-6)


@functools.cache
def three_steps():
  return run_arms(3)


@pytest.mark.parametrize("source", mo.BACKENDS)
def test_conversion_resumes_exactly(source):
  """Three steps under `source`, then two more under every backend from the converted
  state == two more under `source`, uninterrupted."""
  params3, states3, _ = three_steps()
  src = arm(source)
  params, states = list(params3), list(states3)
  for target in mo.BACKENDS:
    if target != source:
      params[arm(target)] = params3[src]
      states[arm(target)] = mo.convert_adam_state(states3[src], params3[src], target)
  same = mo.convert_adam_state(states3[src], params3[src], source)
  assert_trees_close(same, states3[src], rtol=0, atol=0)
  p5, s5, losses = run_arms(2, params, states, start=3)
  for target in mo.BACKENDS:
    # optax's own scale_by_adam rounds a little differently from the other three.
    tol = 1e-6 if "optax" in (source, target) and source != target else 0
    np.testing.assert_allclose(losses[:, arm(target)], losses[:, src], rtol=0, atol=tol,
                               err_msg=f"{source} -> {target}")
    assert_trees_close(p5[arm(target)], p5[src], rtol=0, atol=tol)
    assert_trees_close(mo.convert_adam_state(s5[arm(target)], p5[arm(target)], "reference"),
                       mo.convert_adam_state(s5[src], p5[src], "reference"), rtol=0, atol=tol)
  assert arms_step()[1]._cache_size() == 1  # converted states fit the compiled step


def test_conversion_inside_a_chain_and_standalone():
  params = make_params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), make_tx("flat"))
  state = mo.convert_adam_state(tx.init(params), params, "optax")
  assert isinstance(state[1].inner_states["adam"].inner_state, optax.ScaleByAdamState)
  flat = mo.adamw(1e-3, backend="flat")
  converted = mo.convert_adam_state(flat.init(params), params, "reference")
  assert isinstance(converted, mo.ReferenceAdamState)
  assert converted.mu["mlp_in"]["kernel"].shape == (D, HIDDEN)


def test_optax_adamw_chain_state_is_migrated():
  """A state written by muon(adam=optax.adamw(...)) continues under any backend."""
  params = make_params()
  legacy = mo.muon(0.02, adam=optax.adamw(1e-3, weight_decay=0.1))
  new = mo.muon(0.02, adam=mo.AuxAdam(1e-3, weight_decay=0.1), adam_backend="flat")
  grads = jax.tree.map(jnp.sin, params)

  @jax.jit
  def second_step(params):
    u, state = legacy.update(grads, legacy.init(params), params)
    p = optax.apply_updates(params, u)
    return legacy.update(grads, state, p)[0], new.update(grads, mo.convert_adam_state(state, p, "flat"), p)[0]

  u_legacy, u_new = second_step(params)
  assert_trees_close(u_new, u_legacy, rtol=0, atol=1e-7)


class OldAdamState(NamedTuple):  # a foreign layout: one field short
  count: jax.Array
  mu: optax.Updates


class BiasCorrectedAdamState(NamedTuple):  # a foreign layout: one field too many
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  bias_correction: jax.Array


def test_old_layout_errors_name_the_fields():
  params = make_params()
  tx = make_tx("reference")
  state = tx.init(params)
  ref = adam_state(state)

  def with_adam(inner):
    return state._replace(inner_states={**state.inner_states, "adam": optax.MaskedState(inner)})

  with pytest.raises(ValueError, match=r"missing field\(s\) \['nu'\]"):
    mo.convert_adam_state(with_adam(OldAdamState(ref.count, ref.mu)), params, "flat")
  with pytest.raises(ValueError, match=r"unexpected field\(s\) \['bias_correction'\]"):
    mo.convert_adam_state(
        with_adam(BiasCorrectedAdamState(ref.count, ref.mu, ref.nu, ref.count)), params, "flat")
  # Resuming under another backend without converting: a clear error, not a KeyError.
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.raises(ValueError, match="expects a FlatAdamState but got a ReferenceAdamState"):
    jax.eval_shape(make_tx("flat").update, grads, state, params)
  # A flat state that belongs to other params (or labels).
  flat_state = make_tx("flat").init(params)
  with pytest.raises(ValueError, match="does not fit these params"):
    mo.convert_adam_state(flat_state, {**params, "extra_bias": jnp.zeros(3)}, "optax")
  with pytest.raises(ValueError, match="found no AdamW state"):
    mo.convert_adam_state({"count": jnp.zeros([])}, params, "flat")
  with pytest.raises(ValueError, match="unknown AdamW backend"):
    mo.adamw(backend="fused")


def test_orbax_checkpoint_converts_on_restore(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  params3, states3, _ = three_steps()
  flat, optax_arm = arm("flat"), arm("optax")
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": params3[flat], "opt": states3[flat]})
  abstract = jax.eval_shape(lambda: {"params": params3[flat], "opt": states3[flat]})
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
  params, states = list(params3), list(states3)
  params[optax_arm] = restored["params"]
  states[optax_arm] = mo.convert_adam_state(restored["opt"], restored["params"], "optax")
  _, _, losses = run_arms(2, params, states, start=3)
  np.testing.assert_allclose(losses[:, optax_arm], losses[:, flat], rtol=0, atol=1e-6)


def test_offload_keeps_the_state_sharding():
  """ZeRO-style sharded params: the offloaded moments stay sharded, in host memory."""
  mesh = jax.make_mesh((8,), ("data",))
  params = jax.device_put({"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones(16)},
                          jax.sharding.NamedSharding(mesh, jax.P("data")))
  tx = mo.adamw(1e-2, backend="offload")
  step = jax.jit(tx.update)
  state = tx.init(params)
  for _ in range(2):
    _, state = step(params, state, params)
    for leaf in jax.tree.leaves((state.mu, state.nu)):
      assert leaf.sharding.memory_kind == "pinned_host"
      assert leaf.sharding.spec[0] == "data"
  assert step._cache_size() == 1  # the state from init and from a step compile alike


def test_mixed_dtypes_and_bfloat16_moments():
  """bfloat16 and float32 leaves: one flat buffer per dtype, bfloat16 first moments kept."""
  params = {"a": jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(3, 4),
            "b": jnp.linspace(0, 1, 5, dtype=jnp.float32), "c": jnp.ones(7, jnp.bfloat16)}
  grads = jax.tree.map(lambda p: jnp.cos(p * 3), params)
  txs = {b: mo.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.bfloat16, backend=b) for b in mo.BACKENDS}

  @jax.jit
  def two_steps():
    out = {}
    for name, tx in txs.items():
      p, s = params, tx.init(params)
      for _ in range(2):
        u, s = tx.update(grads, s, p)
        p = optax.apply_updates(p, u)
      out[name] = (p, s)
    return out

  out = two_steps()
  flat_state = out["flat"][1]
  assert {k: (v.shape, v.dtype) for k, v in flat_state.mu.items()} == {
      "bfloat16": ((19,), jnp.bfloat16), "float32": ((5,), jnp.bfloat16)}
  assert flat_state.nu["bfloat16"].dtype == jnp.bfloat16 and flat_state.nu["float32"].dtype == jnp.float32
  for name, (p, s) in out.items():
    assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)
    assert_trees_close(p, out["reference"][0], rtol=0, atol=1e-2 if name == "optax" else 0)
  # flat -> reference -> flat is lossless, dtypes included.
  round_trip = mo.convert_adam_state(mo.convert_adam_state(flat_state, params, "reference"), params, "flat")
  assert_trees_close(round_trip, flat_state, rtol=0, atol=0)
  assert jax.tree.map(lambda x: x.dtype, round_trip) == jax.tree.map(lambda x: x.dtype, flat_state)
