"""Newton–Schulz throughput and accuracy on GPT-2-small matrix shapes.

For every shape: {turbo (AOL, 4 steps), jordan (5 steps), polar_express (5 steps)} ×
{standard, gram} × {float32, bfloat16 compute} of `muon_optax.newton_schulz`, and
optax.contrib.muon's orthogonalization (float32, 5 steps, with the jordan coefficients
and with the polar_express table). Columns:

- GFLOP: matmul flops of one call (`newton_schulz_flops`; optax runs the standard count).
- min / median ms: of N jitted calls on a Gaussian input, each waited on. The arms of a
  shape, and the peak matmul, take turns call by call (`common.time_interleaved`), so a
  load change on a shared machine hits all alike.
- GFLOP/s: flops / min time. % peak: against the fastest float32 matmul (precision
  HIGHEST, side --peak-n) of the same rounds: best case against best case.
- orth err: ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F with U Σ Vᵀ the float64 SVD of the input.
- σ band: smallest and largest singular value of O (from eigvalsh(O Oᵀ) in float64).
The table ends with the load on the machine while it ran, and whether it was busy.

    python -m benchmarks.newton_schulz [--reps 5] [--scale 1.0] [--shapes 768x768,...]
    python -m benchmarks.newton_schulz --shapes 2x16x48 --reps 2 --peak-n 64

The stacked group is the 12 attention projections of GPT-2 small (12×768×768), one
batched call. --scale 0.5 halves every matrix dimension for a quick run; the second
line is the smallest run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
from benchmarks.common import (
  LoadWatch,
  header,
  min_median,
  newton_schulz_flops,
  optax_orthogonalize,
  parse_shapes,
  time_interleaved,
)

STEPS = 5  # of jordan, polar_express and optax's iteration; turbo runs its own 4


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=5, help="timed calls per arm (N)")
  ap.add_argument("--scale", type=float, default=1.0, help="multiply every matrix dimension")
  ap.add_argument("--shapes", default="768x768,768x2304,768x3072,3072x768,12x768x768",
                  help="comma-separated; a leading third number is a stack of that many")
  ap.add_argument("--peak-n", type=int, default=2048, help="side of the peak matmul")
  return ap


def arms(shape) -> dict[str, tuple]:
  """name -> (jitted fn of x, flops of one call)."""
  *batch, m, n = shape
  count = int(np.prod(batch))
  out = {}
  for preset in ("turbo", "jordan", "polar_express"):
    steps = mo.PRESETS[preset].steps if preset == "turbo" else STEPS
    for gram in (False, True):
      for dtype in ("float32", "bfloat16"):
        ns = mo.NewtonSchulz(preset, steps=steps, gram=gram, compute_dtype=dtype)
        name = f"muon_optax {preset} ({steps} steps) {'gram' if gram else 'standard'} {dtype}"
        out[name] = (jax.jit(lambda x, ns=ns: mo.newton_schulz(x, ns)),
                     count * newton_schulz_flops(m, n, ns))
  for preset in ("jordan", "polar_express"):
    ns = mo.NewtonSchulz(preset, steps=STEPS, gram=False, compute_dtype="float32")
    coeffs = ns.coefficients()
    out[f"optax.contrib {preset} standard float32"] = (
        jax.jit(lambda x, c=coeffs: optax_orthogonalize(x, c, STEPS)),
        count * newton_schulz_flops(m, n, ns))
  return out


def accuracy(out, x) -> tuple[float, float, float]:
  """(‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F, σ_min(O), σ_max(O)) over the matrices of the stack."""
  o = np.asarray(out, np.float64).reshape(-1, *x.shape[-2:])
  g = np.asarray(x, np.float64).reshape(-1, *x.shape[-2:])
  err_num = err_den = 0.0
  lo, hi = np.inf, 0.0
  for oi, gi in zip(o, g):
    u, _, vt = np.linalg.svd(gi, full_matrices=False)
    polar = u @ vt
    err_num += np.sum((oi - polar) ** 2)
    err_den += np.sum(polar ** 2)
    wide = oi if oi.shape[0] <= oi.shape[1] else oi.T
    s = np.sqrt(np.clip(np.linalg.eigvalsh(wide @ wide.T), 0, None))
    lo, hi = min(lo, s.min()), max(hi, s.max())
  return np.sqrt(err_num / err_den), lo, hi


def shape_rows(shape, reps: int, peak_x, peak_fn) -> None:
  """Times every arm on one shape (with the peak matmul in the same rounds); one row each."""
  x = jax.random.normal(jax.random.key(0), shape)
  fns = arms(shape)
  times = time_interleaved({"peak": lambda: peak_fn(peak_x),
                            **{k: (lambda f=f: f(x)) for k, (f, _) in fns.items()}}, reps)
  peak = 2 * peak_x.shape[0]**3 / min(times.pop("peak")) / 1e9
  label = "×".join(map(str, shape))
  for name, (fn, flops) in fns.items():
    lo, med = min_median(times[name])
    err, s_lo, s_hi = accuracy(fn(x), x)
    rate = flops / lo / 1e9
    print(f"| {label} | {name} | {flops / 1e9:.2f} | {lo * 1e3:.2f} | {med * 1e3:.2f} | "
          f"{rate:.1f} | {100 * rate / peak:.0f}% | {err:.3f} | [{s_lo:.3f}, {s_hi:.3f}] |",
          flush=True)
  print(f"| {label} | float32 matmul peak (fastest) | | | | {peak:.1f} | 100% | | |", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  shapes = parse_shapes(args.shapes, args.scale)
  peak_x = jax.random.normal(jax.random.key(1), (args.peak_n, args.peak_n))
  peak_fn = jax.jit(lambda a: jnp.matmul(a, a, precision="highest"))

  print(header("benchmarks.newton_schulz", argv))
  print(f"Gaussian input; min and median of {args.reps} interleaved calls per arm; peak = "
        f"fastest {args.peak_n}³ float32 matmul of the same rounds\n")
  print("| shape | method | GFLOP | min ms | median ms | GFLOP/s | % peak | orth err | σ band |\n"
        "|---|---|--:|--:|--:|--:|--:|--:|---|")
  with LoadWatch() as load:
    for shape in shapes:
      shape_rows(shape, args.reps, peak_x, peak_fn)
  print(f"\n{load.note()}")


if __name__ == "__main__":
  main()
