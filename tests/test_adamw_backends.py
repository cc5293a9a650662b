"""The aux AdamW backends: optax's AdamW numbers, real and complex, from every backend."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close
from adamw_case import MASK, adam_state, arm, hundred_steps, make_params, make_tx

import muon_optax as mo
from muon_optax._adamw.backends import OffloadAdamState

EPS32 = float(jnp.finfo(jnp.float32).eps)


def test_every_backend_matches_reference_for_100_steps():
  _, states, losses = hundred_steps()
  ref = losses[:, arm("reference")]
  assert ref[-1] < ref[0] - 0.5  # it trains
  for backend, state_type in [("optax", optax.ScaleByAdamState), ("offload", OffloadAdamState)]:
    np.testing.assert_allclose(losses[:, arm(backend)], ref, rtol=0, atol=1e-5, err_msg=backend)
    assert isinstance(adam_state(states[arm(backend)]), state_type)


def run(txs, params, grads, steps):
  """`steps` updates of each transform from `params` with fixed `grads`, in one jit."""

  @jax.jit
  def go():
    out = []
    for tx in txs:
      p, s = params, tx.init(params)
      for _ in range(steps):
        u, s = tx.update(grads, s, p)
        p = optax.apply_updates(p, u)
      out.append(p)
    return out

  return go()


@pytest.mark.parametrize("nesterov", [True, False])
def test_standalone_backends_equal_optax_adamw(nesterov):
  params = make_params()
  sched = optax.linear_schedule(1e-2, 1e-3, 20)
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)
  txs = [optax.adamw(sched, weight_decay=0.1, mask=MASK, nesterov=nesterov)] + [
      mo.AuxAdam(sched, weight_decay=0.1, mask=MASK, nesterov=nesterov, backend=b).transform()
      for b in mo.BACKENDS]
  expected, *results = run(txs, params, grads, 3)
  for result in results:  # params of magnitude ≲ 4: a few float32 roundings of them
    assert_trees_close(result, expected, rtol=0, atol=8 * 4 * EPS32)


def complex_case():
  rng = np.random.default_rng(0)
  z = lambda *s: jnp.asarray(rng.standard_normal(s) + 1j * rng.standard_normal(s), jnp.complex64)
  params = {"w": z(3, 4), "b": z(4), "r": jnp.asarray(rng.standard_normal(5), jnp.float32)}
  grads = {"w": z(3, 4), "b": z(4), "r": jnp.asarray(rng.standard_normal(5), jnp.float32)}
  return params, grads


@pytest.mark.parametrize("nesterov", [True, False])
def test_complex_leaves_match_optax_adamw(nesterov):
  """v accumulates |g|² = g·ḡ (real), as optax does, not g² (complex)."""
  params, grads = complex_case()
  sched = optax.linear_schedule(1e-2, 1e-3, 20)
  txs = [optax.adamw(sched, weight_decay=0.1, nesterov=nesterov)] + [
      mo.AuxAdam(sched, weight_decay=0.1, nesterov=nesterov, backend=b).transform() for b in mo.BACKENDS]
  expected, *results = run(txs, params, grads, 3)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(params))
  for backend, result in zip(mo.BACKENDS, results):
    assert jax.tree.map(lambda x: x.dtype, result) == jax.tree.map(lambda x: x.dtype, params)
    for a, e in zip(jax.tree.leaves(result), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=0, atol=8 * scale * EPS32,
                                 err_msg=backend)


@pytest.mark.parametrize("backend", mo.BACKENDS)
def test_complex_first_step_is_the_unit_phase(backend):
  """The first Adam step is −lr·g/(|g| + eps): for g = 0.3 − 1j and lr 0.1, −0.0287 + 0.0958j."""
  g = np.array([0.3 - 1j, -2 + 0.5j, 1e-3j], np.complex128)
  # float64 reference; as in optax, the moments are scaled by 1 − b (a Python float) and
  # bias-corrected by 1 − bᵗ with b rounded to float32, so the two differ by ~1e-5.
  b1, b2 = (float(np.float32(b)) for b in (0.9, 0.999))
  m_hat, v_hat = (1 - 0.9) * g / (1 - b1), (1 - 0.999) * np.abs(g) ** 2 / (1 - b2)
  expected = -0.1 * m_hat / (np.sqrt(v_hat) + 1e-8)
  tx = mo.AuxAdam(0.1, backend=backend).transform()
  p = jax.device_put({"z": jnp.ones(3, jnp.complex64)}, jax.devices()[0])  # committed
  u, state = tx.update({"z": jnp.asarray(g, jnp.complex64)}, tx.init(p), p)
  np.testing.assert_allclose(np.asarray(u["z"]), expected, rtol=4 * EPS32)
  np.testing.assert_allclose(np.round(complex(u["z"][0]), 4), -0.0287 + 0.0958j)
  nu = np.asarray(state.nu["z"])  # (1 − b2)|g|²: real
  np.testing.assert_allclose(nu, 0.001 * np.abs(g) ** 2, rtol=4 * EPS32, atol=0)


def test_complex_parabola_converges_to_its_minimum():
  """f(z) = |z − (1 + 1j)|²; the steepest-descent direction is conj(jax.grad(f))."""
  target = jnp.array([1 + 1j, 1 + 1j], jnp.complex64)
  loss = lambda p: jnp.sum(jnp.abs(p["z"] - target) ** 2)
  txs = [optax.adamw(0.05, weight_decay=0.0)] + [mo.AuxAdam(0.05, backend=b).transform() for b in mo.BACKENDS]

  @jax.jit
  def solve():
    out = []
    for tx in txs:
      def body(_, carry):
        p, s = carry
        u, s = tx.update(jax.tree.map(jnp.conj, jax.grad(loss)(p)), s, p)
        return optax.apply_updates(p, u), s
      p = {"z": jnp.array([0, -3 + 2j], jnp.complex64)}
      out.append(jax.lax.fori_loop(0, 300, body, (p, tx.init(p)))[0]["z"])
    return out

  expected, *results = solve()
  np.testing.assert_allclose(np.asarray(expected), np.asarray(target), atol=1e-4)
  for backend, z in zip(mo.BACKENDS, results):
    np.testing.assert_allclose(np.asarray(z), np.asarray(target), atol=1e-4, err_msg=backend)


def test_mixed_dtypes_and_bfloat16_moments():
  """bfloat16 and float32 leaves with bfloat16 first moments: every backend agrees."""
  params = jax.device_put({"a": jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(3, 4),
                           "b": jnp.linspace(0, 1, 5, dtype=jnp.float32),
                           "c": jnp.ones(7, jnp.bfloat16)}, jax.devices()[0])  # committed
  grads = jax.tree.map(lambda p: jnp.cos(p * 3), params)
  txs = {b: mo.AuxAdam(1e-2, weight_decay=0.1, mu_dtype=jnp.bfloat16, backend=b).transform()
         for b in mo.BACKENDS}

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
  for name, (p, s) in out.items():
    assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(s.mu))
    assert jax.tree.map(lambda x: x.dtype, s.nu) == jax.tree.map(lambda x: x.dtype, params)
    # optax rounds its bfloat16 moments at other points: within a bfloat16 ulp of 1.
    atol = 2 * float(jnp.finfo(jnp.bfloat16).eps) if name == "optax" else 0
    assert_trees_close(p, out["reference"][0], rtol=0, atol=atol)


def test_backend_names_and_state_layouts_are_checked():
  with pytest.raises(ValueError, match=r"unknown AdamW backend 'fused'; use one of \('optax'"):
    mo.AuxAdam(backend="fused").transform()
  with pytest.raises(ValueError, match=r"unknown AdamW backend 'flat'"):
    mo.muon(adam=mo.AuxAdam(backend="flat"))
  params = make_params()
  grads = jax.tree.map(jnp.ones_like, params)
  state = make_tx("reference").init(params)
  # Resuming under another backend without converting: a clear error, not a KeyError.
  with pytest.raises(ValueError, match="expects a ScaleByAdamState but got a ReferenceAdamState"
                     r".*convert_adam_state\(state, params, 'optax'\)"):
    jax.eval_shape(make_tx("optax").update, grads, state, params)


# optax.adamw's arguments as a user moving from it has them: its defaults, its names.
ADAMW_KWARGS = [
    {"learning_rate": 1e-2},  # optax.adamw's default weight decay, 1e-4, is not AuxAdam's 0
    {"learning_rate": optax.linear_schedule(1e-2, 1e-3, 20), "b1": 0.8, "b2": 0.95,
     "eps": 1e-6, "weight_decay": 0.1, "mask": MASK, "nesterov": True},
    {"learning_rate": 3e-3, "weight_decay": optax.linear_schedule(0.1, 0.0, 10),
     "mu_dtype": jnp.bfloat16},
]


@pytest.mark.parametrize("kwargs", ADAMW_KWARGS, ids=["defaults", "all set", "bfloat16 m"])
def test_aux_adam_from_adamw_is_optax_adamw(kwargs):
  """AuxAdam.from_adamw(**kw) updates as optax.adamw(**kw): alone, and as muon's aux branch."""
  params = make_params()
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)
  steps, atol = 3, 8 * 4 * EPS32  # params ≲ 4, as above
  if kwargs.get("mu_dtype") == jnp.bfloat16:
    # optax rounds b1·m to bfloat16 before adding (1 − b1)·g; AuxAdam adds in float32.
    # Each step's m̂/√v̂ (±1 here: the gradients are constant) is then off by ≤ 2 ulps
    # of bfloat16, times the rate.
    atol += steps * kwargs["learning_rate"] * 2 * float(jnp.finfo(jnp.bfloat16).eps)
  expected, ours = run([optax.adamw(**kwargs), mo.AuxAdam.from_adamw(**kwargs).transform()],
                       params, grads, steps)
  assert_trees_close(ours, expected, rtol=0, atol=atol)
  routing = mo.Routing.from_rules()
  expected, ours = run([mo.muon(0.02, routing=routing, adam=optax.adamw(**kwargs)),
                        mo.muon(0.02, routing=routing, adam=mo.AuxAdam.from_adamw(**kwargs))],
                       params, grads, steps)
  assert_trees_close(ours, expected, rtol=0, atol=atol)


def test_aux_adam_from_adamw_refuses_what_it_cannot_do():
  with pytest.raises(ValueError, match=r"eps_root.*adam=optax.adamw\(\.\.\., eps_root=1e-08\)"):
    mo.AuxAdam.from_adamw(1e-3, eps_root=1e-8)
  with pytest.raises(ValueError, match=r"\['beta1'\] are not optax.adamw arguments"):
    mo.AuxAdam.from_adamw(1e-3, beta1=0.9)
  with pytest.raises(ValueError, match="AuxAdam b2"):
    mo.AuxAdam.from_adamw(1e-3, b2=1.0)
  assert mo.AuxAdam.from_adamw(1e-3, eps_root=0.0, backend="reference") == mo.AuxAdam(
      1e-3, weight_decay=1e-4, backend="reference")
