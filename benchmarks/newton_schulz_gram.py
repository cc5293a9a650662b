"""Gram-space Newton–Schulz: how many restarts, and from which aspect ratio it pays.

Part 1, restarts: the standard iteration, the Gram-space one with the restarts
`newton_schulz_plan` picks ("auto"), and with forced restart sets (none), (2,) and
(2, 4) (0-based steps before which X and R = X Xᵀ are rebuilt), on Gaussian inputs and
inputs with singular values log-spaced from 1 to 1e-6, for jordan and polar_express at
5 steps and turbo (AOL scaling) at its 4; prints
- f64 err: ‖NS(G) − p(G)‖_F / ‖p(G)‖_F with p the same polynomial in float64;
- bound: steps · eps32 · ∏|a_k|, the a priori error of a float32 evaluation;
- polar ratio: ‖NS(G) − U Vᵀ‖_F / ‖U Vᵀ‖_F over that of the standard float32 iteration
  (the accuracy criterion asks ≤ 1.05), and σ max.
Part 2, crossover: for m×n at several aspects, with a preset's own settings, the
compiled flops (XLA cost_analysis, deterministic) and the min and median wall time of
N calls of Gram over standard, the two taking turns call by call; then the load on the
machine while they ran, and whether it was busy.

    python -m benchmarks.newton_schulz_gram [--shapes 64x256,768x3072] [--m 512] [--reps 5]
    python -m benchmarks.newton_schulz_gram --shapes 16x48 --dtypes float32 --m 16 \
        --aspects 3 --reps 2                    # smallest: every arm runs
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from typing import Optional
from unittest import mock

import jax
import numpy as np

import muon_optax as mo
import muon_optax._newton_schulz.variant as ns_plan
from benchmarks.common import (
  LoadWatch,
  cost_analysis,
  header,
  min_median,
  parse_shapes,
  polar_factor,
  time_interleaved,
  with_spectrum,
)

STEPS = {"jordan": 5, "polar_express": 5, "turbo": 4}
FORCED = [(), (2,), (2, 4)]


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="64x256,256x64,768x3072")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--m", type=int, default=512, help="short side of the crossover shapes")
  ap.add_argument("--aspects", default="1,1.5,2,2.5,3,4")
  ap.add_argument("--preset", default="turbo", choices=sorted(mo.PRESETS),
                  help="settings of the crossover (with its own steps)")
  ap.add_argument("--reps", type=int, default=5, help="timed calls per arm (N)")
  ap.add_argument("--skip-restarts", action="store_true")
  return ap


def reference(x, ns: mo.NewtonSchulz) -> np.ndarray:
  """The same polynomial, with the same scaling (Frobenius or AOL), in float64."""
  x = np.asarray(x, np.float64)
  x = x.T if x.shape[0] > x.shape[1] else x
  if ns.preconditioner() == "aol":
    x = x / np.sqrt(np.abs(x @ x.T).sum(-1, keepdims=True))
  else:
    x = x / (np.linalg.norm(x) * ns.safety())
  for a, b, c in ns.coefficients():
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x


def rel(a, b) -> float:
  a = np.asarray(a, np.float64)
  a = a.T if a.shape != b.shape else a
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def restarts(forced: Optional[tuple[int, ...]]):
  """Within it, the Gram-space iteration restarts before the `forced` steps (None: where
  `newton_schulz_plan` says). Traced programs keep what they were traced with."""
  if forced is None:
    return contextlib.nullcontext()
  return mock.patch.object(ns_plan, "gram_restarts", lambda *_: forced)


def run_arm(x, ns: mo.NewtonSchulz, forced) -> np.ndarray:
  with restarts(forced):
    return np.asarray(jax.jit(lambda x: mo.newton_schulz(x, ns))(x), np.float64)


def restarts_table(shapes, dtypes) -> None:
  print("| shape | input | preset | dtype | iteration | f64 err | bound | polar ratio | σ max |")
  print("|---|---|---|---|---|--:|--:|--:|--:|")
  for shape in shapes:
    for name, x in (("gaussian", jax.random.normal(jax.random.key(0), shape)),
                    ("σ to 1e-6", with_spectrum(shape, 1e-6, 0))):
      polar = polar_factor(x)
      for preset, steps in STEPS.items():
        standard = mo.NewtonSchulz(preset, steps=steps, gram=False, compute_dtype="float32")
        exact = reference(x, standard)
        bound = steps * np.finfo(np.float32).eps * np.prod(np.abs(standard.coefficients()[:, 0]))
        base = rel(mo.newton_schulz(x, standard), polar)
        for dtype in dtypes:
          arms = {"standard": (False, None), "gram (auto)": (True, None),
                  **{f"gram {r}": (True, r) for r in FORCED}}
          for label, (gram, forced) in arms.items():
            ns = mo.NewtonSchulz(preset, steps=steps, gram=gram, compute_dtype=dtype)
            out = run_arm(x, ns, forced)
            if label == "gram (auto)":
              label += f" {tuple(s for s, _ in mo.newton_schulz_plan(shape, ns).segments[1:])}"
            smax = np.linalg.svd(out, compute_uv=False).max()
            print(f"| {'×'.join(map(str, shape))} | {name} | {preset} | {dtype} | {label} | "
                  f"{rel(out, exact):.1e} | {bound:.1e} | {rel(out, polar) / base:.4f} | "
                  f"{smax:.3f} |", flush=True)


def compiled_flops(fn, x) -> float:
  return cost_analysis(jax.jit(fn).lower(x).compile())["flops"]


def crossover_table(m: int, aspects, preset: str, reps: int) -> None:
  settings = {g: mo.NewtonSchulz(preset, gram=g) for g in (False, True)}
  print(f"\n{preset} ({settings[False].num_steps()} steps), gram over standard; min and "
        f"median of {reps} interleaved calls each\n")
  print("| shape | aspect | flops (XLA) | time (min) | time (median) |\n|---|--:|--:|--:|--:|")
  with LoadWatch() as load:
    for aspect in aspects:
      x = jax.random.normal(jax.random.key(0), (m, int(round(m * aspect))))
      fns = {g: (lambda x, ns=ns: mo.newton_schulz(x, ns)) for g, ns in settings.items()}
      flops = {g: compiled_flops(fn, x) for g, fn in fns.items()}
      jitted = {g: jax.jit(fn) for g, fn in fns.items()}
      times = time_interleaved({g: (lambda f=f: f(x)) for g, f in jitted.items()}, reps)
      (gram_min, gram_med), (std_min, std_med) = min_median(times[True]), min_median(times[False])
      print(f"| {x.shape[0]}×{x.shape[1]} | {aspect:g} | {flops[True] / flops[False]:.3f} | "
            f"{gram_min / std_min:.3f} | {gram_med / std_med:.3f} |", flush=True)
  print(f"\n{load.note()}")


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  print(header("benchmarks.newton_schulz_gram", argv) + "\n")
  if not args.skip_restarts:
    restarts_table(parse_shapes(args.shapes), args.dtypes.split(","))
  crossover_table(args.m, [float(a) for a in args.aspects.split(",")], args.preset, args.reps)


if __name__ == "__main__":
  main()
