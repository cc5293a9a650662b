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
    ({"ns_steps": 0}, "ns_steps", "0"),
    ({"ns_steps": 2.5}, "ns_steps", "2.5"),
    ({"ns_steps": True}, "ns_steps", "True"),
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
])
def test_aux_adam_rejects_bad_hyperparameters_when_built(kwargs, name, value):
  with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(value)):
    mo.AuxAdam(**kwargs)


def test_momentum_and_scale_by_muon_reject_bad_beta():
  for make in (mo.scale_by_muon_momentum, mo.scale_by_muon):
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\), got 1\.5"):
      make(1.5)


def test_ns_steps_as_an_array_says_to_make_it_static():
  with pytest.raises(ValueError, match="static_args"):
    mo.muon(ns_steps=jnp.asarray(5))


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
  tx = optax.inject_hyperparams(mo.muon, static_args=("ns_steps",))(
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
  tx = optax.inject_hyperparams(mo.muon, static_args=("ns_steps",))(
      0.02, adam_learning_rate=1e-3)
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
