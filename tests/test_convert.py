"""Conversion of AdamW state between backends: the next steps are the same."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close
from adamw_case import (
  HIDDEN,
  D,
  adam_state,
  arm,
  arms_step,
  make_params,
  make_tx,
  run_arms,
  three_steps,
)

import muon_optax as mo
from muon_optax._adamw.backends import ReferenceAdamState


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
    # optax's own scale_by_adam rounds a little differently from the written-out AdamW.
    tol = 1e-6 if "optax" in (source, target) and source != target else 0
    np.testing.assert_allclose(losses[:, arm(target)], losses[:, src], rtol=0, atol=tol,
                               err_msg=f"{source} -> {target}")
    assert_trees_close(p5[arm(target)], p5[src], rtol=0, atol=tol)
    assert_trees_close(mo.convert_adam_state(s5[arm(target)], p5[arm(target)], "reference"),
                       mo.convert_adam_state(s5[src], p5[src], "reference"), rtol=0, atol=tol)
  assert arms_step()[1]._cache_size() == 1  # converted states fit the compiled step


def test_conversion_inside_a_chain_standalone_and_any_partition():
  params = make_params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), make_tx("offload"))
  state = mo.convert_adam_state(tx.init(params), params, "optax")
  assert isinstance(state[1].inner_states["adam"].inner_state, optax.ScaleByAdamState)
  moments = state[1].inner_states["adam"].inner_state.mu
  assert moments["norm"]["scale"].sharding.memory_kind == "device"
  converted = mo.convert_adam_state(mo.AuxAdam(1e-3).transform().init(params), params, "reference")
  assert isinstance(converted, ReferenceAdamState)
  assert converted.mu["mlp_in"]["kernel"].shape == (D, HIDDEN)
  labels = jax.tree.map(lambda p: "vec" if p.ndim == 1 else "mat", params)
  part = optax.partition(
      {"vec": mo.AuxAdam(1e-3, backend="reference").transform(), "mat": optax.sgd(0.1)}, labels)
  converted = mo.convert_adam_state(part.init(params), params, "offload", branch="vec")
  moments = converted.inner_states["vec"].inner_state.mu
  assert moments["mlp_in"]["bias"].sharding.memory_kind == "pinned_host"
  assert isinstance(moments["mlp_in"]["kernel"], optax.MaskedNode)


def test_optax_adamw_chain_state_is_migrated():
  """A state written by muon(adam=optax.adamw(...)) continues under any backend."""
  params = make_params()
  legacy = mo.muon(0.02, adam=optax.adamw(1e-3, weight_decay=0.1))
  new = mo.muon(0.02, adam=mo.AuxAdam(1e-3, weight_decay=0.1, backend="reference"))
  grads = jax.tree.map(jnp.sin, params)

  @jax.jit
  def second_step(params):
    u, state = legacy.update(grads, legacy.init(params), params)
    p = optax.apply_updates(params, u)
    converted = mo.convert_adam_state(state, p, "reference")
    return legacy.update(grads, state, p)[0], new.update(grads, converted, p)[0]

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


def test_unknown_and_misfit_layouts_are_clear_errors():
  params = make_params()
  state = make_tx("reference").init(params)
  ref = adam_state(state)

  def with_adam(inner):
    return state._replace(inner_states={**state.inner_states, "adam": optax.MaskedState(inner)})

  with pytest.raises(ValueError, match=r"missing field\(s\) \['nu'\]"):
    mo.convert_adam_state(with_adam(OldAdamState(ref.count, ref.mu)), params, "optax")
  with pytest.raises(ValueError, match=r"unexpected field\(s\) \['bias_correction'\]"):
    mo.convert_adam_state(
        with_adam(BiasCorrectedAdamState(ref.count, ref.mu, ref.nu, ref.count)), params, "optax")
  with pytest.raises(ValueError, match=r"mu does not fit these params"):
    mo.convert_adam_state(state, {**params, "extra_bias": jnp.zeros(3)}, "optax")
  with pytest.raises(ValueError, match=r"mu does not fit these params"):
    mo.convert_adam_state(state, {**params, "norm": {"scale": jnp.ones(D + 1)}}, "optax")
  with pytest.raises(ValueError, match="found no AdamW state"):
    mo.convert_adam_state({"count": jnp.zeros([])}, params, "optax")
  with pytest.raises(ValueError, match="unknown AdamW backend 'auto'"):
    mo.convert_adam_state(state, params, "auto")


def test_orbax_checkpoint_converts_on_restore(tmp_path):
  """A plain Orbax checkpoint restored into the state type that wrote it, then converted."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params3, states3, _ = three_steps()
  ref, optax_arm = arm("reference"), arm("optax")
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": params3[ref], "opt": states3[ref]})
  abstract = jax.eval_shape(lambda: {"params": params3[ref], "opt": states3[ref]})
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
  params, states = list(params3), list(states3)
  params[optax_arm] = restored["params"]
  states[optax_arm] = mo.convert_adam_state(restored["opt"], restored["params"], "optax")
  _, _, losses = run_arms(2, params, states, start=3)
  np.testing.assert_allclose(losses[:, optax_arm], losses[:, ref], rtol=0, atol=1e-6)
