"""One command for whatever device jax sees: the Newton–Schulz table and the full-update
time against optax.contrib.muon.

1. Newton–Schulz table. For each shape and arm (muon_optax's turbo and jordan presets,
   standard and Gram-space, float32, bfloat16 and float16 operands (float16: the GPU
   candidate default); optax.contrib.muon's jordan iteration, 5 steps), on a Gaussian
   input:
   - min and median ms of N jitted calls, each waited on, the arms taking turns call by
     call (`common.time_interleaved`);
   - TFLOP/s: matmul flops (`newton_schulz_flops`) / min time;
   - % peak: against the fastest square matmul of the same operand dtype, at the
     precision the defaults use on this device, timed here (best case against best case);
   - polar err: ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F, U Σ Vᵀ the float64 SVD of the input.
2. Full update. One jitted update + apply_updates of every arm of
   `benchmarks/optimizer_step.py` (`common.optimizer_arms`: the muon_optax family,
   optax.contrib.muon, optax.adamw; routing made equal) on the GPT-2-small tree: min and
   median step time and their ratios to optax.contrib.muon.
Each part ends with the load on the machine while it ran, and whether it was busy.

    python -m benchmarks.accelerator            # full run (one GPU: well under 3 min)
    python -m benchmarks.accelerator --quick    # CPU: quarter-size shapes, 2 layers
    python -m benchmarks.accelerator --shapes 2x16x48 --layers 1 --d 32 --vocab 64 --reps 2 \
        --peak-n 64                             # smallest: every arm runs
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
from benchmarks.common import (
  JORDAN5_STANDARD,
  VOCAB,
  D,
  LoadWatch,
  gpt2_tree,
  header,
  kernels,
  min_median,
  newton_schulz_flops,
  optax_orthogonalize,
  optimizer_arms,
  parse_shapes,
  polar_error,
  polar_factor,
  random_like,
  ratio_table,
  time_interleaved,
  time_steps,
)

FULL_SHAPES = "768x768,768x2304,768x3072,3072x768,12x768x768"
QUICK_SHAPES = "192x192,192x576,192x768,768x192,12x192x192"


# bfloat16: the GPU and TPU default operands ("auto"), float32 the CPU's; float16 the GPU
# candidate (it lets Gram space run: benchmarks/results/newton_schulz_precision.txt).
OPERAND_DTYPES = ("float32", "bfloat16", "float16")


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="quarter-size shapes, 2 layers")
  ap.add_argument("--shapes", default=None, help="comma-separated, e.g. 768x3072,12x768x768")
  ap.add_argument("--layers", type=int, default=None, help="default 12 (--quick: 2)")
  ap.add_argument("--d", type=int, default=D, help="width of the GPT-2-small tree")
  ap.add_argument("--vocab", type=int, default=VOCAB)
  ap.add_argument("--reps", type=int, default=None, help="timed calls per arm (default 10, "
                  "--quick: 3)")
  ap.add_argument("--peak-n", type=int, default=None, help="side of the peak matmul "
                  "(default 4096, --quick: 1024)")
  return ap


def matmul_peaks(n: int, reps: int) -> dict[str, float]:
  """Fastest n×n matmul in flop/s, per operand dtype, at the precision the defaults use."""
  precision = mo.NewtonSchulz().matmul_precision()
  mm = jax.jit(lambda a: jnp.matmul(a, a, precision=precision,
                                    preferred_element_type=jnp.float32))
  operands = {dtype: jax.random.normal(jax.random.key(1), (n, n)).astype(dtype)
              for dtype in OPERAND_DTYPES}
  times = time_interleaved({dtype: (lambda a=a: mm(a)) for dtype, a in operands.items()},
                           max(reps, 3))
  return {dtype: 2 * n**3 / min(t) for dtype, t in times.items()}


def ns_arms(shape) -> dict[str, tuple]:
  """name -> (jitted fn, flops of one call, operand dtype)."""
  *batch, m, n = shape
  count = int(np.prod(batch))
  out = {}
  for preset in ("turbo", "jordan"):
    for gram in (False, True):
      for dtype in OPERAND_DTYPES:
        ns = mo.NewtonSchulz(preset, gram=gram, compute_dtype=dtype)
        out[f"muon_optax {preset} {'gram' if gram else 'standard'} {dtype}"] = (
            jax.jit(lambda x, ns=ns: mo.newton_schulz(x, ns)),
            count * newton_schulz_flops(m, n, ns), dtype)
  jordan = mo.PRESETS["jordan"].table[0]
  out["optax.contrib jordan standard float32"] = (
      jax.jit(lambda x: optax_orthogonalize(x, jordan, 5)),
      count * newton_schulz_flops(m, n, JORDAN5_STANDARD), "float32")
  return out


def ns_table(shapes, peaks: dict[str, float], reps: int) -> None:
  print(f"| shape | arm | GFLOP | min ms | median ms (N={reps}) | TFLOP/s | % peak | "
        "polar err |\n|---|---|--:|--:|--:|--:|--:|--:|")
  with LoadWatch() as load:
    for shape in shapes:
      x = jax.random.normal(jax.random.key(0), shape)
      polar = polar_factor(x)
      fns = ns_arms(shape)
      times = time_interleaved({k: (lambda f=f: f(x)) for k, (f, _, _) in fns.items()}, reps)
      label = "×".join(map(str, shape))
      for name, (fn, flops, dtype) in fns.items():
        lo, med = min_median(times[name])
        rate = flops / lo
        print(f"| {label} | {name} | {flops / 1e9:.2f} | {lo * 1e3:.2f} | {med * 1e3:.2f} | "
              f"{rate / 1e12:.3f} | {100 * rate / peaks[dtype]:.0f}% | "
              f"{polar_error(fn(x), polar):.4f} |", flush=True)
  print(f"\n{load.note()}")


def full_update(args, layers: int, reps: int) -> dict[str, list[float]]:
  params = gpt2_tree(layers, jax.random.key(0), d=args.d, vocab=args.vocab)
  grads = random_like(params, jax.random.key(1), 1e-3)
  plans = {x.shape: mo.newton_schulz_plan(x.shape) for x in kernels(params).values()}
  print(f"\nGPT-2-small tree, {layers} layers (width {args.d}); the defaults run, per kernel "
        "shape:\n" + "\n".join(f"  {s[0]}×{s[1]}: {p}" for s, p in plans.items()))
  with LoadWatch() as load:
    times, _ = time_steps(optimizer_arms(params), params, grads, 1, reps)
  print(f"{load.note()}\n\n{ratio_table(times, 'optax.contrib.muon')}")
  return times


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  shapes = parse_shapes(args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES))
  layers = args.layers or (2 if args.quick else 12)
  reps = args.reps or (3 if args.quick else 10)
  t0 = time.perf_counter()
  print(header("benchmarks.accelerator", argv))
  peaks = matmul_peaks(args.peak_n or (1024 if args.quick else 4096), reps)
  print("measured matmul peak (TFLOP/s, precision "
        f"{mo.NewtonSchulz().matmul_precision().name}): " +
        ", ".join(f"{k} {v / 1e12:.3f}" for k, v in peaks.items()) + "\n")
  ns_table(shapes, peaks, reps)
  full_update(args, layers, reps)
  print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
