"""Cautious weight decay against its equation, as a part and inside the family; plain
decay equal to optax's; settings checked where they are passed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from family_case import EXACT, LR, WD, flat, grads_at, make_params

import muon_optax as mo


def test_decays_only_where_update_and_parameter_agree():
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {"w": jax.random.normal(k1, (6, 7)), "b": jnp.zeros(7)}
  u = {"w": jax.random.normal(k2, (6, 7)), "b": jnp.ones(7)}
  mask = {"w": True, "b": False}
  tx = mo.add_decayed_weights(0.3, mask, cautious=True)
  got, _ = tx.update(u, tx.init(p), p)
  w, uw = np.asarray(p["w"], np.float64), np.asarray(u["w"], np.float64)
  want = uw + 0.3 * (uw * w >= 0) * w  # Chen et al. 2025: u + λ·𝕀(u ⊙ p ≥ 0) ⊙ p
  np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=4 * np.finfo(np.float32).eps)
  np.testing.assert_array_equal(np.asarray(got["b"]), np.asarray(u["b"]))  # masked off
  plain = mo.add_decayed_weights(0.3, mask)
  theirs = optax.add_decayed_weights(0.3, mask)
  np.testing.assert_array_equal(np.asarray(plain.update(u, plain.init(p), p)[0]["w"]),
                                np.asarray(theirs.update(u, theirs.init(p), p)[0]["w"]))


def test_the_family_takes_it_as_its_weight_decay():
  params = make_params()
  cautious = mo.muon(LR, ns=EXACT, weight_decay=mo.WeightDecay(WD, cautious=True))
  direction = mo.muon(LR, ns=EXACT)  # the step without decay gives the update u
  g = grads_at(0, params)
  got, _ = cautious.update(g, cautious.init(params), params)
  step, _ = direction.update(g, direction.init(params), params)
  w, u = flat(params)["fc/kernel"], -flat(step)["fc/kernel"] / LR
  want = -LR * (u + WD * (u * w >= 0) * w)
  np.testing.assert_allclose(flat(got)["fc/kernel"], want, rtol=0,
                             atol=64 * np.finfo(np.float32).eps * np.abs(want).max())
  # A schedule works as the rate, and the state survives jit.
  tx = mo.normuon(LR, weight_decay=mo.WeightDecay(optax.constant_schedule(WD), cautious=True))
  u, state = jax.jit(tx.update)(g, tx.init(params), params)


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="weight_decay must be a finite number"):
    mo.WeightDecay(-1.0)
  with pytest.raises(ValueError, match="cautious must be True or False"):
    mo.WeightDecay(0.1, cautious="yes")
  with pytest.raises(ValueError, match="weight_decay must be a finite number"):
    mo.muon(weight_decay=-0.1)
