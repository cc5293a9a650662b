"""The accuracy criterion, on the issue's inputs, for the default and the presets.

For each shape and input (Gaussian; singular values log-spaced from 1 to 1e-6), and
each arm, prints the polar error ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F (U Σ Vᵀ the float64 SVD),
its ratio to the standard float32 jordan iteration at 5 steps (what optax.contrib.muon
runs; the criterion asks ≤ 1.05) and to the same preset's standard float32 iteration,
and the output's singular-value range. Deterministic: nothing is timed.

    python -m benchmarks.newton_schulz_criterion [--shapes 768x3072,3072x768,768x768]
    python -m benchmarks.newton_schulz_criterion --shapes 16x48   # smallest
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Optional

import jax
import numpy as np

import muon_optax as mo
from benchmarks.common import header, parse_shapes, polar_error, polar_factor, with_spectrum

ARMS = {
    "jordan 5 standard float32": mo.NewtonSchulz("jordan", steps=5, gram=False,
                                                 compute_dtype="float32"),
    "polar_express 5 standard float32": mo.NewtonSchulz("polar_express", steps=5, gram=False,
                                                        compute_dtype="float32"),
    "turbo 4 (AOL) standard float32": mo.NewtonSchulz("turbo", gram=False,
                                                      compute_dtype="float32"),
    "turbo 4 (AOL) gram float32": mo.NewtonSchulz("turbo", gram=True, compute_dtype="float32"),
    "turbo 4 (AOL) standard bfloat16": mo.NewtonSchulz("turbo", gram=False,
                                                       compute_dtype="bfloat16"),
    "jordan 5 standard bfloat16": mo.NewtonSchulz("jordan", steps=5, gram=False,
                                                  compute_dtype="bfloat16"),
}
BASELINE = "jordan 5 standard float32"


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="768x3072,3072x768,768x768")
  return ap


def rows(shape, name: str, x) -> list[str]:
  """One table row per arm for one input."""
  polar, outputs = polar_factor(x), {}

  def output(ns):  # each setting runs once
    if ns not in outputs:
      outputs[ns] = np.asarray(jax.jit(lambda x: mo.newton_schulz(x, ns))(x), np.float64)
    return outputs[ns]

  baseline = polar_error(output(ARMS[BASELINE]), polar)
  out = []
  for arm, ns in ARMS.items():
    err = polar_error(output(ns), polar)
    # The same preset and steps, standard iteration with float32 operands.
    same = polar_error(output(dataclasses.replace(ns, gram=False, compute_dtype="float32")),
                       polar)
    s = np.linalg.svd(output(ns), compute_uv=False)
    out.append(f"| {'×'.join(map(str, shape))} | {name} | {arm} | {err:.4f} | "
               f"{err / baseline:.3f} | {err / same:.3f} | [{s.min():.3g}, {s.max():.3f}] |")
  return out


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  print(header("benchmarks.newton_schulz_criterion", argv) + "\n")
  print("| shape | input | arm | polar err | / jordan f32 | / same preset f32 | σ range |")
  print("|---|---|---|--:|--:|--:|---|")
  for shape in parse_shapes(args.shapes):
    for name, x in (("gaussian", jax.random.normal(jax.random.key(0), shape)),
                    ("σ to 1e-6", with_spectrum(shape, 1e-6, 0))):
      print("\n".join(rows(shape, name, x)), flush=True)


if __name__ == "__main__":
  main()
