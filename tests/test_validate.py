"""Hyperparameters are checked when the optimizer is built; `adam_learning_rate`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"embed": {"embedding": jax.random.normal(k1, (10, 4))},
          "mlp": {"kernel": jax.random.normal(k2, (4, 8)), "bias": jnp.linspace(-1, 1, 8)}}


def _grads(params, seed=1):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("kwargs, name, value", [
    ({"learning_rate": None}, "learning_rate", "None"),
    ({"learning_rate": "0.02"}, "learning_rate", "'0.02'"),
    ({"learning_rate": True}, "learning_rate", "True"),
    ({"learning_rate": float("nan")}, "learning_rate", "nan"),
    ({"learning_rate": np.ones(3)}, "learning_rate", "shape"),
    ({"beta": 1.5}, "beta", "1.5"),
    ({"beta": 1.0}, "beta", "1.0"),
    ({"beta": -0.1}, "beta", "-0.1"),
    ({"beta": None}, "beta", "None"),
    ({"learning_rate": -0.02}, "learning_rate", "-0.02"),
    ({"learning_rate": jnp.asarray(-0.02)}, "learning_rate", "-0.02"),
    ({"learning_rate": jnp.asarray(jnp.nan)}, "learning_rate", "nan"),
    ({"learning_rate": np.float32(-1)}, "learning_rate", "-1"),
    ({"adam_learning_rate": -3e-4}, "adam_learning_rate", "-0.0003"),
    ({"mu_dtype": jnp.int8}, "mu_dtype", "int8"),
    ({"ns": "nope"}, "preset", "'nope'"),
    ({"scale": "huge"}, "scale", "'huge'"),
    ({"weight_decay": -0.01}, "weight_decay", "-0.01"),
    ({"weight_decay": None}, "weight_decay", "None"),
    ({"adam_learning_rate": "3e-4"}, "adam_learning_rate", "'3e-4'"),
])
def test_muon_rejects_bad_hyperparameters_when_built(kwargs, name, value):
  with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(value)):
    mo.muon(**kwargs)


@pytest.mark.parametrize("kwargs, name, value", [
    ({"learning_rate": None}, "AuxAdam learning_rate", "None"),
    ({"learning_rate": "1e-3"}, "AuxAdam learning_rate", "'1e-3'"),
    ({"b1": 1.0}, "AuxAdam b1", "1.0"),
    ({"b2": -0.5}, "AuxAdam b2", "-0.5"),
    ({"b2": 1.2}, "AuxAdam b2", "1.2"),
    ({"eps": 0.0}, "AuxAdam eps", "0.0"),
    ({"eps": -1e-8}, "AuxAdam eps", "-1e-08"),
    ({"weight_decay": -1.0}, "AuxAdam weight_decay", "-1.0"),
    ({"learning_rate": -1e-3}, "AuxAdam learning_rate", "-0.001"),
    ({"learning_rate": jnp.asarray(jnp.nan)}, "AuxAdam learning_rate", "nan"),
    ({"mu_dtype": jnp.int8}, "AuxAdam mu_dtype", "int8"),
    ({"mu_dtype": "fast"}, "AuxAdam mu_dtype", "'fast'"),
    ({"backend": "fused"}, "AdamW backend", "'fused'"),
])
def test_aux_adam_rejects_bad_hyperparameters_when_built(kwargs, name, value):
  with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(value)):
    mo.AuxAdam(**kwargs)


def test_momentum_and_scale_by_muon_reject_bad_beta():
  for make in (mo.scale_by_muon_momentum, mo.scale_by_muon):
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\), got 1\.5"):
      make(1.5)


@pytest.mark.parametrize("make", [mo.normuon, mo.adamuon])
def test_the_family_checks_what_muon_checks_and_its_own(make):
  for kwargs, name in (({"learning_rate": -1.0}, "learning_rate"), ({"beta": 1.0}, "beta"),
                       ({"b2": 1.0}, "b2"), ({"scale": "adaptive"}, "scale")):
    with pytest.raises(ValueError, match=name):
      make(**kwargs)


def test_second_moment_settings_are_checked_when_built():
  for kwargs, match in (({"over": "rows"}, "over must be one of"),
                        ({"rescale": "max"}, "rescale must be one of"),
                        ({"b2": -0.1}, "b2 must be in"), ({"eps": 0.0}, "eps must be")):
    with pytest.raises(ValueError, match=match):
      mo.scale_by_second_moment(**kwargs)


@pytest.mark.parametrize("lr", [0.02, 1, np.float32(0.02), np.asarray(0.02), jnp.asarray(0.02),
                                optax.linear_schedule(0.0, 0.02, 10)])
def test_every_accepted_learning_rate_form_trains(lr):
  params = _params()
  tx = mo.muon(lr, beta=0.0, adam=mo.AuxAdam(lr, b1=0.0, eps=1e-6),
               adam_learning_rate=lr)
  updates, _ = jax.jit(tx.update)(_grads(params), tx.init(params), params)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


def test_injected_hyperparameters_skip_the_range_checks_and_still_work():
  params = _params()
  tx = optax.inject_hyperparams(mo.muon)(
      0.02, beta=0.9, weight_decay=0.1, adam_learning_rate=1e-3)
  state = tx.init(params)
  assert set(state.hyperparams) >= {"learning_rate", "beta", "weight_decay",
                                    "adam_learning_rate"}
  updates, _ = jax.jit(tx.update)(_grads(params), state, params)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


def _adam_reference(lr, params, grads, b1=0.9, b2=0.999):
  """optax.adamw on the AdamW leaves alone (embedding and bias), one step."""
  sub = lambda t: {"embedding": t["embed"]["embedding"], "bias": t["mlp"]["bias"]}
  tx = optax.adamw(lr, b1=b1, b2=b2, eps=1e-8, weight_decay=0.0)
  return tx.update(sub(grads), tx.init(sub(params)), sub(params))[0]


def test_adam_learning_rate_overrides_aux_adam_rate():
  params, grads = _params(), _grads(_params())
  tx = mo.muon(0.02, adam=mo.AuxAdam(learning_rate=1.0), adam_learning_rate=2e-3)
  updates, _ = tx.update(grads, tx.init(params), params)
  ref = _adam_reference(2e-3, params, grads)
  # Same formula, same float32 ops order up to XLA fusion: a few ulps of the update.
  tol = dict(rtol=8 * np.finfo(np.float32).eps, atol=0)
  np.testing.assert_allclose(updates["embed"]["embedding"], ref["embedding"], **tol)
  np.testing.assert_allclose(updates["mlp"]["bias"], ref["bias"], **tol)


def test_injecting_adam_learning_rate_changes_only_the_adam_leaves():
  params, grads = _params(), _grads(_params())
  tx = optax.inject_hyperparams(mo.muon)(0.02, adam_learning_rate=1e-3)
  state = tx.init(params)
  step = jax.jit(tx.update)
  before, _ = step(grads, state, params)
  state.hyperparams["adam_learning_rate"] = jnp.asarray(5e-3)
  after, _ = step(grads, state, params)
  ref = _adam_reference(5e-3, params, grads)
  tol = dict(rtol=8 * np.finfo(np.float32).eps, atol=0)
  np.testing.assert_allclose(after["embed"]["embedding"], ref["embedding"], **tol)
  np.testing.assert_allclose(after["mlp"]["bias"], ref["bias"], **tol)
  # The Muon leaf does not see the AdamW rate: bit-identical (same program, same inputs).
  np.testing.assert_array_equal(after["mlp"]["kernel"], before["mlp"]["kernel"])
  assert not np.allclose(after["mlp"]["bias"], before["mlp"]["bias"])


def test_adam_learning_rate_with_a_custom_adam_transform_is_an_error():
  with pytest.raises(ValueError, match="adam_learning_rate= applies to AuxAdam"):
    mo.muon(adam=optax.adam(1e-3), adam_learning_rate=1e-3)


def test_a_traced_learning_rate_cannot_be_checked_and_is_not():
  # Under inject_hyperparams (or jit) the rate is a tracer: built without a check.
  params, grads = _params(), _grads(_params())
  step = jax.jit(lambda lr: mo.muon(lr).update(grads, mo.muon(lr).init(params), params)[0])
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(step(jnp.asarray(-0.02))))


# --- inputs that do not fit -----------------------------------------------------------


def test_masks_that_do_not_fit_the_params_are_named_at_init():
  params = _params()
  short = {"embed": {"embedding": True}, "mlp": {"kernel": True}}  # no mlp/bias
  extra = {"embed": True, "mlp": True, "head": True}
  for make, name in ((lambda m: mo.muon(weight_decay=0.1, weight_decay_mask=m),
                      "weight_decay_mask"),
                     (lambda m: mo.muon(adam=mo.AuxAdam(weight_decay=0.1, mask=m)),
                      "the AuxAdam mask"),
                     (lambda m: mo.AuxAdam(weight_decay=0.1, mask=m).transform(),
                      "the AuxAdam mask")):
    with pytest.raises(ValueError, match=f"{name} does not match the params tree: the params "
                       "have 'mlp/bias', which it does not cover"):
      make(short).init(params)
    with pytest.raises(ValueError, match=f"{name} .*it has 'head', which is not in the params"):
      make(extra).init(params)
    with pytest.raises(ValueError, match=name):
      make(lambda p: short).init(params)
  # A prefix of the params, as optax takes, fits.
  mo.muon(weight_decay=0.1, weight_decay_mask={"embed": False, "mlp": True}).init(params)


def test_gradients_that_do_not_fit_the_params_are_named():
  params = _params()
  tx = mo.muon(0.02)
  state = tx.init(params)
  grads = _grads(params)
  transposed = {**grads, "mlp": {**grads["mlp"], "kernel": grads["mlp"]["kernel"].T}}
  with pytest.raises(ValueError, match=r"gradient of 'mlp/kernel' has shape \(8, 4\) but the "
                     r"parameter has shape \(4, 8\)"):
    tx.update(transposed, state, params)
  with pytest.raises(ValueError, match="gradients do not match the params tree .*list of 3 "
                     "leaves vs dict of 3"):
    tx.update(jax.tree.leaves(grads), state, params)
  missing = {"embed": grads["embed"], "mlp": {"kernel": grads["mlp"]["kernel"]}}
  with pytest.raises(ValueError, match="the params have 'mlp/bias', which the gradients lack"):
    tx.update(missing, state, params)
  # Without params, the momentum's tree is the reference.
  with pytest.raises(ValueError, match=r"gradient of 'mlp/kernel' has shape \(8, 4\)"):
    tx.update(transposed, state)
  with pytest.raises(ValueError, match="gradients do not match the params tree"):
    tx.update(jax.tree.leaves(grads), state)


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (3, 0, 4)])
@pytest.mark.parametrize("make", [mo.muon, mo.normuon, mo.adamuon,
                                  lambda: mo.muon(scale="adaptive")])
def test_empty_matrices_get_a_zero_update(shape, make):
  params = {"empty": {"kernel": jnp.zeros(shape)}, "mlp": {"kernel": jnp.ones((4, 8))}}
  tx = make()
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params),
                                      params)
  assert updates["empty"]["kernel"].shape == shape
  assert np.all(np.isfinite(updates["mlp"]["kernel"]))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))


@pytest.mark.parametrize("backend", mo.BACKENDS)
def test_float16_adamw_leaves_train_without_nan(backend):
  params = {"ln": {"scale": jnp.ones(8, jnp.float16)}, "b": jnp.zeros(8, jnp.float16)}
  tx = mo.AuxAdam(1e-2, backend=backend).transform()
  if backend == "offload":
    params = jax.device_put(params, jax.devices()[0])
  state = tx.init(params)
  assert state.nu["b"].dtype == jnp.float32  # squares of small gradients underflow float16
  step = jax.jit(tx.update)
  for g in (1e-4, 3e-3, 1e-5):
    grads = jax.tree.map(lambda p: jnp.full_like(p, g), params)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  for leaf in jax.tree.leaves(params):
    assert leaf.dtype == jnp.float16 and np.all(np.isfinite(leaf))
  # Same AdamW as in float32, to float16 rounding of the params.
  ref_params = {"ln": {"scale": jnp.ones(8)}, "b": jnp.zeros(8)}
  ref = optax.adamw(1e-2, weight_decay=0.0)
  ref_state = ref.init(ref_params)
  for g in (1e-4, 3e-3, 1e-5):
    grads = jax.tree.map(lambda p: jnp.full_like(p, g), ref_params)
    u, ref_state = ref.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, u)
  np.testing.assert_allclose(np.asarray(params["b"], np.float32), ref_params["b"],
                             atol=np.finfo(np.float16).eps * 0.03)
