"""`muon` against a plain per-leaf implementation, and the contract every optimizer must pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close, float32_bound, rel

import muon_optax as mo
from muon_optax._util import paths

JORDAN = (3.4445, -4.7750, 2.0315)


def plain_ns(g, steps=5):
  """Textbook quintic Newton–Schulz on one matrix, float64 numpy."""
  x = np.asarray(g, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / np.linalg.norm(x)
  a, b, c = JORDAN
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def make_params(key=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(key), 6)
  n = lambda k, s: jax.random.normal(k, s, dtype) * 0.1
  return {
      "embed": {"embedding": n(ks[0], (32, 16))},
      "blocks": {"mlp": {"kernel": n(ks[1], (3, 16, 48)), "bias": n(ks[2], (3, 48))}},
      "proj": {"kernel": n(ks[3], (48, 16))},
      "ln": {"scale": jnp.ones(16, dtype)},
      "lm_head": {"kernel": n(ks[4], (16, 32))},
  }


def grads_at(step, params):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(100 + step), p.shape, p.dtype), params)


class PlainMuonAdamW:
  """Reference written leaf by leaf, independent of the library's code paths."""

  def __init__(self, lr, adam_lr, beta=0.95, wd=0.0, b1=0.9, b2=0.999, eps=1e-8):
    self.__dict__.update(lr=lr, adam_lr=adam_lr, beta=beta, wd=wd, b1=b1, b2=b2, eps=eps)
    self.t, self.state = 0, {}

  def muon_leaf(self, path, p, g):
    m = self.state.get(path, np.zeros_like(g))
    m = self.beta * m + (1 - self.beta) * g
    self.state[path] = m
    u = (1 - self.beta) * g + self.beta * m
    mats = u.reshape(-1, *u.shape[-2:])
    o = np.stack([plain_ns(x) * np.sqrt(max(1, x.shape[1] / x.shape[0])) for x in mats])
    return p - self.lr * (o.reshape(u.shape) + self.wd * p)

  def adam_leaf(self, path, p, g):
    m, v = self.state.get(path, (np.zeros_like(g), np.zeros_like(g)))
    m = self.b1 * m + (1 - self.b1) * g
    v = self.b2 * v + (1 - self.b2) * g * g
    self.state[path] = (m, v)
    mh, vh = m / (1 - self.b1**self.t), v / (1 - self.b2**self.t)
    return p - self.adam_lr * mh / (np.sqrt(vh) + self.eps)

  def step(self, params, grads):
    self.t += 1
    out = {}
    for path, p in params.items():
      g = grads[path]
      is_muon = path in ("blocks/mlp/kernel", "proj/kernel")
      out[path] = (self.muon_leaf if is_muon else self.adam_leaf)(path, p, g)
    return out


def flat(tree):
  return {k: np.asarray(v, np.float64) for k, v in paths.leaves_with_path(tree)}


def test_multi_step_equality_with_plain_reference():
  params = make_params()
  tx = mo.muon(0.05, ns=mo.NewtonSchulz("jordan", steps=5), weight_decay=0.1,
              adam=mo.AuxAdam(learning_rate=1e-2))
  ref = PlainMuonAdamW(0.05, 1e-2, wd=0.1)
  state, ref_params = tx.init(params), flat(params)
  update = jax.jit(tx.update)
  for step in range(4):
    grads = grads_at(step, params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_params = ref.step(ref_params, flat(grads))
    for path, value in flat(params).items():
      np.testing.assert_allclose(value, ref_params[path], atol=2e-5, err_msg=f"{path} step {step}")


def test_grouped_orthogonalization_equals_per_leaf():
  ks = jax.random.split(jax.random.key(1), 4)
  tree = {"a": {"kernel": jax.random.normal(ks[0], (16, 24))},
          "b": {"kernel": jax.random.normal(ks[1], (24, 16))},  # transposed: same group
          "c": {"kernel": jax.random.normal(ks[2], (2, 16, 24))},
          "d": {"kernel": jax.random.normal(ks[3], (8, 8))}}
  tx = mo.orthogonalize("polar_express")
  out, _ = jax.jit(tx.update)(tree, tx.init(tree))
  expected = jax.tree.map(lambda x: mo.newton_schulz(x, "polar_express"), tree)
  # A batched matmul may round differently from a single one. Each float32 result is
  # within steps · eps32 · ∏|a_k| (relative) of the exact polynomial: allow twice that.
  bound = float32_bound("polar_express")
  for name in tree:
    o, e = np.asarray(out[name]["kernel"], np.float64), np.asarray(expected[name]["kernel"])
    assert np.linalg.norm(o - e) < 2 * bound * np.linalg.norm(e), name


def test_no_recompile_on_second_update():
  params = make_params()
  tx = mo.muon(0.02)
  update = jax.jit(tx.update)
  state = tx.init(params)
  _, state = update(grads_at(0, params), state, params)
  with jax.log_compiles():
    traces = update._cache_size()
    _, state = update(grads_at(1, params), state, params)
    assert update._cache_size() == traces


def test_bf16_params_give_bf16_updates_and_state():
  params = make_params(dtype=jnp.bfloat16)
  tx = mo.muon(0.02, mu_dtype=jnp.bfloat16, adam=mo.AuxAdam(mu_dtype=jnp.bfloat16))
  state = tx.init(params)
  updates, state2 = jax.jit(tx.update)(grads_at(0, params), state, params)
  assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
  assert jax.tree.map(lambda x: x.dtype, state2) == jax.tree.map(lambda x: x.dtype, state)
  assert all(np.all(np.isfinite(np.asarray(u, np.float32))) for u in jax.tree.leaves(updates))


def test_mu_dtype_float32_with_bf16_params():
  params = make_params(dtype=jnp.bfloat16)
  tx = mo.muon(0.02, mu_dtype=jnp.float32)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads_at(0, params), state, params)
  mus = [x for x in jax.tree.leaves(state) if x.ndim >= 2 and x.shape in ((3, 16, 48), (48, 16))]
  assert mus and all(m.dtype == jnp.float32 for m in mus)
  assert updates["proj"]["kernel"].dtype == jnp.bfloat16


def test_converges_on_a_quadratic():
  target = jax.random.normal(jax.random.key(2), (16, 32))
  params = {"w": {"kernel": jnp.zeros((16, 32))}, "b": {"bias": jnp.zeros(32)}}
  loss = lambda p: jnp.sum((p["w"]["kernel"] - target) ** 2) + jnp.sum((p["b"]["bias"] - 1) ** 2)
  tx = mo.muon(optax.linear_schedule(0.05, 0.0, 300), adam=mo.AuxAdam(learning_rate=0.05))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    g = jax.grad(loss)(params)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  first = loss(params)
  for _ in range(300):
    params, state = step(params, state)
  assert loss(params) < 1e-2 * first


def test_inject_hyperparams_gives_the_same_results():
  params = make_params()
  ns = mo.NewtonSchulz("jordan", steps=5)
  plain = mo.muon(0.03, beta=0.9, weight_decay=0.01, ns=ns)
  injected = optax.inject_hyperparams(mo.muon)(learning_rate=0.03, beta=0.9, weight_decay=0.01,
                                               ns=ns)
  s1, s2 = plain.init(params), injected.init(params)
  p1 = p2 = params
  for step in range(3):
    g = grads_at(step, params)
    u1, s1 = jax.jit(plain.update)(g, s1, p1)
    u2, s2 = jax.jit(injected.update)(g, s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
  assert_trees_close(p2, p1, rtol=0, atol=1e-6)
  s2.hyperparams["learning_rate"] = jnp.asarray(0.0)
  u, _ = jax.jit(injected.update)(grads_at(9, params), s2, p2)
  assert float(jnp.abs(u["proj"]["kernel"]).max()) == 0.0


def test_multisteps_equals_one_big_batch():
  params = make_params()
  k = 3
  micro = [grads_at(i, params) for i in range(k)]
  big = jax.tree.map(lambda *g: sum(g) / k, *micro)
  tx = mo.muon(0.02)
  u_big, _ = tx.update(big, tx.init(params), params)
  ms = optax.MultiSteps(mo.muon(0.02), every_k_schedule=k)
  state = ms.init(params)
  update = jax.jit(ms.update)
  for g in micro:
    u, state = update(g, state, params)
  assert_trees_close(u, u_big, rtol=0, atol=1e-6)


def test_chain_with_clipping_and_apply_if_finite():
  params = make_params()
  tx = optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(1.0), mo.muon(0.02)), max_consecutive_errors=3)
  state = tx.init(params)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads_at(0, params))
  u, state = jax.jit(tx.update)(bad, state, params)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u))
  assert int(state.notfinite_count) == 1
  u, state = jax.jit(tx.update)(grads_at(1, params), state, params)
  assert int(state.notfinite_count) == 0
  assert float(jnp.abs(u["proj"]["kernel"]).max()) > 0


def test_schedules_on_both_branches():
  params = make_params()
  tx = mo.muon(optax.constant_schedule(0.0), adam=mo.AuxAdam(optax.constant_schedule(0.0)))
  u, _ = jax.jit(tx.update)(grads_at(0, params), tx.init(params), params)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u))
  tx = mo.muon(optax.linear_schedule(0.0, 1.0, 10), adam=mo.AuxAdam(optax.constant_schedule(0.0)))
  state = tx.init(params)
  u0, state = tx.update(grads_at(0, params), state, params)
  u1, state = tx.update(grads_at(1, params), state, params)
  assert float(jnp.abs(u0["proj"]["kernel"]).max()) == 0
  assert float(jnp.abs(u1["proj"]["kernel"]).max()) > 0
  assert float(jnp.abs(u1["embed"]["embedding"]).max()) == 0


def test_branches_share_no_hyperparameter():
  params = make_params()
  tx = mo.muon(0.02, beta=0.5, nesterov=False, weight_decay=0.3)
  u, _ = tx.update(grads_at(0, params), tx.init(params), params)
  adam = optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
  adam_params = {"embedding": params["embed"]["embedding"]}
  ua, _ = adam.update({"embedding": grads_at(0, params)["embed"]["embedding"]},
                      adam.init(adam_params), adam_params)
  np.testing.assert_allclose(u["embed"]["embedding"], ua["embedding"], atol=1e-7)


def test_weight_decay_mask_pytree_and_frozen_label():
  params = make_params()
  mask = jax.tree.map(lambda _: False, params)
  mask["proj"]["kernel"] = True
  labels = [(r"^blocks/", "frozen"), *mo.DEFAULT_RULES]
  tx = mo.muon(0.0, weight_decay=0.5, weight_decay_mask=mask,
               routing=mo.Routing.from_rules(labels))
  u, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  assert float(jnp.abs(u["blocks"]["mlp"]["kernel"]).max()) == 0
  assert float(jnp.abs(u["proj"]["kernel"]).max()) == 0  # lr 0 scales the decay too
  tx = mo.muon(1.0, weight_decay=0.5, weight_decay_mask=mask,
               routing=mo.Routing.from_rules(labels))
  u, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  np.testing.assert_allclose(u["proj"]["kernel"], -0.5 * params["proj"]["kernel"], atol=1e-7)
  assert float(jnp.abs(u["blocks"]["mlp"]["kernel"]).max()) == 0


def test_abstract_init_from_shape_dtype_structs():
  params = make_params()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  tx = mo.muon(0.02)
  shapes = jax.eval_shape(tx.init, abstract)
  real = tx.init(params)
  assert jax.tree.structure(shapes) == jax.tree.structure(real)
  assert jax.tree.map(lambda s, r: s.shape == r.shape and s.dtype == r.dtype, shapes, real)


def test_muon_state_is_one_buffer_per_matrix():
  params = {"w": {"kernel": jnp.zeros((64, 32))}}
  state = mo.muon(0.02).init(params)
  muon_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 2)
  assert muon_bytes == params["w"]["kernel"].nbytes


def test_ns_preset_does_not_change_state_structure():
  params = make_params()
  a = jax.tree.structure(mo.muon(ns="jordan").init(params))
  b = jax.tree.structure(mo.muon(ns=mo.NewtonSchulz("polar_express", steps=8)).init(params))
  assert a == b


@pytest.mark.parametrize("kwargs, match", [
    (dict(ns="nope"), "unknown Newton–Schulz preset"),
    (dict(scale="huge"), "unknown scale"),
    (dict(ns=np.ones((3, 2))), r"\(n, 3\)"),
])
def test_bad_options_fail_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mo.muon(0.02, **kwargs)


def test_bad_labels_name_the_path():
  params = make_params()
  with pytest.raises(ValueError, match="'ln/scale'.*no matrix view"):
    mo.muon(routing=mo.Routing.from_rules([(r"ln/scale", "muon"), *mo.DEFAULT_RULES])).init(params)
  with pytest.raises(ValueError, match="'proj/kernel'.*label 'sgd'.*no transform"):
    mo.muon(routing=mo.Routing.from_rules([(r"proj", "sgd"), *mo.DEFAULT_RULES])).init(params)
  with pytest.raises(ValueError, match="no routing rule places parameter 'blocks/mlp/bias'"):
    mo.muon(routing=mo.Routing.from_rules([(r"kernel", "muon"), (r"embed", "adam")])).init(params)
  int_params = {"count": {"kernel": jnp.zeros((4, 4), jnp.int32)}}
  for label in ("muon", "adam"):
    with pytest.raises(ValueError, match=f"'count/kernel' is labelled '{label}'.*int32.*frozen"):
      mo.muon(routing={"count": label}).init(int_params)
  complex_params = {"z": {"kernel": jnp.zeros((4, 4), jnp.complex64)}}
  with pytest.raises(ValueError, match="'z/kernel'.*complex64"):
    mo.muon().init(complex_params)


def test_the_family_is_one_builder_with_component_values():
  # normuon and adamuon are scale_by_muon with their SecondMoment, inside muon's branches.
  params = {"w": jax.random.normal(jax.random.key(3), (8, 16)), "b": jnp.zeros(16)}
  grads = jax.tree.map(lambda p: jnp.cos(2 * p + 1), params)
  hidden = {"w": params["w"]}
  for alias, moment, scale in (
      (mo.normuon, mo.SecondMoment("neurons", b2=0.9, eps=1e-10, rescale="norm"), "jordan"),
      (mo.adamuon, mo.SecondMoment("elements", b2=0.9, eps=1e-8, rescale="rms"), "moonlight")):
    tx = alias(0.1, b2=0.9, adam=mo.AuxAdam(1e-2))
    direction = optax.chain(mo.scale_by_muon(scale=scale, normalize=moment), optax.scale(-0.1))
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = direction.update({"w": grads["w"]}, direction.init(hidden), hidden)
    np.testing.assert_array_equal(got["w"], want["w"])
  with pytest.raises(ValueError, match="scale='adaptive' and normalize= are two ways"):
    mo.scale_by_muon(scale="adaptive", normalize=mo.SecondMoment())


@pytest.mark.parametrize("make", [mo.muon, mo.dion2, mo.nordion2])
def test_an_update_without_params_is_checked_against_the_state(make):
  # Without params the gradients are checked against the state tree that mirrors them:
  # Muon's momentum, or Dion2's buffer (Dion2 has no momentum), and a mismatch is named.
  params = {"w": jnp.ones((8, 16)), "b": jnp.zeros(16)}
  tx = make(0.02)
  state = tx.init(params)
  with pytest.raises(ValueError, match="'w'"):
    tx.update({"w": jnp.ones((8, 8)), "b": params["b"]}, state)


def test_ns_array_under_inject_hyperparams():
  params = {"w": {"kernel": jax.random.normal(jax.random.key(0), (4, 8))}}
  ns = np.tile(np.asarray(mo.PRESETS["jordan"][0][0]), (5, 1))
  tx = optax.inject_hyperparams(mo.muon)(learning_rate=0.02, ns=ns)
  u, _ = jax.jit(tx.update)(params, tx.init(params), params)
  ref = mo.muon(0.02, ns=mo.NewtonSchulz("jordan", steps=5))
  ur, _ = ref.update(params, ref.init(params), params)
  # Same maths; only the coefficients' float32 vs float64 rounding differs.
  assert rel(u["w"]["kernel"], ur["w"]["kernel"]) < 2 * float32_bound(
      mo.NewtonSchulz("jordan", steps=5))
  bad = optax.inject_hyperparams(mo.muon)(ns=np.ones((5, 2)))
  with pytest.raises(ValueError, match=r"shape \(n, 3\).*\(5, 2\)"):
    jax.jit(bad.update)(params, bad.init(params), params)
