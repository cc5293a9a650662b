"""Step time of the aux AdamW backends against optax.adamw.

128 float32 tensors of 16,384 elements (the many small leaves an AdamW branch holds:
biases, norms, embeddings of a mid-sized model), 30 warm-up steps, 200 timed steps. One
timed step is a jitted `update` + `apply_updates` with params and state donated, waited
on with `block_until_ready`; the arms take turns step by step (`common.time_steps`).
Each backend is `mo.AuxAdam(..., backend=b).transform()`, with the same hyperparameters
as `optax.adamw`. Prints the min and median step time per backend and their ratios to
`optax.adamw`, with the load on the machine while they ran and whether it was busy.

    python -m benchmarks.adam_backends [--tensors 128] [--size 16384] [--steps 200]
    python -m benchmarks.adam_backends --tensors 4 --size 64 --warmup 1 --steps 3  # smallest
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

import jax
import optax

import muon_optax as mo
from benchmarks.common import LoadWatch, commit, header, random_like, ratio_table, time_steps

REFERENCE = "optax.adamw"


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tensors", type=int, default=128)
  ap.add_argument("--size", type=int, default=16_384, help="elements per tensor")
  ap.add_argument("--warmup", type=int, default=30, help="untimed steps per arm")
  ap.add_argument("--steps", type=int, default=200, help="timed steps per arm (N)")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> dict[str, list[float]]:
  """Runs the benchmark; returns seconds per step by arm."""
  args = parser().parse_args(argv)
  shapes = {f"t{i:03d}": jax.ShapeDtypeStruct((args.size,), "float32")
            for i in range(args.tensors)}
  # Committed: next to the offload backend's host-memory state, uncommitted params would
  # make its step compile twice.
  params = commit(random_like(shapes, jax.random.key(0)))
  grads = commit(random_like(shapes, jax.random.key(1)))
  hp = dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)

  arms = {REFERENCE: optax.adamw(**hp)}
  arms.update({f"mo.AuxAdam(backend={b!r})": mo.AuxAdam(**hp, backend=b).transform()
               for b in mo.BACKENDS})
  with LoadWatch() as load:
    times, _ = time_steps(arms, params, grads, args.warmup, args.steps)

  print(header("benchmarks.adam_backends", argv))
  print(f"{args.tensors} tensors × {args.size:,} float32, {args.warmup} warm-up + "
        f"{args.steps} timed steps per arm, interleaved; {load.note()}\n")
  print(ratio_table(times, REFERENCE))
  return times


if __name__ == "__main__":
  main()
