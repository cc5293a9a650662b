"""Gram-space Newton–Schulz: how many restarts, and from which aspect ratio it pays.

Part 1, restarts: for restart sets (none), (2,) and (2, 4) (0-based steps before which
X and R = X Xᵀ are rebuilt), on Gaussian inputs and inputs with singular values
log-spaced from 1 to 1e-6, prints
- f64 err: ‖NS(G) − p(G)‖_F / ‖p(G)‖_F with p the same polynomial in float64;
- bound: steps · eps32 · ∏|a_k|, the a priori error of a float32 evaluation;
- polar ratio: ‖NS(G) − U Vᵀ‖_F / ‖U Vᵀ‖_F over that of the standard float32 iteration
  (the accuracy criterion asks ≤ 1.05), and σ max.
Part 2, crossover: for m×n at several aspects, the compiled flops (XLA cost_analysis,
deterministic) and the median wall time of Gram over standard, calls interleaved.

    python -m benchmarks.newton_schulz_gram [--shapes 64x256,768x3072] [--m 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
import muon_optax._ns_plan as ns_module
from _machine import machine

STEPS = 5


def with_spectrum(shape, low, seed):
  rng = np.random.default_rng(seed)
  m, n = shape
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return jnp.asarray((u * np.logspace(0, np.log10(low), k)) @ v.T, jnp.float32)


def reference(x, ns):
  coeffs, safety = ns_module.coefficient_schedule(ns, STEPS)
  x = np.asarray(x, np.float64)
  x = x.T if x.shape[0] > x.shape[1] else x
  x = x / (np.linalg.norm(x) * safety)
  for a, b, c in coeffs:
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x


def rel(a, b):
  a = np.asarray(a, np.float64)
  a = a.T if a.shape != b.shape else a
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def restarts_table(shapes, dtypes) -> None:
  print("| shape | input | preset | dtype | restarts | f64 err | bound | polar ratio | σ max |")
  print("|---|---|---|---|---|--:|--:|--:|--:|")
  choices = [(), (2,), (2, 4)]
  for shape in shapes:
    for name, x in (("gaussian", jax.random.normal(jax.random.key(0), shape)),
                    ("σ to 1e-6", with_spectrum(shape, 1e-6, 0))):
      u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
      polar = u @ vt
      for ns in ("jordan", "polar_express"):
        exact = reference(x, ns)
        coeffs, _ = ns_module.coefficient_schedule(ns, STEPS)
        bound = STEPS * np.finfo(np.float32).eps * np.prod(np.abs(coeffs[:, 0]))
        base = rel(mo.newton_schulz(x, ns=ns, steps=STEPS, gram=False), polar)
        for dtype in dtypes:
          for restarts in [None, *choices]:
            if restarts is not None:
              ns_module.GRAM_RESTARTS = restarts
            fn = jax.jit(lambda x: mo.newton_schulz(
                x, ns=ns, steps=STEPS, gram=restarts is not None, compute_dtype=dtype))
            out = np.asarray(fn(x), np.float64)
            smax = np.linalg.svd(out, compute_uv=False).max()
            label = "standard" if restarts is None else f"gram {restarts}"
            print(f"| {'×'.join(map(str, shape))} | {name} | {ns} | {dtype} | {label} | "
                  f"{rel(out, exact):.1e} | {bound:.1e} | {rel(out, polar) / base:.4f} | "
                  f"{smax:.3f} |", flush=True)
  ns_module.GRAM_RESTARTS = (2,)


def compiled_flops(fn, x) -> float:
  analysis = jax.jit(fn).lower(x).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return analysis["flops"]


def crossover_table(m: int, aspects, reps: int) -> None:
  print(f"\n| shape | aspect | flops gram/standard (XLA) | time gram/standard (median of {reps}) |")
  print("|---|--:|--:|--:|")
  for aspect in aspects:
    x = jax.random.normal(jax.random.key(0), (m, int(round(m * aspect))))
    fns = {g: jax.jit(lambda x, g=g: mo.newton_schulz(x, steps=STEPS, gram=g))
           for g in (False, True)}
    flops = {g: compiled_flops(lambda x, g=g: mo.newton_schulz(x, steps=STEPS, gram=g), x)
             for g in fns}
    times = {g: [] for g in fns}
    for fn in fns.values():
      jax.block_until_ready(fn(x))
    for _ in range(reps):
      for g, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times[g].append(time.perf_counter() - t0)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"| {x.shape[0]}×{x.shape[1]} | {aspect:g} | {flops[True] / flops[False]:.3f} | "
          f"{ratio:.3f} |", flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="64x256,256x64,768x3072")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--m", type=int, default=512)
  ap.add_argument("--aspects", default="1,1.5,2,2.5,3,4")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--skip-restarts", action="store_true")
  args = ap.parse_args()
  print(f"machine: {machine()}\n{STEPS} steps\n")
  if not args.skip_restarts:
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    restarts_table(shapes, args.dtypes.split(","))
  crossover_table(args.m, [float(a) for a in args.aspects.split(",")], args.reps)


if __name__ == "__main__":
  main()
