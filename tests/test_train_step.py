"""The whole training step of `benchmarks.train_step` (the Llama-style decoder of
`workload.llama`, forward, backward, clip, update, apply in one jit) at its smallest: on 8
simulated devices under FSDP it computes what one device computes, and Muon's compiled
step has at most AdamW's collectives plus its exchange's, nothing added to forward or
backward."""

import dataclasses

import jax
import numpy as np
import pytest
from _helpers import all_to_all_bytes

from benchmarks import train_step
from benchmarks.train_step import collectives, init_params, make_mesh, run_steps

BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def tiny():
  return dataclasses.replace(train_step.model_config("tiny"), dtype="float32")


def test_fsdp_step_equals_one_device_to_float32_rounding(tiny):
  """Both float32 runs are measured against the same steps in float64 on one device:
  the sharded run may err by at most a few times what one device's float32 errs."""
  params = init_params(tiny, BATCH, SEQ)
  data = np.asarray(jax.random.randint(jax.random.key(1), (2, BATCH, SEQ + 1), 0, tiny.vocab))
  mesh = make_mesh(jax.devices(), "fsdp", tiny)
  sharded = run_steps(tiny, "fsdp", mesh, "muon", params, data)
  alone = run_steps(tiny, None, None, "muon", params, data)
  with jax.enable_x64(True):
    wide = dataclasses.replace(tiny, dtype="float64")
    exact = run_steps(wide, None, None, "muon", jax.tree.map(lambda x: np.float64(x), params),
                      data)
  error = lambda tree: max(float(np.max(np.abs(np.float64(a) - b)))
                           for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(exact)))
  moved = max(float(np.max(np.abs(a - b)))
              for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(params)))
  assert error(alone) < 1e-3 * moved  # the reference is float32's: its error is rounding
  assert error(sharded) <= 4 * error(alone)


def _update_alone(s: train_step.Setup) -> str:
  """The step's `tx.update` compiled alone, fed gradients in the params' layout: the
  exchange's collectives, with the clip's (and AdamW's own, for "optax.adamw")."""
  update = jax.jit(s.tx.update, out_shardings=s.shardings)
  with jax.set_mesh(s.mesh):
    return update.lower(s.params, s.state, s.params).compile().as_text()


def test_muon_step_adds_only_its_exchange(tiny):
  cfg = dataclasses.replace(tiny, dtype="bfloat16")
  mesh = make_mesh(jax.devices(), "fsdp", cfg)
  setups = {arm: train_step.setup(cfg, "fsdp", mesh, arm, BATCH, SEQ)
            for arm in ("optax.adamw", "muon")}
  step = {arm: collectives(train_step.lower(s).compile().as_text()) for arm, s in setups.items()}
  alone = {arm: collectives(_update_alone(s))["step"] for arm, s in setups.items()}
  outside = lambda c: {k: n - c["optimizer"].get(k, (0, 0))[0] for k, (n, _) in c["step"].items()}
  count = lambda c, k: c.get(k, (0, 0))[0]
  kinds = set(step["muon"]["step"]) | set(step["optax.adamw"]["step"]) | set(alone["muon"])
  # Forward and backward: nothing added (XLA may partition them with fewer gathers when
  # the optimizer's own collectives sit beside them, never with more).
  for kind in kinds:
    assert outside(step["muon"]).get(kind, 0) <= outside(step["optax.adamw"]).get(kind, 0), kind
  # The whole step: at most AdamW's collectives and the exchange's (what Muon's update
  # compiled alone has beyond AdamW's update compiled alone), and the exchange is there.
  exchange = sum(count(alone["muon"], k) - count(alone["optax.adamw"], k) for k in kinds)
  total = lambda c: sum(n for n, _ in c["step"].values())
  assert count(step["muon"]["optimizer"], "all-to-all") > 0
  assert total(step["muon"]) <= total(step["optax.adamw"]) + exchange


@pytest.mark.parametrize("arm, share", [
    ("muon", 1),  # a CPU mesh's float32 operands: the results come back whole
    ("muon float32 exchange", 1), ("muon bfloat16 exchange", 0.5)])
def test_the_exchange_arms_move_the_dtype_they_name(tiny, arm, share):
  def moved(arm):
    s = train_step.setup(tiny, "fsdp", make_mesh(jax.devices(), "fsdp", tiny), arm, BATCH, SEQ)
    with jax.set_mesh(s.mesh):
      return all_to_all_bytes(jax.jit(s.tx.update).lower(s.params, s.state, s.params).as_text())
  whole = moved("muon float32 exchange")
  assert whole and moved(arm) == [share * b for b in whole]


def test_the_contrib_arm_orthogonalizes_each_layer_of_a_scanned_kernel(tiny):
  """optax.contrib.muon, told the routing's views, sees a scanned (layers, d, ffn) kernel
  as one matrix per layer: each layer's update has the singular values Jordan's 5 steps
  leave on a Gaussian matrix (within [0.68, 1.13] of their mean scale, ratio ≤ 1.7)."""
  s = train_step.setup(tiny, None, None, "optax.contrib.muon", BATCH, SEQ,
                       init_params(tiny, BATCH, SEQ))
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(3), x.shape), s.params)
  updates, _ = s.tx.update(grads, s.state, s.params)
  kernel = np.asarray(updates["layers"]["mlp"]["up"]["kernel"], np.float64)
  assert kernel.ndim == 3
  for layer in kernel:
    sigma = np.linalg.svd(layer, compute_uv=False)
    assert sigma.max() / sigma.min() <= 1.7, sigma


def test_the_estimates_bracket_the_extra_between_overlapped_and_serial():
  """The extra's flops, HBM bytes and bytes received, each a millisecond at the chip's
  rates, against a one-second AdamW step: 3 ms one after another, 2 ms with the bytes
  under the flops."""
  rate = train_step.ROOFLINE
  # Half the bytes received in the optimizer's scope, half where XLA moved them out of it.
  row = lambda flops, hbm, recv: {
      "flops": flops, "hbm_bytes": hbm, "model_flops": rate["flops"],
      "collectives": {"step": {"all-to-all": [2, recv / 2], "all-reduce": [1, recv / 2]},
                      "optimizer": {"all-to-all": [2, recv / 2]}}}
  adamw = row(0.0, 0.0, 0)
  muon = row(1e-3 * rate["flops"], 1e-3 * rate["hbm"], 1e-3 * rate["ici"])
  e = train_step.extra(muon, adamw)
  assert e["step"] == pytest.approx(1.0) and e["recv"] == pytest.approx(1e-3 * rate["ici"])
  assert e["percent"] == pytest.approx(0.3) and e["overlapped_percent"] == pytest.approx(0.2)
  # An arm that saves HBM traffic is not credited for it.
  e = train_step.extra(row(1e-3 * rate["flops"], -1.0, 0), adamw)
  assert e["percent"] == pytest.approx(e["overlapped_percent"]) == pytest.approx(0.1)


def test_the_table_weighs_each_arm_against_adamw_at_its_own_batch():
  """Rows at 1M and 4M tokens a step: each Muon row's extra is taken against the AdamW row
  of its own token count, whose step is four times as long at 4M."""
  rate = train_step.ROOFLINE

  def row(arm, tokens, flops):
    return {"model": "8b", "layout": "fsdp", "arm": arm, "platform": "tpu", "devices": 256,
            "tokens": tokens, "flops": flops, "hbm_bytes": 0.0, "peak_bytes": 0,
            "compile_s": 1.0, "model_flops": rate["flops"] * tokens / 2**20,
            "collectives": {"step": {}, "optimizer": {}, "async": 0}}

  rows = [row("muon", 2**22, 1.01 * rate["flops"] * 4), row("optax.adamw", 2**20, rate["flops"]),
          row("muon", 2**20, 1.01 * rate["flops"]), row("optax.adamw", 2**22, rate["flops"] * 4)]
  lines = train_step.markdown_table(rows).splitlines()[2:]
  assert [line.split(" | ")[3:5] for line in lines] == [
      ["1M", "optax.adamw"], ["1M", "muon"], ["4M", "optax.adamw"], ["4M", "muon"]]
  assert "step 1000 ms at peak" in lines[0] and "step 4000 ms at peak" in lines[2]
  # 1% of the step in flops either way: 10 ms of 1 s at 1M, 40 ms of 4 s at 4M.
  assert lines[1].endswith("| 10.0 | 1.00 | 1.00 |") and lines[3].endswith("| 40.0 | 1.00 | 1.00 |")
