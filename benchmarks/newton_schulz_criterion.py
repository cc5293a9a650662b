"""The accuracy criterion, on the issue's inputs, for the default and the presets.

For each shape and input (Gaussian; singular values log-spaced from 1 to 1e-6), and
each arm, prints the polar error ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F (U Σ Vᵀ the float64 SVD),
its ratio to the standard float32 jordan iteration at 5 steps (what optax.contrib.muon
runs; the criterion asks ≤ 1.05) and to the same preset's standard float32 iteration,
and the output's singular-value range.

    python -m benchmarks.newton_schulz_criterion [--shapes 768x3072,3072x768,768x768]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import muon_optax as mo
from _machine import machine
from newton_schulz_gram import with_spectrum

ARMS = {
    "jordan 5 standard float32": dict(ns="jordan", gram=False, compute_dtype="float32"),
    "polar_express 5 standard float32": dict(ns="polar_express", gram=False,
                                             compute_dtype="float32"),
    "turbo 4 (AOL) standard float32": dict(ns="turbo", gram=False, compute_dtype="float32"),
    "turbo 4 (AOL) gram float32": dict(ns="turbo", gram=True, compute_dtype="float32"),
    "turbo 4 (AOL) standard bfloat16": dict(ns="turbo", gram=False, compute_dtype="bfloat16"),
    "jordan 5 standard bfloat16": dict(ns="jordan", gram=False, compute_dtype="bfloat16"),
}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="768x3072,3072x768,768x768")
  args = ap.parse_args()
  print(f"machine: {machine()}\n")
  print("| shape | input | arm | polar err | / jordan f32 | / same preset f32 | σ range |")
  print("|---|---|---|--:|--:|--:|---|")
  for spec in args.shapes.split(","):
    shape = tuple(map(int, spec.split("x")))
    for name, x in (("gaussian", jax.random.normal(jax.random.key(0), shape)),
                    ("σ to 1e-6", with_spectrum(shape, 1e-6, 0))):
      u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
      polar = u @ vt
      errs, ranges = {}, {}
      for arm, kw in ARMS.items():
        out = np.asarray(jax.jit(lambda x, kw=kw: mo.newton_schulz(x, **kw))(x), np.float64)
        errs[arm] = np.linalg.norm(out - polar) / np.linalg.norm(polar)
        s = np.linalg.svd(out, compute_uv=False)
        ranges[arm] = (s.min(), s.max())
      for arm in ARMS:
        same = next(a for a in ARMS if a.startswith(arm.split(" (")[0].split(" ")[0])
                    and a.endswith("standard float32"))
        print(f"| {spec} | {name} | {arm} | {errs[arm]:.4f} | "
              f"{errs[arm] / errs['jordan 5 standard float32']:.3f} | "
              f"{errs[arm] / errs[same]:.3f} | [{ranges[arm][0]:.3g}, {ranges[arm][1]:.3f}] |",
              flush=True)


if __name__ == "__main__":
  main()
