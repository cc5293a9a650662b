"""How long `infer_routing` takes on a GPT-2-small-sized (124M parameter) model, on CPU.

The model is built abstractly (`nnx.eval_shape`), so nothing is allocated: the time
is tracing `model(tokens)` to a jaxpr and reading it. Prints one line per variant.
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import muon_optax as mo  # noqa: E402
from _machine import machine  # noqa: E402  (benchmarks/ is on sys.path)
from gpt import GPT, GPTConfig  # noqa: E402


def main(repeats: int = 3) -> None:
  print(f"machine: {machine()}")
  for tied in (False, True):
    cfg = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, layers=12, heads=12,
                    tie_embeddings=tied)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      routing = mo.infer_routing(model, tokens)
      times.append(time.perf_counter() - start)
    labels = [d.label for _, d in routing.decisions.values()]
    print(f"GPT-2 small ({n / 1e6:.1f}M params, tied={tied}): infer_routing best "
          f"{min(times):.3f} s, first {times[0]:.3f} s over {repeats} runs; "
          f"{labels.count('muon')} muon / {labels.count('adam')} adam leaves")


if __name__ == "__main__":
  main()
