"""Step time of the aux AdamW backends against optax.adamw.

128 float32 tensors of 16,384 elements (the many small leaves an AdamW branch holds:
biases, norms, embeddings of a mid-sized model), 30 warm-up steps, 200 timed steps. One
timed step is a jitted `update` + `apply_updates` with params and state donated, waited
on with `block_until_ready`; the arms take turns step by step. Prints the median step time per backend and its ratio to
`optax.adamw`, with the machine it ran on.

    python -m benchmarks.adam_backends [--tensors 128] [--size 16384] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import optax

import muon_optax as mo
from benchmarks.common import machine, time_steps


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tensors", type=int, default=128)
  ap.add_argument("--size", type=int, default=16_384)
  ap.add_argument("--warmup", type=int, default=30)
  ap.add_argument("--steps", type=int, default=200)
  args = ap.parse_args()

  keys = jax.random.split(jax.random.key(0), 2 * args.tensors)
  params = {f"t{i:03d}": jax.random.normal(keys[i], (args.size,)) for i in range(args.tensors)}
  grads = {f"t{i:03d}": jax.random.normal(keys[args.tensors + i], (args.size,))
           for i in range(args.tensors)}
  hp = dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)

  arms = {"optax.adamw": optax.adamw(**hp)}
  arms.update({f"mo.adamw({b!r})": mo.adamw(**hp, backend=b) for b in mo.BACKENDS})
  times, _ = time_steps(arms, params, grads, args.warmup, args.steps)
  medians = {name: statistics.median(t) for name, t in times.items()}

  base = medians["optax.adamw"]
  print(f"machine: {machine()}")
  print(f"{args.tensors} tensors × {args.size:,} float32, {args.warmup} warm-up + "
        f"{args.steps} timed steps\n")
  print(f"| {'Backend':<22} | Median step (ms) | vs optax.adamw |")
  print(f"|{'-' * 24}|-----------------:|---------------:|")
  for name, t in medians.items():
    print(f"| {name:<22} | {t * 1e3:16.3f} | {t / base:13.2f}× |")


if __name__ == "__main__":
  main()
