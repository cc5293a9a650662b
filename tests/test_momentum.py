"""Muon's momentum step against its equation: the EMA, its Nesterov look-ahead, dtypes."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_ema_and_its_look_ahead_over_several_steps(nesterov):
  beta, grads = 0.9, [np.array([1.0, -2.0]), np.array([0.5, 4.0]), np.array([-3.0, 1.0])]
  tx = mo.scale_by_muon_momentum(beta, nesterov=nesterov)
  state, m = tx.init({"w": jnp.zeros(2)}), np.zeros(2)
  for g in grads:
    u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state)
    m = beta * m + (1 - beta) * g
    want = (1 - beta) * g + beta * m if nesterov else m
    np.testing.assert_allclose(u["w"], want, rtol=4 * np.finfo(np.float32).eps)
    np.testing.assert_allclose(state.mu["w"], m, rtol=4 * np.finfo(np.float32).eps)


def test_the_buffer_keeps_its_dtype_and_updates_keep_the_gradients():
  tx = mo.scale_by_muon_momentum(0.95, mu_dtype=jnp.bfloat16)
  state = tx.init({"w": jnp.zeros(3, jnp.float32)})
  assert state.mu["w"].dtype == jnp.bfloat16
  u, state = tx.update({"w": jnp.ones(3, jnp.float32)}, state)
  assert u["w"].dtype == jnp.float32 and state.mu["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="static_args=\\('mu_dtype',\\)"):
    optax.inject_hyperparams(mo.scale_by_muon_momentum)(beta=0.9, mu_dtype=jnp.bfloat16).init(
        {"w": jnp.zeros(3)})
  injected = optax.inject_hyperparams(mo.scale_by_muon_momentum, static_args=("mu_dtype",))(
      beta=0.9, mu_dtype=jnp.bfloat16)
  s = injected.init({"w": jnp.zeros(3)})
  _, s = injected.update({"w": jnp.ones(3)}, s)
  assert s.inner_state.mu["w"].dtype == jnp.bfloat16  # an injected float32 beta does not promote


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="beta must be in"):
    mo.scale_by_muon_momentum(1.0)
  with pytest.raises(ValueError, match="mu_dtype"):
    mo.scale_by_muon_momentum(mu_dtype=jnp.int32)
