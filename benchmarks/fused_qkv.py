"""Does orthogonalizing a fused qkv kernel as its q, k and v blocks help? The workload GPT
with one (d, 3d) qkv kernel per layer (`GPTConfig(attention="fused")`), trained with Muon
two ways: the kernel split into its 3 blocks, as `infer_routing` finds it, and the same
kernel as one matrix; each at its own best rate (swept on seed 0), then every seed.

Protocol and data as `benchmarks.convergence` (its runner, resumable from
--out-dir/runs.jsonl). Prints final validation losses, their seed spread, and the
Newton–Schulz flops per step of each.

    python -m benchmarks.fused_qkv                       # 2 layers × 64, ~10 min
    python -m benchmarks.fused_qkv --steps 20 --seeds 0 --lrs 0.04 --data-root DIR --out-dir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import Optional

import numpy as np

from benchmarks.common import header
from benchmarks.convergence import Runner
from workload import stdlib_text
from workload.config import TrainConfig, add_flags


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_flags(p, ["steps", "d_model", "layers", "eval_every", "data_root"], steps=350,
            d_model=64, layers=2, eval_every=25)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04, 0.08])
  p.add_argument("--adam-lr", type=float, default=6e-3)
  p.add_argument("--out-dir", default="runs/fused_qkv")
  return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
  args = parse_args(argv)
  train_split, val_split = stdlib_text.load_splits(args.data_root or None)
  data = (train_split.data, val_split.data)
  done = pathlib.Path(args.out_dir) / "runs.jsonl"
  print(header("benchmarks.fused_qkv", argv))
  print(f"model: GPT {args.layers} layers × d_model {args.d_model} with a fused qkv kernel, "
        f"{args.steps} steps; seeds {args.seeds}; Muon, AdamW {args.adam_lr:g} for the rest")
  rows = {}
  for label, split in (("qkv split in 3", True), ("qkv as one matrix", False)):
    base = TrainConfig(steps=args.steps, d_model=args.d_model, layers=args.layers,
                       eval_every=args.eval_every, attention="fused", split_fused=split)
    run = Runner(base, data, done)
    print(f"{label}:")
    finals = {lr: run("muon", lr, args.seeds[0], adam_lr=args.adam_lr)["final_val_loss"]
              for lr in args.lrs}
    best = min(finals, key=finals.get)
    runs = [run("muon", best, seed, adam_lr=args.adam_lr) for seed in args.seeds]
    rows[label] = {"lr": best, "finals": [r["final_val_loss"] for r in runs],
                   "ns_flops": runs[0]["ns_flops_per_step"], "sweep": finals,
                   "config": dataclasses.asdict(base)}
  print("\n| Muon on the fused GPT | lr | final val (mean over seeds) | seed spread | per seed "
        "| Newton–Schulz flops per step |\n|---|--:|--:|--:|---|--:|")
  for label, row in rows.items():
    f = row["finals"]
    print(f"| {label} | {row['lr']:g} | {np.mean(f):.4f} | {max(f) - min(f):.4f} | "
          f"{', '.join(f'{x:.4f}' for x in f)} | {row['ns_flops']:,} |")
  return rows


if __name__ == "__main__":
  main()
