"""One command for whatever device jax sees: the Newton–Schulz table and the full-update
time against optax.contrib.muon.

1. Newton–Schulz table. For each shape and arm (muon_optax's default preset and jordan,
   standard and Gram-space, float32 and bfloat16 operands; optax.contrib.muon's
   jordan iteration), on a Gaussian input:
   - ms: median wall time of a jitted call, waited on, arms interleaved;
   - TFLOP/s: matmul flops (`newton_schulz_flops`) / median time;
   - % peak: against the fastest square matmul of the same operand dtype (and the
     precision "auto" gives on this device) timed here;
   - polar err: ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F, U Σ Vᵀ the float64 SVD of the input.
2. Full update. One jitted update + apply_updates of muon_optax.muon with defaults and
   with jordan/5 steps against optax.contrib.muon (jordan, 5 steps), routing made
   equal, on the GPT-2-small tree of `optimizer_step.py`; median step time and ratio.

    python -m benchmarks.accelerator            # full run (one GPU: well under 3 min)
    python -m benchmarks.accelerator --quick    # CPU: quarter-size shapes, 2 layers
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

import muon_optax as mo
from _machine import machine
from muon_optax._ns_plan import DEFAULT_NS, newton_schulz_flops, newton_schulz_plan, resolve_precision
from newton_schulz import optax_orthogonalize
from optimizer_step import KERNELS, arms as step_arms, gpt2_params, make_step

JORDAN = jnp.asarray(mo.PRESETS["jordan"].table[0])


def timed(fns: dict, args, reps: int) -> dict[str, float]:
  """Median seconds per call of each fn, calls interleaved across fns."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def matmul_peaks(n: int, reps: int) -> dict[str, float]:
  """Fastest n×n matmul in flop/s, per operand dtype, at the precision "auto" picks."""
  precision = resolve_precision("auto")
  peaks = {}
  for dtype in ("float32", "bfloat16"):
    a = jax.random.normal(jax.random.key(1), (n, n)).astype(dtype)
    fn = jax.jit(lambda a: jnp.matmul(a, a, precision=precision,
                                      preferred_element_type=jnp.float32))
    jax.block_until_ready(fn(a))
    best = min(_once(fn, a) for _ in range(max(reps, 3)))
    peaks[dtype] = 2 * n**3 / best
  return peaks


def _once(fn, a) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(a))
  return time.perf_counter() - t0


def ns_arms(shape):
  """name -> (fn, flops, operand dtype)."""
  *batch, m, n = shape
  count = int(np.prod(batch)) if batch else 1
  out = {}
  for ns in (DEFAULT_NS, "jordan"):
    steps = newton_schulz_plan(shape, ns=ns).steps
    for gram in (False, True):
      for dtype in ("float32", "bfloat16"):
        fn = functools.partial(mo.newton_schulz, ns=ns, gram=gram, compute_dtype=dtype)
        flops = count * newton_schulz_flops(m, n, steps, gram=gram, compute_dtype=dtype)
        out[f"muon_optax {ns} {'gram' if gram else 'standard'} {dtype}"] = (
            jax.jit(fn), flops, dtype)
  dims = None if not batch else optax.contrib.MuonDimensionNumbers(
      reduction_axis=len(batch), output_axis=len(batch) + 1)
  fn = functools.partial(optax_orthogonalize, ns_coeffs=JORDAN, ns_steps=5,
                         dimension_numbers=dims)
  out["optax.contrib jordan standard float32"] = (
      jax.jit(fn), count * newton_schulz_flops(m, n, 5, gram=False), "float32")
  return out


def polar_error(out, polar) -> float:
  o = np.asarray(out, np.float64).reshape(polar.shape)
  return float(np.linalg.norm(o - polar) / np.linalg.norm(polar))


def ns_table(shapes, peaks, reps: int) -> None:
  print("| shape | arm | GFLOP | ms | TFLOP/s | % peak | polar err |")
  print("|---|---|--:|--:|--:|--:|--:|")
  for shape in shapes:
    x = jax.random.normal(jax.random.key(0), shape)
    g = np.asarray(x, np.float64).reshape(-1, *shape[-2:])
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    polar = u @ vt
    fns = ns_arms(shape)
    medians = timed({k: f for k, (f, _, _) in fns.items()}, (x,), reps)
    label = "×".join(map(str, shape))
    for name, (fn, flops, dtype) in fns.items():
      t = medians[name]
      rate = flops / t
      print(f"| {label} | {name} | {flops / 1e9:.1f} | {t * 1e3:.2f} | {rate / 1e12:.3f} | "
            f"{100 * rate / peaks[dtype]:.0f}% | {polar_error(fn(x), polar):.4f} |", flush=True)


def full_update(layers: int, reps: int) -> None:
  params = gpt2_params(layers, jax.random.key(0))
  leaves, treedef = jax.tree.flatten(params)
  grads = treedef.unflatten([1e-3 * jax.random.normal(k, p.shape) for k, p in
                             zip(jax.random.split(jax.random.key(1), len(leaves)), leaves)])
  txs = step_arms(params)
  txs = {"muon_optax.muon (defaults)": mo.muon(0.02, adam=mo.AuxAdam(learning_rate=3e-4)),
         "muon_optax.muon jordan 5 steps": txs["muon_optax.muon"],
         "optax.contrib.muon": txs["optax.contrib.muon"]}
  runs = {name: make_step(tx, params) for name, tx in txs.items()}
  for step, carry in runs.values():
    carry[:] = step(*carry, grads)
  jax.block_until_ready([c for _, c in runs.values()])
  times = {name: [] for name in runs}
  for _ in range(reps):
    for name, (step, carry) in runs.items():
      t0 = time.perf_counter()
      carry[:] = jax.block_until_ready(step(*carry, grads))
      times[name].append(time.perf_counter() - t0)
  medians = {name: statistics.median(t) for name, t in times.items()}
  plans = {s: newton_schulz_plan(s) for s in KERNELS.values()}
  print(f"\nGPT-2-small tree, {layers} layers; defaults run per kernel: " + "; ".join(
      f"{s[0]}×{s[1]}: {p}" for s, p in plans.items()))
  print("\n| optimizer | median step (ms) | vs optax.contrib.muon |\n|---|--:|--:|")
  for name, t in medians.items():
    print(f"| {name} | {t * 1e3:.1f} | {t / medians['optax.contrib.muon']:.2f}× |")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="quarter-size shapes, 2 layers")
  ap.add_argument("--shapes", default=None, help="comma-separated, e.g. 768x3072,12x768x768")
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--reps", type=int, default=None)
  args = ap.parse_args()
  spec = args.shapes or ("192x192,192x576,192x768,768x192,12x192x192" if args.quick else
                         "768x768,768x2304,768x3072,3072x768,12x768x768")
  shapes = [tuple(map(int, s.lower().split("x"))) for s in spec.split(",")]
  layers = args.layers or (2 if args.quick else 12)
  reps = args.reps or (3 if args.quick else 10)
  t0 = time.perf_counter()
  print(f"machine: {machine()}")
  peaks = matmul_peaks(1024 if args.quick else 4096, reps)
  print("measured matmul peak (TFLOP/s, precision 'auto' = "
        f"{resolve_precision('auto').name}): " +
        ", ".join(f"{k} {v / 1e12:.3f}" for k, v in peaks.items()) + "\n")
  ns_table(shapes, peaks, reps)
  full_update(layers, reps)
  print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
