"""MuonBP's block-periodic steps against a plain float64 implementation over several
steps; on 8 devices against 1; no collective in block steps; one executable."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from family_case import (
  BETA,
  EXACT,
  LR,
  WD,
  assert_close_per_leaf,
  flat,
  grads_at,
  make_params,
  mesh_of,
  plain_adamw_step,
  polar64,
  run_on_one_and_eight,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from benchmarks.common import at_step
from benchmarks.hlo import collective_stats

PERIOD, BLOCKS, BLOCK_SCALE = 3, 4, 0.5


def jordan(fan_in, fan_out):
  return np.sqrt(max(1, fan_out / fan_in))


def blockwise(m, blocks):
  """Each contiguous block of the (…, fan_in, fan_out) leaf `m` along its largest axis
  that `blocks` divides (the last of equals), orthogonalized alone: the blocks `blocks`
  devices hold under FSDP. Each is brought to the update RMS of the whole matrix's
  polar factor (a semi-orthogonal a×b matrix has RMS 1/√max(a, b)), then given the
  whole matrix's Jordan factor, as every step."""
  axis = max((d for d in range(m.ndim) if m.shape[d] % blocks == 0),
             key=lambda d: (m.shape[d], d))
  out = []
  for block in np.split(m, blocks, axis=axis):
    mats = block.reshape(-1, *block.shape[-2:])
    rms = np.sqrt(max(block.shape[-2:]) / max(m.shape[-2:]))
    out.append((rms * jordan(*m.shape[-2:]) * np.stack([polar64(x) for x in mats])
                ).reshape(block.shape))
  return np.concatenate(out, axis=axis)


def plain_muonbp(params, steps):
  """MuonBP (Khaled et al. 2025, Algorithm 1) leaf by leaf in float64: Muon's EMA
  momentum (no Nesterov); on steps 0, P, 2P… polar(M) with Jordan's factor of the
  matrix, else `blockwise` times the block rate; decoupled weight decay; AdamW for the
  rest."""
  p, state = flat(params), {}
  for t in range(steps):
    grads = flat(grads_at(t, params))
    for path, x in p.items():
      s = state.setdefault(path, {"m": np.zeros_like(x), "nu": np.zeros_like(x)})
      g = grads[path]
      if path.endswith("kernel"):
        s["m"] = BETA * s["m"] + (1 - BETA) * g
        if t % PERIOD == 0:
          mats = s["m"].reshape(-1, *x.shape[-2:])
          d = np.stack([polar64(m) * jordan(*m.shape) for m in mats]).reshape(x.shape)
        else:
          d = BLOCK_SCALE * blockwise(s["m"], BLOCKS)
        p[path] = x - LR * (d + WD * x)
      else:
        p[path] = plain_adamw_step(s, g, x, t + 1)
  return p


def test_matches_a_plain_implementation_over_several_steps():
  params, steps = make_params(), 2 * PERIOD
  tx = mo.muonbp(LR, blocks=mo.BlockPeriodic(PERIOD, devices=BLOCKS, block_scale=BLOCK_SCALE),
                 beta=BETA, nesterov=False, ns=EXACT, weight_decay=WD, adam=mo.AuxAdam(1e-2))
  state, update, p = tx.init(params), jax.jit(tx.update), params
  for step in range(steps):
    u, state = update(grads_at(step, p), state, p)
    p = optax.apply_updates(p, u)
  assert update._cache_size() == 1  # both kinds of step in one executable
  assert_close_per_leaf(flat(p), plain_muonbp(params, steps), "muonbp")


@pytest.mark.parametrize("layout, types", [("zero1", AxisType.Auto), ("fsdp", AxisType.Explicit)])
def test_eight_devices_equal_one(layout, types):
  make = lambda mesh=None: mo.muonbp(
      LR, blocks=mo.BlockPeriodic(PERIOD, devices=None if mesh else 8), mesh=mesh)
  (want_p, want_s), (got_p, got_s) = run_on_one_and_eight(make, layout, types, steps=2 * PERIOD)
  assert_close_per_leaf(flat(got_p), flat(want_p), "muonbp")
  assert_close_per_leaf(flat(got_s), flat(want_s), "muonbp")


def collectives_at(step: int, layout: str) -> dict:
  """The collectives of the update at a known step (its kind alone is compiled)."""
  mesh, params = mesh_of(), make_params()
  shard = mo.fsdp_shardings(params, mesh) if layout == "fsdp" else jax.tree.map(
      lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params)
  p = jax.device_put(params, shard)
  tx = mo.muonbp(LR, blocks=mo.BlockPeriodic(PERIOD), mesh=mesh)
  state = jax.jit(tx.init, out_shardings=mo.state_shardings(tx, p, mesh))(p)
  state = jax.tree.map(lambda x: jnp.asarray(step, x.dtype) if x.dtype == jnp.int32 else x, state)
  text = jax.jit(lambda g, p: tx.update(g, state, p)).lower(p, p).compile().as_text()
  return {op: n for op, (n, _) in collective_stats(text).items() if n}


@pytest.mark.parametrize("layout", ["fsdp", "zero1"])
def test_block_steps_need_no_collective(layout):
  assert collectives_at(1, layout) == {}
  assert collectives_at(PERIOD, layout).get("all-to-all", 0) > 0  # the full step's exchange


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="takes its blocks from a mesh"):
    mo.muonbp()
  with pytest.raises(ValueError, match=r"BlockPeriodic\(period=0\) must be a positive integer"):
    mo.BlockPeriodic(period=0)
  with pytest.raises(ValueError, match="block_scale"):
    mo.BlockPeriodic(block_scale=0)
  with pytest.raises(ValueError, match="does not combine"):
    mo.scale_by_muon(blocks=mo.BlockPeriodic(devices=2), scale="adaptive")


def test_a_device_count_other_than_the_meshs_is_refused():
  # On a mesh the blocks are its devices' shards: 8 blocks on 4 devices would silently
  # be 4. The same count, or None, is the mesh's.
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=r"BlockPeriodic\(devices=8\) on a mesh whose data "
                     r"axes hold 4 devices.*devices=None.*mesh=None"):
    mo.muonbp(blocks=mo.BlockPeriodic(devices=8), mesh=mesh)
  for devices in (4, None):
    mo.muonbp(blocks=mo.BlockPeriodic(devices=devices), mesh=mesh)


def test_block_steps_on_a_mesh_run_in_parts_in_bounded_memory():
  # 16 layers of 4 kernels at width 256 on 8 devices: each device's blocks of all 64
  # leaves. Run in MeshLayout.exchanges parts one after another, one part's Newton–Schulz
  # temporaries are live at a time; in one batch per shape, all of them at once.
  from benchmarks.common import at_step
  mesh = mesh_of()
  d, s = 256, lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {str(i): {"qkv": s(d, 3 * d), "proj": s(d, d), "fc": s(d, 4 * d), "out": s(4 * d, d)}
            for i in range(16)}
  shard = mo.fsdp_shardings(params, mesh)
  params = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h), params,
                        shard)

  def temp(exchanges):
    layout = mo.MeshLayout(mesh, params="sharded", exchanges=exchanges)
    tx = at_step(mo.orthogonalize_blocks(mo.BlockPeriodic(PERIOD), mesh=layout), 1)
    shardings = mo.state_shardings(tx, params, mesh)
    state = jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                         jax.eval_shape(tx.init, params), shardings)
    compiled = jax.jit(tx.update, out_shardings=(shard, shardings)).lower(params, state,
                                                                          params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp(4) <= 0.6 * temp(1), (temp(4), temp(1))


# Megatron-style tensor parallelism over "model", data-parallel state over "data".
TP = {"embed": {"embedding": P()}, "fc": {"kernel": P(None, "model"), "bias": P("model")},
      "proj": {"kernel": P("model", None)}, "stack": {"kernel": P(None, None, "model")}}


def tp_run(types, steps=PERIOD + 1):
  """(collectives of a block step, params and state after `steps` steps) of MuonBP with
  tensor-parallel params on a (data 4, model 2) mesh of `types` axes, the layout stated."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(types,) * 2)
  layout = mo.MeshLayout(mesh, params=TP)
  tx = mo.muonbp(LR, blocks=mo.BlockPeriodic(PERIOD), mesh=layout)
  params = make_params()
  pshard = jax.tree.map(lambda s: NamedSharding(mesh, s), TP)
  p = jax.device_put(params, pshard)
  sshard = mo.state_shardings(tx, p, layout)
  state = jax.jit(tx.init, out_shardings=sshard)(p)
  block = jax.jit(at_step(tx, 1).update, out_shardings=(pshard, sshard))
  text = block.lower(p, state, p).compile().as_text()
  update = jax.jit(tx.update, out_shardings=(pshard, sshard))
  for step in range(steps):
    u, state = update(jax.device_put(grads_at(step, params), pshard), state, p)
    p = optax.apply_updates(p, u)
  return {op: n for op, (n, _) in collective_stats(text).items() if n}, (p, state)


def test_block_steps_on_an_auto_mesh_read_the_stated_layout():
  # On an Auto mesh the block step's shard_map takes each leaf where the stated layout
  # puts its state, as the types say on an Explicit mesh: it moves nothing but the
  # AdamW leaves' gathers. Guessing FSDP instead cost 16 collectives against 4.
  auto, (auto_p, auto_s) = tp_run(AxisType.Auto)
  explicit, (explicit_p, explicit_s) = tp_run(AxisType.Explicit)
  assert auto == explicit == {"all-gather": 4}
  assert_close_per_leaf(flat(auto_p), flat(explicit_p), "muonbp")
  assert_close_per_leaf(flat(auto_s), flat(explicit_s), "muonbp")
