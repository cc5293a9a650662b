"""Dion2's row selection and NorDion2 against plain float64 implementations of the
paper's equations, over several steps; on 8 devices against 1; its cost; its state
through state_shardings, checkpoints, offload and inject_hyperparams."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from family_case import (
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
  plain_adamw_step,
  polar64,
  run_on_one_and_eight,
  train_beside,
)
from jax.sharding import AxisType

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path

MU, FRACTION, B2 = 0.9, 0.25, 0.95


class PlainDion2:
  """Dion2 (Ahn, Amsel, Langford 2025, Algorithm 1) leaf by leaf in float64, on each
  (fan_in, fan_out) matrix: B ← B + G; S the ⌈α·fan_out⌉ columns of largest L1 norm;
  O[:, S] = polar(B[:, S]); B[:, S] ← μ·B[:, S]; NorDion2 normalizes O[:, S] per
  neuron with an EMA kept for S only, keeping its norm; then Jordan's shape factor and
  decoupled weight decay. Plain AdamW for the rest."""

  def __init__(self, normalized, groups=1):
    self.normalized, self.groups, self.t, self.state = normalized, groups, 0, {}

  def chosen(self, b, leaf_shape):
    """The top ⌈α·size⌉ columns by L1 norm of each of `groups` contiguous groups where
    the devices split the leaf's fan-out axis (its largest they divide), else of one."""
    fan_out = b.shape[1]
    split = max((d for d in range(len(leaf_shape)) if leaf_shape[d] % self.groups == 0),
                key=lambda d: (leaf_shape[d], d), default=None)
    groups = self.groups if split == len(leaf_shape) - 1 else 1
    size, norms = fan_out // groups, np.abs(b).sum(axis=0)
    return np.concatenate([g * size + np.argsort(-norms[g * size:(g + 1) * size], kind="stable")[
        :math.ceil(FRACTION * size)] for g in range(groups)])

  def direction(self, b, v, leaf_shape):
    fan_in, fan_out = b.shape
    chosen = self.chosen(b, leaf_shape)
    o = np.zeros_like(b)
    o[:, chosen] = polar64(b[:, chosen])
    b[:, chosen] *= MU
    if self.normalized:
      v[chosen] = B2 * v[chosen] + (1 - B2) * np.mean(o[:, chosen] ** 2, axis=0)
      normalized = np.zeros_like(o)
      normalized[:, chosen] = o[:, chosen] / (np.sqrt(v[chosen]) + 1e-10)
      o = normalized * np.linalg.norm(o) / np.linalg.norm(normalized)
    return o * np.sqrt(max(1, fan_out / fan_in))

  def step(self, params, grads):
    self.t += 1
    out = {}
    for path, p in params.items():
      g = grads[path]
      s = self.state.setdefault(path, {"b": np.zeros_like(p), "nu": np.zeros_like(p)})
      if path.endswith("kernel"):
        s["b"] = s["b"] + g
        buffers = matrices(s["b"]).copy()
        s.setdefault("v", np.zeros((len(buffers), p.shape[-1])))
        d = np.stack([self.direction(b, v, p.shape) for b, v in zip(buffers, s["v"])])
        s["b"] = buffers.reshape(p.shape)
        out[path] = p - LR * (d.reshape(p.shape) + WD * p)
      else:
        out[path] = plain_adamw_step(s, g, p, self.t)
    return out


ALIASES = {"dion2": mo.dion2, "nordion2": mo.nordion2}
SCOPES = {"matrix": (mo.RowSelection(FRACTION), 1),
          "shard": (mo.RowSelection(FRACTION, scope="shard", devices=4), 4)}


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", ALIASES)
def test_matches_a_plain_implementation_of_the_paper_over_several_steps(name, scope):
  params = make_params()
  select, groups = SCOPES[scope]
  tx = ALIASES[name](LR, fraction=select, beta=MU, ns=EXACT, weight_decay=WD,
                     adam=mo.AuxAdam(1e-2))
  reference = PlainDion2(normalized=name == "nordion2", groups=groups)
  assert_close_per_leaf(*train_beside(tx, reference, params), name)


def test_only_the_selected_neurons_move_and_the_others_keep_accumulating():
  g = {"w": jax.random.normal(jax.random.key(0), (16, 40))}
  tx = mo.select_rows(mo.RowSelection(0.25), ef_decay=0.5)
  u, state = tx.update(g, tx.init(g))
  moved = np.flatnonzero(np.any(np.asarray(u["w"]) != 0, axis=0))
  assert len(moved) == 10  # ⌈0.25·40⌉ output neurons (columns of the (in, out) kernel)
  l1 = np.abs(np.asarray(g["w"])).sum(axis=0)
  assert set(moved) == set(np.argsort(-l1)[:10])
  buffer = np.asarray(state.buffer["w"])
  np.testing.assert_array_equal(buffer[:, moved], 0.5 * np.asarray(g["w"])[:, moved])
  rest = np.setdiff1d(np.arange(40), moved)
  np.testing.assert_array_equal(buffer[:, rest], np.asarray(g["w"])[:, rest])


def test_the_whole_selection_is_muon_with_heavy_ball_momentum():
  params = make_params()
  ours = mo.dion2(LR, fraction=1.0, beta=MU, ns=EXACT, adam=mo.AuxAdam(1e-2))
  muon = mo.muon(LR, beta=MU, nesterov=False, ns=EXACT, adam=mo.AuxAdam(1e-2))
  results = []
  for tx in (ours, muon):
    p, state = params, tx.init(params)
    for step in range(STEPS):
      u, state = jax.jit(tx.update)(grads_at(step, p), state, p)
      p = optax.apply_updates(p, u)
    results.append(flat(p))
  # B = Σ μ^(t−s) G_s is Muon's EMA momentum over (1 − μ): the polar factor is the same.
  assert_close_per_leaf(results[0], results[1], "dion2(fraction=1) vs muon")


def test_newton_schulz_flops_shrink_with_the_fraction():
  params = {"fc": {"kernel": jnp.ones((256, 1024))}}

  def flops(tx):
    compiled = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
    return compiled.cost_analysis()["flops"]

  # Newton–Schulz runs on the 256×256 submatrix of the selected quarter of the neurons;
  # the selection, the scatter and the rest of the step add a few elementwise flops.
  selected = {"fc": {"kernel": jnp.ones((256, 256))}}
  for tx, ns_flops in ((mo.muon(), mo.newton_schulz_cost(params)),
                       (mo.dion2(fraction=0.25), mo.newton_schulz_cost(selected))):
    assert ns_flops <= flops(tx) < 1.03 * ns_flops
  # The whole 256×1024 runs in Gram space, which pays less per column than the square
  # quarter's standard iteration: a quarter of the neurons costs 0.57× the flops.
  assert mo.newton_schulz_cost(selected) < 0.6 * mo.newton_schulz_cost(params)


MESHES = [("matrix", "fsdp", AxisType.Auto), ("shard", "fsdp", AxisType.Auto),
          ("shard", "fsdp", AxisType.Explicit), ("shard", "zero1", AxisType.Auto)]


@pytest.mark.parametrize("scope, layout, types", MESHES)
@pytest.mark.parametrize("name", ALIASES)
def test_eight_devices_equal_one(name, scope, layout, types):
  def make(mesh=None):
    select = mo.RowSelection(FRACTION, scope=scope, devices=None if mesh or scope == "matrix"
                             else 8)
    if mesh is not None and layout == "zero1" and types == AxisType.Auto:
      mesh = mo.MeshLayout(mesh, params="replicated")
    return ALIASES[name](LR, fraction=select, weight_decay=WD, mesh=mesh)

  (want_p, want_s), (got_p, got_s) = run_on_one_and_eight(make, layout, types)
  buffers = [x for path, x in leaves_with_path(got_s) if "/buffer/" in f"/{path}/"]
  assert buffers and all(not x.sharding.is_fully_replicated for x in buffers), buffers
  assert_close_per_leaf(flat(got_p), flat(want_p), name)
  assert_close_per_leaf(flat(got_s), flat(want_s), name)


def test_checkpoint_offload_and_injected_rates(tmp_path):
  params = jax.device_put(make_params(), jax.devices()[0])
  with pytest.raises(ValueError, match="static_args"):  # a shape cannot be injected
    optax.inject_hyperparams(mo.nordion2)(learning_rate=LR).init(params)
  tx = optax.inject_hyperparams(mo.nordion2, static_args=("fraction",))(
      learning_rate=LR, fraction=0.5, offload_momentum=True)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for i in range(2):
    u, state = step(grads_at(i, params), state, params)
  assert_checkpoint_restores(tx, params, state, tmp_path)


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="fraction must be a number in"):
    mo.RowSelection(0)
  with pytest.raises(ValueError, match="fraction must be a number in"):
    mo.dion2(fraction=1.5)
  with pytest.raises(ValueError, match="nesterov=False"):
    mo.scale_by_muon(nesterov=True, select=mo.RowSelection())
  with pytest.raises(ValueError, match="ef_decay"):
    mo.select_rows(ef_decay=1.0)
  with pytest.raises(ValueError, match=r"scope='shards'\): choose one of"):
    mo.RowSelection(scope="shards")
  with pytest.raises(ValueError, match="takes its groups from a mesh"):
    mo.nordion2(fraction=mo.RowSelection(scope="shard"))
