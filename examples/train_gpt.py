"""Train a small GPT on the bytes of the Python standard library's source code with Muon
and with AdamW, same init, same data order, and compare.

    python -m examples.train_gpt                       # Muon (+ AdamW for the rest) vs AdamW
    python -m examples.train_gpt --optimizer muon      # one run: Muon for hidden matrices
    python -m examples.train_gpt --optimizer normuon   # or adamuon, adaptive, adamw
    python -m examples.train_gpt --devices 4           # data parallel over 4 (simulated) devices
    python -m examples.train_gpt --describe            # print the routing table and exit
    python -m examples.train_gpt --checkpoint-dir ckpt --resume  # continue after a stop

Run from the repository root. The default configuration finishes in under 3 minutes on
a 2-core CPU. Each optimizer's learning rate (--lr) and AdamW's (--adam-lr, also every
aux AdamW's) default to the best of the sweep in benchmarks/results/convergence.txt
and frontier.txt; --weight-decay to 0.1 for the -wd / -cwd presets, else 0. It writes
`loss.png` (train and validation curves of every run) and `run.json` (config, curves,
final numbers and machine of every run) to --out-dir. The training loop is
`workload/train.py`; the model `workload/gpt.py`; the data `workload/stdlib_text.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from typing import Any, Optional

from workload.config import TrainConfig, add_flags, simulate_devices


def parse_args(argv: Optional[list[str]] = None) -> tuple[TrainConfig, argparse.Namespace]:
  """Flags -> (TrainConfig, the other options)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  # Every field is a flag; the optimizer's default is both (muon, then adamw).
  add_flags(p, [f.name for f in dataclasses.fields(TrainConfig)], optimizer=None)
  p.add_argument("--describe", action="store_true",
                 help="print the model's optimizer routing table and exit")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  if args.optimizer == "adamw" and args.lr is not None:
    p.error("--lr is the hidden matrices' rate, which an AdamW-only run does not have; "
            "set AdamW's rate with --adam-lr")
  cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                       if f.name != "optimizer"}, optimizer=args.optimizer or "muon")
  return cfg, args


if __name__ == "__main__":
  simulate_devices(parse_args()[0].devices)

import jax  # noqa: E402  (after the XLA flags above)
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

import muon_optax as mo  # noqa: E402
from workload import stdlib_text  # noqa: E402
from workload.gpt import num_params  # noqa: E402
from workload.train import make_model, plot_runs, routing_of, steps_to_reach, summary_table, train  # noqa: E402


def comparison(run: dict[str, Any], adamw: dict[str, Any]) -> str:
  """One line: final validation losses, and when `run` reached AdamW's final one."""
  target, name = adamw["final_val_loss"], run["optimizer"]
  reach = steps_to_reach(run["val_loss"], target)
  when = (f"never reached AdamW's final val loss {target:.4f}" if reach is None else
          f"reached AdamW's final val loss {target:.4f} at step {reach:.0f} of "
          f"{run['steps']} ({reach / run['steps']:.2f} of the steps)")
  return (f"final val loss: {name} {run['final_val_loss']:.4f}, AdamW {target:.4f}; "
          f"{name} {when}")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  """Runs the command line; returns {"runs": [run record, ...], "total_time_s": ...},
  also written to --out-dir/run.json."""
  t0 = time.perf_counter()
  cfg, args = parse_args(argv)
  optimizers = [args.optimizer] if args.optimizer else ["muon", "adamw"]
  runs = [dataclasses.replace(cfg, optimizer=name) for name in optimizers]
  model = make_model(cfg)
  if optimizers != ["adamw"] or args.describe:
    print(mo.describe(nnx.state(model, nnx.Param), routing=routing_of(model, cfg),
                      ns=cfg.ns))
  if args.describe:
    return {}
  train_split, val_split = stdlib_text.load_splits(cfg.data_root or None)
  print(f"data: {len(train_split.files)} train files ({len(train_split.data):,} bytes), "
        f"{len(val_split.files)} validation files ({len(val_split.data):,} bytes) from "
        f"{cfg.data_root or stdlib_text.stdlib_root()}")
  rates = ", ".join(f"{r.optimizer} lr {r.peak_lr:g}" for r in runs)
  print(f"model: {num_params(model):,} parameters; {' vs '.join(optimizers)} ({rates}, "
        f"aux AdamW lr {cfg.peak_adam_lr:g}), same init and data order; "
        f"{jax.default_backend()} × {cfg.devices}")
  records = [train(run, train_split.data, val_split.data, progress=not args.no_progress,
                   log=tqdm.write) for run in runs]
  result = {"runs": records, "total_time_s": time.perf_counter() - t0}  # with data loading
  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "run.json").write_text(json.dumps(result, indent=1))
  plot_runs(records, out / "loss.png",
            title=f"GPT {cfg.layers}×{cfg.d_model} on stdlib bytes: {' vs '.join(optimizers)}")
  print()
  print(summary_table(records))
  if len(records) == 2 and records[1]["optimizer"] == "adamw":
    print("\n" + comparison(*records))
  for r in records:
    print(f"{r['optimizer']}: compile {r['compile_s']:.1f}s, {r['tokens_per_s']:,.0f} tokens/s")
  print(f"total {result['total_time_s']:.1f}s; wrote {out / 'loss.png'} and {out / 'run.json'}")
  return result


if __name__ == "__main__":
  main()
