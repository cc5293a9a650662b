"""Newton–Schulz throughput and accuracy on GPT-2-small matrix shapes.

For every shape: {turbo (AOL, 4 steps), jordan, polar_express} × {standard, gram} ×
{float32, bfloat16 compute} of `muon_optax.newton_schulz`, and optax.contrib.muon's orthogonalization
(`orthogonalize_via_newton_schulz`, float32, with the jordan coefficients and with our
5-row polar_express table). Columns:

- GFLOP: matmul flops of one call (`newton_schulz_flops`; optax runs the standard count).
- ms: median wall time of a jitted call on a Gaussian input, waited on.
- GFLOP/s: flops / median time. % peak: against the fastest of the 2048³ float32
  matmuls timed in the same rounds (a peak is a best case; the arms get their median).
  The arms of a shape take turns call by call, so load on a shared machine hits all alike.
- orth err: ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F with U Σ Vᵀ the float64 SVD of the input.
- σ band: smallest and largest singular value of O (from eigvalsh(O Oᵀ) in float64).

    python -m benchmarks.newton_schulz [--reps 5] [--scale 1.0] [--shapes 768x768,...]

The stacked group is the 12 attention projections of GPT-2 small (12×768×768), one
batched call. --scale 0.5 halves every matrix dimension for a quick run.
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
from muon_optax._ns_plan import newton_schulz_flops
from benchmarks.common import machine
from muon_optax._ns_plan import coefficient_schedule

# optax 0.2.8 keeps its orthogonalization in optax.contrib._muon (not re-exported).
optax_orthogonalize = getattr(optax.contrib, "orthogonalize_via_newton_schulz", None) \
    or optax.contrib._muon.orthogonalize_via_newton_schulz

STEPS = 5
PEAK_N = 2048


def arms(shape):
  """name -> (jitted fn of x, flops of one call)."""
  *batch, m, n = shape
  count = int(np.prod(batch))
  out = {}
  for ns in ("turbo", "jordan", "polar_express"):
    steps = STEPS if ns != "turbo" else mo.PRESETS[ns].steps
    for gram in (False, True):
      for dtype in ("float32", "bfloat16"):
        fn = functools.partial(mo.newton_schulz, ns=ns, steps=steps, gram=gram,
                               compute_dtype=dtype)
        name = f"muon_optax {ns} ({steps} steps) {'gram' if gram else 'standard'} {dtype}"
        out[name] = (jax.jit(fn), count * newton_schulz_flops(
            m, n, steps, gram=gram, compute_dtype=dtype))
  dims = None if not batch else optax.contrib.MuonDimensionNumbers(
      reduction_axis=len(batch), output_axis=len(batch) + 1)
  for ns, coeffs in (("jordan", jnp.asarray(mo.PRESETS["jordan"][0][0])),
                     ("polar_express", jnp.asarray(coefficient_schedule("polar_express", STEPS)[0]))):
    fn = functools.partial(optax_orthogonalize, ns_coeffs=coeffs, ns_steps=STEPS,
                           dimension_numbers=dims)
    out[f"optax.contrib {ns} standard float32"] = (
        jax.jit(fn), count * newton_schulz_flops(m, n, STEPS, gram=False))
  return out


def time_round_robin(fns: dict, x, reps: int) -> dict[str, list[float]]:
  """Seconds per call of each fn, calls interleaved across fns."""
  for fn in fns.values():
    jax.block_until_ready(fn(x))  # compile and warm up
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[name].append(time.perf_counter() - t0)
  return times


def accuracy(out, x):
  """(‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F, σ_min(O), σ_max(O)) over every matrix of the stack."""
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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--scale", type=float, default=1.0, help="multiply every matrix dimension")
  ap.add_argument("--shapes", default="768x768,768x2304,768x3072,3072x768,12x768x768",
                  help="comma-separated; a leading third number is a stack of that many")
  args = ap.parse_args()

  d = lambda k: max(1, int(round(k * args.scale)))
  shapes = []
  for spec in args.shapes.split(","):
    *batch, m, n = map(int, spec.lower().split("x"))
    shapes.append((*batch, d(m), d(n)))
  peak_x = jax.random.normal(jax.random.key(1), (PEAK_N, PEAK_N))
  peak_fn = jax.jit(lambda a: jnp.matmul(a, a, precision="highest"))

  print(f"machine: {machine()}")
  print(f"{STEPS} steps, Gaussian input, median of {args.reps} calls per arm; peak = "
        f"fastest {PEAK_N}³ float32 matmul of the same rounds\n")
  header = ("| shape | method | GFLOP | ms | GFLOP/s | % peak | orth err | σ band |\n"
            "|---|---|--:|--:|--:|--:|--:|---|")
  print(header)
  for shape in shapes:
    x = jax.random.normal(jax.random.key(0), shape)
    fns = arms(shape)
    times = time_round_robin({"peak": lambda _: peak_fn(peak_x),
                              **{k: f for k, (f, _) in fns.items()}}, x, args.reps)
    peak = 2 * PEAK_N**3 / min(times.pop("peak")) / 1e9
    medians = {name: statistics.median(t) for name, t in times.items()}
    label = "×".join(map(str, shape))
    for name, (fn, flops) in fns.items():
      t = medians[name]
      err, lo, hi = accuracy(fn(x), x)
      rate = flops / t / 1e9
      print(f"| {label} | {name} | {flops / 1e9:.2f} | {t * 1e3:.1f} | {rate:.1f} | "
            f"{100 * rate / peak:.0f}% | {err:.3f} | [{lo:.3f}, {hi:.3f}] |", flush=True)
    print(f"| {label} | float32 matmul peak (fastest) | | | {peak:.1f} | 100% | | |", flush=True)


if __name__ == "__main__":
  main()
