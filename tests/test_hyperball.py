"""MuonH's hyperball step against a plain float64 implementation over several steps; the
norm it keeps; on 8 devices against 1; its errors; schedules, checkpoints, offload."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from family_case import (
  BETA,
  EXACT,
  STEPS,
  assert_checkpoint_restores,
  assert_close_per_leaf,
  flat,
  grads_at,
  make_params,
  matrices,
  plain_adamw_step,
  polar64,
  run_on_one_and_eight,
)
from jax.sharding import AxisType

import muon_optax as mo

LR = 0.05


def plain_muonh(params, steps):
  """MuonH leaf by leaf in float64: Muon's EMA momentum (no Nesterov) and polar factor O,
  then W ← r·(W − lr·r·O/‖O‖)/‖W − lr·r·O/‖O‖‖ per matrix, r its initial norm; plain
  AdamW for the rest."""
  p, state = flat(params), {}
  radius = {k: [np.linalg.norm(w) for w in matrices(x)] for k, x in p.items()}
  for t in range(1, steps + 1):
    grads = flat(grads_at(t - 1, params))
    for path, x in p.items():
      s = state.setdefault(path, {"m": np.zeros_like(x), "nu": np.zeros_like(x)})
      g = grads[path]
      if path.endswith("kernel"):
        s["m"] = BETA * s["m"] + (1 - BETA) * g
        new = []
        for w, m, r in zip(matrices(x), matrices(s["m"]), radius[path]):
          o = polar64(m)
          moved = w - LR * r * o / np.linalg.norm(o)
          new.append(r * moved / np.linalg.norm(moved))
        p[path] = np.stack(new).reshape(x.shape)
      else:
        p[path] = plain_adamw_step(s, g, x, t)
  return p


def test_matches_a_plain_implementation_over_several_steps():
  params = make_params()
  tx = mo.muonh(LR, beta=BETA, nesterov=False, ns=EXACT, adam=mo.AuxAdam(1e-2))
  state, update, p = tx.init(params), jax.jit(tx.update), params
  for step in range(STEPS):
    u, state = update(grads_at(step, p), state, p)
    p = optax.apply_updates(p, u)
  # grads_at depends only on the step and the shapes, so the reference sees the same ones.
  assert_close_per_leaf(flat(p), plain_muonh(params, STEPS), "muonh")


def test_every_matrix_keeps_its_initial_norm_and_moves_by_the_rate():
  params = make_params()
  tx = mo.muonh(LR)
  state, p = tx.init(params), params
  for step in range(STEPS):
    u, state = jax.jit(tx.update)(grads_at(step, p), state, p)
    moved = [np.linalg.norm(a) for a in matrices(np.asarray(u["fc"]["kernel"]))]
    p = optax.apply_updates(p, u)
  for path in ("fc", "proj", "stack"):
    before = np.linalg.norm(matrices(np.asarray(params[path]["kernel"])), axis=(1, 2))
    after = np.linalg.norm(matrices(np.asarray(p[path]["kernel"])), axis=(1, 2))
    np.testing.assert_allclose(after, before, rtol=16 * STEPS * np.finfo(np.float32).eps)
  # A step of lr·r along the sphere's tangent-ish direction, less what the projection takes.
  r = np.linalg.norm(np.asarray(params["fc"]["kernel"]))
  assert 0.5 * LR * r < moved[0] <= LR * r * (1 + 1e-5)


def test_eight_devices_equal_one():
  (want_p, want_s), (got_p, got_s) = run_on_one_and_eight(lambda **kw: mo.muonh(LR, **kw))
  assert_close_per_leaf(flat(got_p), flat(want_p), "muonh")
  assert_close_per_leaf(flat(got_s), flat(want_s), "muonh")


def test_a_zero_matrix_is_named_and_a_schedule_steps():
  params = {"fc": {"kernel": jnp.zeros((8, 16))}}
  with pytest.raises(ValueError, match="fc/kernel: a matrix of norm zero"):
    mo.muonh().init(params)
  params = {"fc": {"kernel": jax.random.normal(jax.random.key(0), (8, 16))}}
  tx = mo.hyperball(optax.linear_schedule(0.0, 0.1, 10))
  u, state = tx.update(params, tx.init(params), params)
  assert not np.any(np.asarray(u["fc"]["kernel"]))  # the schedule's first rate is 0
  assert int(state.count) == 1
  with pytest.raises(ValueError, match="needs the params"):
    tx.update(params, state)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_a_zero_matrix_is_named_under_jit_too(on_mesh):
  # How the docs initialize state on a mesh: the params are traced, so the norm is known
  # only when the init runs; it must not pass silently (the matrix would stay 0).
  params = {"fc": {"kernel": jnp.zeros((8, 16))}, "b": jnp.zeros(16)}
  tx, out = mo.muonh(), None
  if on_mesh:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tx = mo.muonh(mesh=mesh)
    out = mo.state_shardings(tx, params, mesh)
  with pytest.raises(Exception, match="fc/kernel: a matrix of norm zero"):
    jax.block_until_ready(jax.jit(tx.init, out_shardings=out)(params))
  params["fc"]["kernel"] = jnp.ones((8, 16))
  jax.block_until_ready(jax.jit(tx.init, out_shardings=out)(params))  # nonzero: no error


def test_checkpoint_and_offload(tmp_path):
  params = jax.device_put(make_params(), jax.devices()[0])
  tx = mo.muonh(LR, offload_momentum=True)
  state, step = tx.init(params), jax.jit(tx.update)
  for i in range(2):
    u, state = step(grads_at(i, params), state, params)
  assert step._cache_size() == 1
  assert_checkpoint_restores(tx, params, state, tmp_path)
