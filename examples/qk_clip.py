"""MuonClip on a small byte-level GPT: attention logits explode at a high Muon learning rate,
and QK-clip (Kimi K2, arXiv 2507.20534) caps them at τ.

Trains the workload's GPT (`workload/gpt.py` with `attention="clip"`) twice on the bytes
of the Python standard library's `.py` files, with the same seed and batches: once with
`mo.muon`, once with `optax.chain(mo.muon(...), mo.qk_clip(tau))`. Each
`mo.nnx.ClipAttention` sows its per-head max pre-softmax logit S_h; the step passes those
to the optimizer. S_h is measured in the forward pass, before the update, so the clipped
curve sits at τ plus at most one step's growth. Writes max-logit and loss curves to
<out-dir>/qk_clip.png and prints both final losses.

    python -m examples.qk_clip                 # ~2 min on 2 CPU cores
    python -m examples.qk_clip --steps 600 --lr 0.08 --tau 50
    python -m examples.qk_clip --steps 2 --batch 2 --seq-len 16 --d-model 16 --heads 2 \
        --layers 1 --data-root DIR --out-dir DIR   # smallest: both runs train
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx

import muon_optax as mo
from workload.config import add_flags
from workload.gpt import GPT, GPTConfig
from workload.stdlib_text import batches, eval_batches, load_splits

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_and_max_logits(model, batch):
  logits, inter = nnx.capture(model, nnx.Intermediate)(batch[:, :-1])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
  return loss, mo.nnx.max_logits(inter)  # {"blocks/0/attn": (heads,), ...}


@nnx.jit
def train_step(model, optimizer, batch):
  (loss, max_logits), grads = nnx.value_and_grad(loss_and_max_logits, has_aux=True)(model, batch)
  optimizer.update(model, grads, max_logits=max_logits)  # plain Muon ignores max_logits
  return loss, jnp.max(jnp.stack(list(max_logits.values())))


@nnx.jit
def eval_loss(model, batch):
  return loss_and_max_logits(model, batch)[0]


def train(args, make_tx, train_data, val_batches, label):
  """`make_tx(model)`: the optimizer, which reads its routing from the model."""
  cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, layers=args.layers,
                  heads=args.heads, attention="clip", attn_bias=False)
  model = GPT(cfg, rngs=nnx.Rngs(args.seed))
  optimizer = nnx.Optimizer(model, make_tx(model), wrt=nnx.Param)
  data = batches(train_data, args.batch, args.seq_len, seed=args.seed)
  losses, max_logits = [], []
  start = time.perf_counter()
  for step in range(args.steps):
    loss, s = train_step(model, optimizer, next(data))
    losses.append(float(loss))
    max_logits.append(float(s))
    if step % 50 == 0 or step == args.steps - 1:
      print(f"  {label:>9} step {step:4d}  loss {losses[-1]:.3f}  max logit {max_logits[-1]:9.1f}")
  val = float(np.mean([eval_loss(model, b) for b in val_batches]))
  print(f"  {label:>9}: {time.perf_counter() - start:.0f} s")
  return np.array(losses), np.array(max_logits), val


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lr", type=float, default=0.1, help="Muon learning rate (high on purpose)")
  p.add_argument("--tau", type=float, default=100.0, help="QK-clip cap (Kimi K2: 100)")
  add_flags(p, ["steps", "adam_lr", "batch", "seq_len", "d_model", "heads", "layers", "seed",
                "data_root"], steps=300, adam_lr=3e-3, batch=16, seq_len=64, d_model=64,
            layers=2)
  p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("runs/qk_clip"))
  return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, tuple]:
  """Runs both trainings; returns (train losses, max logits, val loss) of each."""
  args = parser().parse_args(argv)
  train_split, val_split = load_splits(args.data_root or None, max_bytes=4_000_000)
  val_batches = eval_batches(val_split.data, args.batch, args.seq_len, count=8)
  tokens = jnp.zeros((1, args.seq_len), jnp.int32)
  muon = lambda model: mo.muon(args.lr, routing=mo.infer_routing(model, tokens),
                               adam=mo.AuxAdam(learning_rate=args.adam_lr))
  print(f"Muon lr {args.lr}, τ = {args.tau}, {args.steps} steps on {jax.devices()[0].platform}")
  runs = {
      "Muon": train(args, muon, train_split.data, val_batches, "Muon"),
      "MuonClip": train(args, lambda model: optax.chain(muon(model), mo.qk_clip(args.tau)),
                        train_split.data, val_batches, "MuonClip"),
  }

  args.out_dir.mkdir(parents=True, exist_ok=True)
  fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
  for name, (losses, max_logits, _) in runs.items():
    ax_s.plot(max_logits, label=name)
    ax_l.plot(losses, label=name, alpha=0.8)
  ax_s.axhline(args.tau, color="gray", ls="--", lw=1, label=f"τ = {args.tau:g}")
  ax_s.set(yscale="log", xlabel="step", ylabel="max pre-softmax logit (all heads)",
           title=f"Max attention logit, Muon lr {args.lr:g}")
  ax_l.set(xlabel="step", ylabel="train loss (nats/byte)", title="Training loss")
  for ax in (ax_s, ax_l):
    ax.legend()
  fig.tight_layout()
  fig.savefig(args.out_dir / "qk_clip.png", dpi=120)

  print(f"\n{'':9}  {'max logit (peak)':>16}  {'final max logit':>15}  {'final train loss':>16}  "
        f"{'val loss':>8}")
  for name, (losses, max_logits, val) in runs.items():
    print(f"{name:9}  {max_logits.max():16.1f}  {max_logits[-1]:15.1f}  "
          f"{losses[-20:].mean():16.3f}  {val:8.3f}")
  print(f"\nwrote {args.out_dir / 'qk_clip.png'}")
  return runs


if __name__ == "__main__":
  main()
