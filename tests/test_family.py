"""The Muon family (NorMuon, AdaMuon, adaptive scaling) against plain float64
implementations written here from the papers' equations, over several steps; on 8
devices against 1; through state_shardings, checkpoints, offload and qk_clip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from family_case import (
  BETA,
  EXACT,
  LR,
  STEPS,
  WD,
  assert_checkpoint_restores,
  assert_close_per_leaf,
  flat,
  grads_at,
  make_params,
  matrices,
  mesh_of,
  plain_adamw_step,
  polar64,
  run_on_one_and_eight,
  train_beside,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path


def normuon_direction(o, v, t, b2=0.95, eps=1e-10):
  """NorMuon (Li et al. 2025, Algorithm 1 and its reference code) on one (in, out) matrix:
  a second moment per output neuron, normalization, the pre-normalization norm kept."""
  v = b2 * v + (1 - b2) * np.mean(o * o, axis=0, keepdims=True)  # mean over fan-in
  normalized = o / (np.sqrt(v) + eps)
  normalized *= np.linalg.norm(o) / (np.linalg.norm(normalized) + eps)
  fan_in, fan_out = o.shape
  return normalized * np.sqrt(max(1, fan_out / fan_in)), v


def adamuon_direction(o, v, t, b2=0.999, eps=1e-8):
  """AdaMuon (Si et al. 2025, Algorithm 1 and its reference code): an element-wise second
  moment, debiased, normalization, then RMS alignment to 0.2."""
  v = b2 * v + (1 - b2) * o * o
  normalized = o / (np.sqrt(v / (1 - b2**t)) + eps)
  m, n = o.shape
  normalized *= np.sqrt(min(m, n)) / (np.linalg.norm(normalized) + eps)
  return 0.2 * np.sqrt(max(m, n)) * normalized, v


class PlainFamily:
  """The optimizer, leaf by leaf in float64: momentum (no Nesterov), polar factor, the
  variant's step, decoupled weight decay; plain AdamW (b2 0.999) for the rest."""

  def __init__(self, direction, adam_lr=1e-2):
    self.direction, self.adam_lr, self.t, self.state = direction, adam_lr, 0, {}

  def step(self, params, grads):
    self.t += 1
    out = {}
    for path, p in params.items():
      g = grads[path]
      s = self.state.setdefault(path, {"m": np.zeros_like(p), "v": None, "nu": np.zeros_like(p)})
      if path.endswith("kernel"):
        s["m"] = BETA * s["m"] + (1 - BETA) * g
        update = []
        v = s["v"] if s["v"] is not None else [None] * len(matrices(p))
        for k, m in enumerate(matrices(s["m"])):
          d, v[k] = self.direction(polar64(m), m, v[k], self.t)
          update.append(d)
        s["v"] = v
        out[path] = p - LR * (np.stack(update).reshape(p.shape) + WD * p)
      else:
        out[path] = plain_adamw_step(s, g, p, self.t, self.adam_lr)
    return out


def normuon_ref(o, m, v, t):
  return normuon_direction(o, 0 if v is None else v, t)


def adamuon_ref(o, m, v, t):
  return adamuon_direction(o, 0 if v is None else v, t)


def adaptive_ref(o, m, v, t):
  """PolarGrad / optax's adaptive Muon: ⟨M̂, O⟩·O with M̂ = M / (1 − βᵗ), Jordan's factor."""
  fan_in, fan_out = o.shape
  dual = np.sum(m / (1 - BETA**t) * o)
  return dual * o * np.sqrt(max(1, fan_out / fan_in)), None


FAMILY = {
    "normuon": (lambda **kw: mo.normuon(LR, **kw), normuon_ref),
    "adamuon": (lambda **kw: mo.adamuon(LR, **kw), adamuon_ref),
    "adaptive": (lambda **kw: mo.muon(LR, scale="adaptive", **kw), adaptive_ref),
}


@pytest.mark.parametrize("name", FAMILY)
def test_matches_a_plain_implementation_of_the_paper_over_several_steps(name):
  make, direction = FAMILY[name]
  params = make_params()
  tx = make(beta=BETA, nesterov=False, ns=EXACT, weight_decay=WD, adam=mo.AuxAdam(1e-2))
  assert_close_per_leaf(*train_beside(tx, PlainFamily(direction), params), name)


def test_adaptive_matches_optax_contrib_muon_running_the_same_iteration():
  params = {"w": 0.1 * jax.random.normal(jax.random.key(1), (16, 48)),
            "v": 0.1 * jax.random.normal(jax.random.key(2), (48, 16)), "b": jnp.zeros(16)}
  every_matrix = lambda p: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", p)
  theirs = optax.contrib.muon(LR, nesterov=False, adaptive=True, adam_learning_rate=1e-2)
  ours = mo.muon(LR, nesterov=False, scale="adaptive", routing=every_matrix,
                 ns=mo.NewtonSchulz("jordan", steps=5, gram=False),
                 adam=mo.AuxAdam(1e-2, b1=0.9, b2=0.999, eps=1e-8))
  results = []
  for tx in (ours, theirs):
    p, state = params, tx.init(params)
    for step in range(STEPS):
      u, state = jax.jit(tx.update)(grads_at(step, p), state, p)
      p = optax.apply_updates(p, u)
    results.append(p)
  # The same float32 operations but for optax's eps in the normalization (1e-8 next to
  # ‖M‖_F ~ 1) and the order of the sums.
  assert_close_per_leaf(flat(results[0]), flat(results[1]), "adaptive vs optax")


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("layout, types", [("zero1", AxisType.Auto), ("fsdp", AxisType.Explicit)])
def test_eight_devices_equal_one(name, layout, types):
  make, _ = FAMILY[name]
  (want_p, want_s), (got_p, got_s) = run_on_one_and_eight(make, layout, types)
  if name != "adaptive":
    # The new statistics are partitioned like the rest of the state.
    second = [x for path, x in leaves_with_path(got_s) if "/nu/" in f"/{path}/"
              and path.startswith("inner_states/muon")]
    assert second and all(not x.sharding.is_fully_replicated for x in second), second
  # The same float32 iteration on whole matrices; only the order of sums differs.
  assert_close_per_leaf(flat(got_p), flat(want_p), name)
  assert_close_per_leaf(flat(got_s), flat(want_s), name)


def test_per_neuron_statistic_follows_its_parameter_under_fsdp():
  mesh = mesh_of(AxisType.Auto)
  params = {"fc": {"kernel": jnp.zeros((16, 64))}}
  pshard = {"fc": {"kernel": NamedSharding(mesh, P(None, "data"))}}
  placed = jax.device_put(params, pshard)
  shardings = mo.state_shardings(mo.normuon(mesh=mesh), placed, mesh)
  nu = shardings.inner_states["muon"].inner_state[0][2].nu["fc"]["kernel"]
  assert jax.eval_shape(mo.normuon().init, params).inner_states["muon"].inner_state[0][2].nu[
      "fc"]["kernel"].shape == (1, 64)
  assert nu.spec == P(None, "data")  # its neurons live where the kernel's columns do


@pytest.mark.parametrize("name", FAMILY)
def test_checkpoint_describe_offload_and_qk_clip(name, tmp_path):
  make, _ = FAMILY[name]
  params = {"attn": {"query": {"kernel": jnp.ones((8, 2, 4))}, "key": {"kernel": jnp.ones((8, 2, 4))}},
            **make_params()}
  params = jax.device_put(params, jax.devices()[0])
  tx = optax.chain(make(offload_momentum=True), mo.qk_clip(tau=10.0))
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p, max_logits={"attn": jnp.array([5.0, 40.0])}))
  u, state = step(params, state, params)
  u, state = step(params, state, params)
  assert step._cache_size() == 1
  assert "attn/query/kernel" in mo.describe(params)
  assert_checkpoint_restores(tx, params, state, tmp_path)
