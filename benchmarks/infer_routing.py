"""How long `infer_routing` takes on a GPT-2-small-sized (124M parameter) model, on CPU.

The model is the workload's GPT (`workload.gpt`), built abstractly (`nnx.eval_shape`),
so nothing is allocated: the time is tracing `model(tokens)` to a jaxpr and reading
it. Prints one line per variant (untied and tied embeddings): the best and the first of
N runs, and how the leaves were routed.

    python -m benchmarks.infer_routing [--repeats 3]
    python -m benchmarks.infer_routing --layers 1 --d-model 32 --heads 2 --vocab 64 \
        --seq-len 16 --repeats 1                # smallest
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

import muon_optax as mo
from benchmarks.common import LoadWatch, header
from workload.gpt import GPT, GPTConfig


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--d-model", type=int, default=768)
  ap.add_argument("--heads", type=int, default=12)
  ap.add_argument("--vocab", type=int, default=50257)
  ap.add_argument("--seq-len", type=int, default=1024)
  return ap


def main(argv: Optional[Sequence[str]] = None) -> dict[bool, list[float]]:
  """Runs the benchmark; returns the seconds of each run, untied and tied."""
  args = parser().parse_args(argv)
  print(header("benchmarks.infer_routing", argv))
  times = {}
  with LoadWatch() as load:
    for tied in (False, True):
      times[tied] = time_variant(args, tied)
  print(load.note())
  return times


def time_variant(args, tied: bool) -> list[float]:
  """Seconds of each `infer_routing` run on the GPT of `args`; prints one line."""
  cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                  layers=args.layers, heads=args.heads, tie_embeddings=tied)
  model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    routing = mo.infer_routing(model, tokens)
    times.append(time.perf_counter() - start)
  labels = [d.label for _, d in routing.decisions.values()]
  print(f"GPT {args.layers}×{args.d_model} ({n / 1e6:.1f}M params, tied={tied}): "
        f"infer_routing best {min(times):.3f} s, first {times[0]:.3f} s over {args.repeats} "
        f"runs; {labels.count('muon')} muon / {labels.count('adam')} adam leaves")
  return times


if __name__ == "__main__":
  main()
