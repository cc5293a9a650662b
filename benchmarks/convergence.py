"""Muon (+ aux AdamW) vs AdamW: validation loss per step on the same GPT and the same data.

Both arms train `examples/gpt.py` on the standard library's source bytes
(`examples/stdlib_text.py`) with the same initialization and the same batch sequence,
under the same warmup + cosine schedule, each over a learning-rate sweep:

1. AdamW over --adamw-lrs (every parameter);
2. Muon over --muon-lrs for the hidden matrices, its aux AdamW (embeddings, head, norms,
   biases) at the best AdamW learning rate from step 1.

Reported: the best final validation loss of each arm; the steps the best Muon run needs
to reach the best AdamW final validation loss, as a ratio of AdamW's steps (read off
Muon's validation curve, linearly interpolated between evaluations: conservative, since
that run's schedule has not decayed yet at that step); Newton–Schulz flops as a
percentage of training flops (6·N·tokens, N = all parameters). Writes the curves to
--out-dir/convergence.png and every run to --out-dir/convergence.json.

The default is the main job's configuration (`python -m examples.train_gpt`), whose
learning rates are the best of this sweep (benchmarks/results/convergence.txt).

    python -m benchmarks.convergence                       # ~5 min on 2 idle CPU cores
    python -m benchmarks.convergence --steps 2000 --d-model 256 --layers 6 --heads 8 \\
        --seq-len 256 --batch 64                           # a bigger run for an accelerator
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time
from typing import Any, Optional

import numpy as np

from benchmarks.common import machine_info
from examples import stdlib_text, train_gpt
from examples.train_gpt import TrainConfig, steps_to_reach


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=350)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--eval-every", type=int, default=25)
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 3e-3, 6e-3, 1e-2])
  p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04, 0.08])
  p.add_argument("--out-dir", default="runs/convergence")
  return p.parse_args(argv)


def sweep(base: TrainConfig, optimizer: str, lrs: list[float], data: tuple, **fixed: Any
          ) -> list[dict[str, Any]]:
  """One run per learning rate; `lrs` set `lr` for Muon, `adam_lr` for AdamW."""
  records = []
  for lr in lrs:
    field = "lr" if optimizer == "muon" else "adam_lr"
    cfg = dataclasses.replace(base, optimizer=optimizer, **{field: lr}, **fixed)
    record = train_gpt.train(cfg, *data, progress=None, log=lambda line: None)
    record["label"] = f"{optimizer} lr={lr:g}"
    print(f"  {record['label']:<18} final val {record['final_val_loss']:.4f}  "
          f"({record['time_s']:.0f}s)", flush=True)
    records.append(record)
  return records


def best(records: list[dict[str, Any]], lrs: list[float]) -> dict[str, Any]:
  i = int(np.argmin([r["final_val_loss"] for r in records]))
  if len(lrs) > 1 and i in (0, len(lrs) - 1):
    print(f"  note: the best {records[i]['optimizer']} learning rate {lrs[i]:g} is at the "
          "edge of the sweep; widen it to be sure of the optimum.")
  return records[i]


def plot(adamw: list[dict], muon: list[dict], best_adamw: dict, best_muon: dict,
         target: float, path: pathlib.Path, title: str) -> None:
  """Validation curves of every run (best of each arm bold), AdamW's best as a line."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  for records, color in ((adamw, "C0"), (muon, "C1")):
    for r in records:
      steps, val = zip(*r["val_loss"])
      is_best = r is best_adamw or r is best_muon
      ax.plot(steps, val, "o-" if is_best else "--", color=color, ms=3,
              lw=2 if is_best else 0.8, alpha=1 if is_best else 0.5, label=r["label"])
  ax.axhline(target, color="gray", lw=0.8, ls=":", label="best AdamW final val")
  ax.set(xlabel="step", ylabel="validation cross-entropy (nats/byte)", title=title)
  lo = min(min(v for _, v in r["val_loss"]) for r in adamw + muon)
  ax.set_ylim(lo - 0.05, lo + 1.0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = parse_args(argv)
  t0 = time.perf_counter()
  base = TrainConfig(steps=args.steps, d_model=args.d_model, layers=args.layers,
                     heads=args.heads, seq_len=args.seq_len, batch=args.batch,
                     eval_every=args.eval_every, eval_batches=args.eval_batches,
                     seed=args.seed)
  train_split, val_split = stdlib_text.load_splits()
  data = (train_split.data, val_split.data)
  m = machine_info()
  print(f"machine: {m['platform']}, {m['processor']}, {m['cpu_count']} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; python {m['python']}, jax {m['jax']} "
        f"({m['backend']}, {len(m['devices'])} device(s))")
  print(f"model: GPT {args.layers} layers × d_model {args.d_model}, {args.heads} heads, "
        f"seq_len {args.seq_len}, batch {args.batch}, {args.steps} steps, seed {args.seed}; "
        f"val every {args.eval_every} steps on {args.eval_batches}×{args.batch} fixed windows")

  print("AdamW sweep:")
  adamw = sweep(base, "adamw", args.adamw_lrs, data)
  best_adamw = best(adamw, args.adamw_lrs)
  aux_lr = best_adamw["config"]["adam_lr"]
  print(f"Muon sweep (aux AdamW lr {aux_lr:g}):")
  muon = sweep(base, "muon", args.muon_lrs, data, adam_lr=aux_lr)
  best_muon = best(muon, args.muon_lrs)

  target = best_adamw["final_val_loss"]
  reach = steps_to_reach(best_muon["val_loss"], target)
  ns_pct = 100 * best_muon["ns_flops_per_step"] / best_muon["train_flops_per_step"]
  tokens_per_step = args.batch * args.seq_len
  summary = {
      "best_adamw": {"lr": aux_lr, "final_val_loss": target},
      "best_muon": {"lr": best_muon["config"]["lr"], "adam_lr": aux_lr,
                    "final_val_loss": best_muon["final_val_loss"]},
      "muon_steps_to_adamw_best": reach,
      "step_ratio": None if reach is None else reach / args.steps,
      "ns_flops_per_step": best_muon["ns_flops_per_step"],
      "train_flops_per_step": best_muon["train_flops_per_step"],
      "ns_flops_percent": ns_pct,
      "params": best_muon["params"],
      "machine": m,
      "load_average_1min_at_end": os.getloadavg()[0],
      "total_time_s": time.perf_counter() - t0,
  }

  print()
  print(train_gpt.summary_table(adamw + muon))
  print()
  print(f"best AdamW: lr {aux_lr:g}, final val loss {target:.4f}")
  print(f"best Muon:  lr {best_muon['config']['lr']:g} (aux AdamW lr {aux_lr:g}), "
        f"final val loss {best_muon['final_val_loss']:.4f}")
  if reach is None:
    print(f"Muon never reached AdamW's best final val loss {target:.4f} within "
          f"{args.steps} steps (ratio > 1).")
  else:
    print(f"Muon reaches AdamW's best final val loss at step {reach:.0f} of {args.steps}: "
          f"ratio {reach / args.steps:.2f} (read off the full-length Muon run's curve)")
  print(f"Newton–Schulz (standard-iteration count; Gram-space groups cost less): "
        f"{best_muon['ns_flops_per_step']:,} flops/step = {ns_pct:.2f}% of "
        f"training flops 6·N·tokens = 6·{best_muon['params']:,}·{tokens_per_step:,} "
        f"(NS cost does not grow with tokens: it would be 1% at "
        f"{best_muon['ns_flops_per_step'] / (0.06 * best_muon['params']):,.0f} tokens/step)")
  mean_tps = lambda rs: np.mean([r["tokens_per_s"] for r in rs])
  print(f"throughput on this machine: AdamW {mean_tps(adamw):,.0f} tokens/s, Muon "
        f"{mean_tps(muon):,.0f} tokens/s (mean over the sweep, shared CPU: indicative only)")

  out = pathlib.Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  plot(adamw, muon, best_adamw, best_muon, target, out / "convergence.png",
       f"GPT {args.layers}×{args.d_model} on stdlib bytes: Muon vs AdamW, {args.steps} steps")
  (out / "convergence.json").write_text(json.dumps({"summary": summary, "runs": adamw + muon},
                                                   indent=1))
  print(f"total {summary['total_time_s']:.0f}s; wrote {out / 'convergence.png'} and "
        f"{out / 'convergence.json'}")
  return summary


if __name__ == "__main__":
  main()
