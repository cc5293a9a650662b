"""The Muon family against AdamW: validation loss on the same GPT and data, each optimizer
at its own best learning rate, two seeds; the Newton–Schulz presets by training loss;
and each optimizer's step time relative to Muon's.

Every run trains `workload/gpt.py` on the standard library's source bytes with the same
initialization and batch sequence (per seed) under the same warmup + cosine schedule
(`workload/train.py`; AdamW with b2 0.95, gradients clipped to norm 1). Protocol:

1. AdamW sweeps its rates (seed 0); its best is every family member's aux AdamW rate.
2. Each of muon, normuon, adamuon and adaptive (muon(scale="adaptive")) sweeps its own
   rates (seed 0). A sweep whose best is at an edge is extended past that edge, doubling
   or halving, until the best is inside it (at most --extend times).
3. At each optimizer's best rate, the other seeds run too: the table reports the mean
   final validation loss over seeds and their spread (max − min), and the steps each
   needs to reach AdamW's mean final validation loss (its curve read between
   evaluations; "—" if it never does), as a fraction of the run.
4. --presets: Muon with each Newton–Schulz preset on every seed, at Muon's best rate
   times each of --preset-factors; with several factors, turbo runs them too and each
   preset is reported at its own best factor (by the mean over seeds, for every preset
   alike), since a preset whose singular values land elsewhere may want another rate.
5. The optimizer step (update + apply) of each optimizer on this model, jitted, timed
   interleaved: min and median of --time-reps calls, relative to Muon's, with the load
   average around them.

Writes --out-dir/convergence.json (every run), convergence.png (best runs' validation
curves) and prints the tables. Every finished run is also appended to --out-dir/runs.jsonl,
and a run found there is not run again: a stopped sweep resumes where it was.

    python -m benchmarks.convergence                          # main job's config, ~30 min
    python -m benchmarks.convergence --layers 4 --d-model 128 # the wider config
    python -m benchmarks.convergence --times-only             # step times alone (idle machine)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx

from benchmarks.common import LoadWatch, machine, ratio_table, time_steps
from workload import stdlib_text
from workload.config import BEST_LR, FRONTIER, OPTIMIZERS, TrainConfig, add_flags
from workload.train import make_model, make_optimizer, routing_of, steps_to_reach, train

FAMILY = ("muon", "normuon", "adamuon", "adaptive")
RATES = {"adamw": [2e-3, 3e-3, 6e-3, 1e-2], "muon": [0.01, 0.02, 0.04, 0.08],
         "normuon": [0.01, 0.02, 0.04, 0.08], "adamuon": [2e-3, 4e-3, 8e-3, 1.6e-2],
         "adaptive": [0.1, 0.2, 0.4, 0.8],
         **{name: [0.01, 0.02, 0.04, 0.08] for name in FRONTIER}, "muonh": [0.01, 0.02, 0.04]}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_flags(p, ["steps", "d_model", "layers", "heads", "seq_len", "batch", "eval_every",
               "eval_batches", "data_root"], steps=350, d_model=64, layers=2, seq_len=64,
            eval_every=25)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  p.add_argument("--optimizers", nargs="+", default=["adamw", *FAMILY], choices=OPTIMIZERS,
                 help=f"the frontier: {' '.join(FRONTIER)} (see workload/config.py)")
  for name, rates in RATES.items():
    p.add_argument(f"--{name}-lrs", type=float, nargs="+", default=rates)
  p.add_argument("--extend", type=int, default=3, help="most extensions of an edge sweep")
  p.add_argument("--presets", nargs="*", default=["jordan", "polar_express"],
                 help="Newton–Schulz presets to compare with turbo (none: skip)")
  p.add_argument("--preset-factors", type=float, nargs="+", default=[1.0],
                 help="rates of the preset comparison, as factors of Muon's best")
  p.add_argument("--time-reps", type=int, default=30)
  p.add_argument("--times-only", action="store_true",
                 help="only step 5, at the rates of workload.config.BEST_LR (a step's time "
                      "does not depend on its rate)")
  p.add_argument("--out-dir", default="runs/convergence")
  p.add_argument("--rerun", action="store_true",
                 help="run everything again, ignoring and not writing --out-dir/runs.jsonl")
  return p.parse_args(argv)


class Runner:
  """Runs and remembers training runs by (optimizer, lr, seed, ns). With a `done` file,
  each finished run is appended to it, and a run whose whole config is found there is
  not run again: a sweep can be stopped and resumed, across sessions."""

  def __init__(self, base: TrainConfig, data: tuple, done: Optional[pathlib.Path] = None):
    self.base, self.data, self.records, self.done = base, data, {}, done
    self.saved = []
    if done is not None and done.exists():
      self.saved = [json.loads(line)["record"] for line in done.read_text().splitlines()]

  def _on_disk(self, cfg: TrainConfig) -> Optional[dict[str, Any]]:
    """The saved run of `cfg`: a field a saved config lacks (one added since) counts as
    its default, which reproduces the runs made before it existed."""
    want, defaults = dataclasses.asdict(cfg.resolved()), dataclasses.asdict(TrainConfig())
    for record in self.saved:
      if all(record["config"].get(k, defaults[k]) == v for k, v in want.items()):
        return record
    return None

  def __call__(self, optimizer: str, lr: float, seed: int, ns: str = "turbo",
               adam_lr: Optional[float] = None) -> dict[str, Any]:
    key = (optimizer, lr, seed, ns)
    if key not in self.records:
      cfg = dataclasses.replace(self.base, optimizer=optimizer, lr=lr, seed=seed, ns=ns,
                                adam_lr=lr if optimizer == "adamw" else adam_lr)
      record = self._on_disk(cfg)
      if record is None:
        record = train(cfg, *self.data, progress=None, log=lambda line: None)
        record["label"] = (f"{optimizer} lr={lr:g} seed={seed}" +
                           (f" ns={ns}" if ns != "turbo" else ""))
        if self.done is not None:
          self.done.parent.mkdir(parents=True, exist_ok=True)
          with self.done.open("a") as f:
            f.write(json.dumps({"record": record}, default=str) + "\n")
        status = f"({record['time_s']:.0f}s)"
      else:
        status = "(on disk)"
      print(f"  {record['label']:<34} final val {record['final_val_loss']:.4f}  {status}",
            flush=True)
      self.records[key] = record
    return self.records[key]


def sweep(run: Runner, optimizer: str, rates: list[float], extend: int, **kw) -> float:
  """The best rate on seed 0, extending the sweep past an edge where the best lies."""
  rates = sorted(rates)
  while True:
    losses = [run(optimizer, lr, 0, **kw)["final_val_loss"] for lr in rates]
    i = int(np.argmin(losses))
    if 0 < i < len(rates) - 1 or extend == 0:
      if i in (0, len(rates) - 1):
        print(f"  note: {optimizer}'s best rate {rates[i]:g} is still at the sweep's edge")
      return rates[i]
    rates = [rates[0] / 2] + rates if i == 0 else rates + [rates[-1] * 2]
    extend -= 1


def at_best(run: Runner, optimizer: str, lr: float, seeds: list[int], **kw) -> list[dict]:
  return [run(optimizer, lr, seed, **kw) for seed in seeds]


def summary_row(name: str, lr: float, runs: list[dict], target: float, steps: int) -> dict:
  finals = [r["final_val_loss"] for r in runs]
  reach = [steps_to_reach(r["val_loss"], target) for r in runs]
  return {"optimizer": name, "lr": lr, "final_val_loss": finals,
          "mean": float(np.mean(finals)), "spread": float(max(finals) - min(finals)),
          "steps_to_adamw_best": reach,
          "reach_fraction": None if None in reach else float(np.mean(reach)) / steps}


def step_times(base: TrainConfig, best: dict[str, float], adam_lr: float, reps: int) -> dict:
  """Seconds per optimizer step (update + apply, jitted) of each optimizer on the model."""
  model = make_model(base)
  routing = routing_of(model, base)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  grads = treedef.unflatten([0.01 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  arms = {name: make_optimizer(dataclasses.replace(base, optimizer=name, lr=lr,
                                                   adam_lr=adam_lr if name != "adamw" else lr),
                               routing) for name, lr in best.items()}
  times, _ = time_steps(arms, params, grads, warmup=2, steps=reps)
  return times


def times_only(base: TrainConfig, args: argparse.Namespace) -> dict[str, Any]:
  best = {name: BEST_LR[name] for name in args.optimizers}
  with LoadWatch() as load:
    times = step_times(base, best, BEST_LR["adamw"], args.time_reps)
  print(f"\noptimizer step (update + apply, jitted), {args.time_reps} interleaved calls; "
        f"{load.note()}\n")
  print(ratio_table(times, "muon" if "muon" in times else next(iter(times))))
  return {"step_times_s": times, "load": load.note()}


def plot(rows: list[dict], run: Runner, target: float, path: pathlib.Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  for i, row in enumerate(rows):
    r = run(row["optimizer"], row["lr"], 0, **row.get("run_kw", {}))
    steps, val = zip(*r["val_loss"])
    ax.plot(steps, val, "o-", color=f"C{i}", ms=3, label=f"{row['label']} lr {row['lr']:g}")
  ax.axhline(target, color="gray", lw=0.8, ls=":", label="AdamW's mean final val")
  lo = min(min(v for _, v in run(r["optimizer"], r["lr"], 0, **r.get("run_kw", {}))["val_loss"])
           for r in rows)
  ax.set(xlabel="step", ylabel="validation cross-entropy (nats/byte)", title=title,
         ylim=(lo - 0.05, lo + 1.0))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(rows: list[dict], steps: int) -> str:
  out = ["| optimizer | lr | final val (mean over seeds) | seed spread | per seed | "
         "steps to AdamW's final | ", "|---|--:|--:|--:|---|--:|"]
  for row in rows:
    reach = ("—" if row["reach_fraction"] is None else
             f"{row['reach_fraction']:.2f} ({', '.join(f'{s:.0f}' for s in row['steps_to_adamw_best'])})")
    out.append(f"| {row['label']} | {row['lr']:g} | {row['mean']:.4f} | {row['spread']:.4f} | "
               f"{', '.join(f'{v:.4f}' for v in row['final_val_loss'])} | {reach} |")
  return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = parse_args(argv)
  t0 = time.perf_counter()
  base = TrainConfig(steps=args.steps, d_model=args.d_model, layers=args.layers,
                     heads=args.heads, seq_len=args.seq_len, batch=args.batch,
                     eval_every=args.eval_every, eval_batches=args.eval_batches)
  train_split, val_split = stdlib_text.load_splits(args.data_root or None)
  run = Runner(base, (train_split.data, val_split.data),
               None if args.rerun else pathlib.Path(args.out_dir) / "runs.jsonl")
  print(f"machine: {machine()}")
  print(f"model: GPT {args.layers} layers × d_model {args.d_model}, {args.heads} heads, "
        f"seq_len {args.seq_len}, batch {args.batch}, {args.steps} steps; seeds {args.seeds}; "
        f"val every {args.eval_every} steps on {args.eval_batches}×{args.batch} windows")
  if args.times_only:
    return times_only(base, args)
  rates = lambda name: getattr(args, f"{name.replace('-', '_')}_lrs")
  print("sweeps (seed 0):")
  adam_lr = sweep(run, "adamw", rates("adamw"), args.extend)
  best = {"adamw": adam_lr}
  for name in (n for n in args.optimizers if n != "adamw"):
    best[name] = sweep(run, name, rates(name), args.extend, adam_lr=adam_lr)
  print("best rates on every seed:")
  adamw_runs = at_best(run, "adamw", adam_lr, args.seeds)
  target = float(np.mean([r["final_val_loss"] for r in adamw_runs]))
  rows = []
  for name, lr in best.items():
    kw = {} if name == "adamw" else {"adam_lr": adam_lr}
    row = summary_row(name, lr, at_best(run, name, lr, args.seeds, **kw), target, args.steps)
    rows.append({**row, "label": name, "run_kw": kw})
  if args.presets and "muon" in best:
    print("Newton–Schulz presets:")
    presets = args.presets if args.preset_factors == [1.0] else ["turbo", *args.presets]
    for ns in presets:
      kw = {"adam_lr": adam_lr, "ns": ns}
      candidates = [summary_row("muon", best["muon"] * f, at_best(
          run, "muon", best["muon"] * f, args.seeds, **kw), target, args.steps)
                    for f in args.preset_factors]
      row = min(candidates, key=lambda r: r["mean"])
      rows.append({**row, "label": f"muon ns={ns}", "run_kw": kw})

  print("optimizer step times:")
  with LoadWatch() as load:
    times = step_times(base, best, adam_lr, args.time_reps)

  print(f"\nfinal validation loss at each optimizer's best rate (chosen on seed 0), "
        f"seeds {args.seeds}; target = AdamW's mean final val {target:.4f}\n")
  print(table(rows, args.steps))
  reference = "muon" if "muon" in times else next(iter(times))
  print(f"\noptimizer step (update + apply, jitted), {args.time_reps} interleaved calls; "
        f"{load.note()}\n")
  print(ratio_table(times, reference))
  out = pathlib.Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  summary = {"best_rates": best, "target": target, "rows": rows,
             "step_times_s": times, "load": load.note(), "machine": machine(),
             "args": vars(args), "total_time_s": time.perf_counter() - t0}
  (out / "convergence.json").write_text(json.dumps(
      {"summary": summary, "runs": list(run.records.values())}, indent=1, default=str))
  plot([r for r in rows if "ns=" not in r["label"]], run, target, out / "convergence.png",
       f"GPT {args.layers}×{args.d_model} on stdlib bytes, {args.steps} steps (seed 0)")
  print(f"\ntotal {summary['total_time_s']:.0f}s; wrote {out / 'convergence.png'} and "
        f"{out / 'convergence.json'}")
  return summary


if __name__ == "__main__":
  main()
