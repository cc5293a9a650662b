"""End to end: the same GPT trained with Muon and every aux AdamW backend gives the same losses.

Every arm starts from the same init (fixed seed) and sees the same batch of standard
library source bytes at every step, so any difference in the loss comes from the
optimizer. The arms: the aux AdamW as "reference", "optax" and "offload", and
"offload" with the Muon momentum in host memory too. Prints

    Configuration | Backend | First loss | Final loss | Max diff vs reference

with the machine it ran on, and writes the loss curves (and their differences from the
reference) as a PNG.

    python -m benchmarks.e2e_loss                   # 0.87M params, ~5 minutes on 2 CPU cores
    python -m benchmarks.e2e_loss --preset 124m     # GPT-2 small's shape, 124M params
    python -m benchmarks.e2e_loss --preset 400m     # 1024 wide, 7 layers, 152k vocab: 400M
    python -m benchmarks.e2e_loss --preset tiny --steps 3 --data-root DIR --out PATH
                                                    # smallest: every arm trains
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import muon_optax as mo
from benchmarks.common import commit, header
from workload.gpt import GPT, GPTConfig, loss_fn, num_params
from workload.stdlib_text import batches, load_splits

# Model shapes and batch sizes (batch, sequence length) of each preset.
PRESETS = {
    "tiny": (GPTConfig(vocab_size=256, seq_len=16, d_model=32, layers=1, heads=2), 4),
    "small": (GPTConfig(vocab_size=256, seq_len=64, d_model=128, layers=4, heads=4), 16),
    # GPT-2 small's shape: 768 wide, 12 layers, 50k vocabulary tied with the LM head.
    "124m": (GPTConfig(vocab_size=50_257, seq_len=256, d_model=768, layers=12, heads=12,
                       tie_embeddings=True), 8),
    # 1024 wide, 7 layers, a 152k vocabulary with an untied LM head: 311M of the 400M
    # parameters are embedding and head, i.e. on AdamW.
    "400m": (GPTConfig(vocab_size=151_936, seq_len=256, d_model=1024, layers=7, heads=16), 8),
}

# (configuration, aux AdamW backend, Muon momentum offloaded); the first is the reference.
ARMS = [
    ("Muon + AdamW", "reference", False),
    ("Muon + AdamW", "optax", False),
    ("Muon + AdamW", "offload", False),
    ("Muon + AdamW, Muon momentum offloaded", "offload", True),
]


def make_optimizer(backend: str, offload_momentum: bool, steps: int) -> optax.GradientTransformation:
  """Muon with schedules, weight decay and a decay mask on both branches."""
  schedule = lambda peak: optax.warmup_cosine_decay_schedule(0.0, peak, steps // 10, steps, 0.1 * peak)
  # AdamW decays the embeddings and the LM head, not norms and biases.
  decay = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adam = mo.AuxAdam(schedule(3e-3), b1=0.9, b2=0.95, weight_decay=0.01, mask=decay,
                    backend=backend)
  return mo.muon(schedule(0.02), weight_decay=0.01, adam=adam, offload_momentum=offload_momentum)


def train(cfg: GPTConfig, backend: str, offload_momentum: bool, data: list, seed: int) -> np.ndarray:
  """Losses of `len(data)` steps from the init of `seed`."""
  graphdef, params, rest = nnx.split(GPT(cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)
  tx = make_optimizer(backend, offload_momentum, len(data))
  params = commit(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = commit(tx.init(params)), []
  for batch in data:
    params, state, loss = step(params, state, batch)
    losses.append(loss)
  return np.array(jax.device_get(losses), np.float64)


def plot(curves: dict, path: pathlib.Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  ref = next(iter(curves.values()))
  for (config, backend, _), losses in curves.items():
    label = f"{backend} ({config})"
    top.plot(losses, label=label, lw=1)
    bottom.plot(np.abs(losses - ref) + 1e-12, label=label, lw=1)
  top.set_ylabel("training loss (nats)")
  top.legend(fontsize=8)
  top.set_title(title, fontsize=9)
  bottom.set_yscale("log")
  bottom.set_ylabel("|loss − reference| (+1e-12)")
  bottom.set_xlabel("step")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--batch", type=int, help="override the preset's batch size")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--data-root", default=None,
                  help="a directory of .py files (default: this Python's standard library)")
  ap.add_argument("--out", default="runs/e2e_loss/loss_curves.png")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> dict[tuple, np.ndarray]:
  """Runs the benchmark; returns the losses of each arm."""
  args = parser().parse_args(argv)
  cfg, batch = PRESETS[args.preset]
  batch = args.batch or batch
  train_split, _ = load_splits(args.data_root, max_bytes=4_000_000)
  it = batches(train_split.data, batch, cfg.seq_len, args.seed)
  data = [jnp.asarray(next(it)) for _ in range(args.steps)]
  n = num_params(GPT(cfg, rngs=nnx.Rngs(args.seed)))
  title = (f"{args.preset}: {n:,} params ({cfg.d_model} wide, {cfg.layers} layers, vocab "
           f"{cfg.vocab_size:,}), batch {batch}×{cfg.seq_len}, {args.steps} steps")
  print(f"{header('benchmarks.e2e_loss', argv)}\n{title}\n")

  curves = {}
  for config, backend, offload_momentum in ARMS:
    t0 = time.perf_counter()
    curves[config, backend, offload_momentum] = train(cfg, backend, offload_momentum, data, args.seed)
    print(f"  {backend:<9} ({config}): {time.perf_counter() - t0:6.1f} s", flush=True)

  ref = next(iter(curves.values()))
  width = max(len(c) for c, _, _ in ARMS)
  print(f"\n| {'Configuration':<{width}} | Backend   | First loss | Final loss | Max diff vs reference |")
  print(f"|{'-' * (width + 2)}|-----------|-----------:|-----------:|----------------------:|")
  for (config, backend, _), losses in curves.items():
    print(f"| {config:<{width}} | {backend:<9} | {losses[0]:10.5f} | {losses[-1]:10.5f} | "
          f"{np.max(np.abs(losses - ref)):21.2e} |")
  plot(curves, pathlib.Path(args.out), title)
  print(f"\nloss curves: {args.out}")
  return curves


if __name__ == "__main__":
  main()
