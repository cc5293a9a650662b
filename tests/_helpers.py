"""Helpers shared by the tests: the one tree comparison with explicit tolerances, and
the float64 references and error bounds that Newton–Schulz tolerances come from."""

import dataclasses
import math
import re

import jax
import numpy as np

from muon_optax._newton_schulz.settings import as_newton_schulz
from muon_optax._newton_schulz.variant import newton_schulz_plan


def assert_trees_close(actual, expected, *, rtol: float, atol: float) -> None:
  """Every leaf equal within explicit tolerances; structures must match exactly."""
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert a_def == e_def, f"tree structures differ:\n{a_def}\n{e_def}"
  for (path, a), e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol,
        err_msg=f"at {jax.tree_util.keystr(path)}")


def polar(x):
  """U Vᵀ of each matrix, from a float64 SVD."""
  u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  return u @ vt


def singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def rel(a, b):
  """Relative Frobenius distance of each matrix of a stack (a scalar for one matrix)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=(-2, -1)) / np.linalg.norm(b, axis=(-2, -1))


def float32_bound(ns="turbo"):
  """A priori relative error of one float32 evaluation of the polynomial.

  Every step rounds at relative size ~eps32, and the later steps amplify a perturbation
  of X by at most about their |a| each (the slope of σ ← aσ + bσ³ + cσ⁵ near 0, its
  steepest point), so steps · eps32 · ∏|a_k| bounds the relative Frobenius error of any
  float32 evaluation against float64 on any machine.
  """
  coeffs = np.asarray(as_newton_schulz(ns).coefficients())
  return len(coeffs) * np.finfo(np.float32).eps * float(np.prod(np.abs(coeffs[:, 0])))


def _scalar_map(coeffs, sigma):
  """σ after the steps in `coeffs`: σ ← aσ + bσ³ + cσ⁵ each."""
  for a, b, c in coeffs:
    sigma = a * sigma + b * sigma**3 + c * sigma**5
  return sigma


def _amplification(coeffs, sigma):
  """sup over σ, τ in `sigma` (an image of [0, 1]) of |q[σ², τ²]| τ, with q(σ²) = p(σ) / σ
  and p the scalar map of the steps in `coeffs`: how much a perturbation E of R = X Xᵀ
  moves q(R) X, per unit of E (q[λ, μ] is a divided difference; Daleckii–Krein)."""
  lam, q = sigma**2, _scalar_map(coeffs, sigma) / sigma
  with np.errstate(divide="ignore", invalid="ignore"):
    diff = (q[:, None] - q[None, :]) / (lam[:, None] - lam[None, :])
  diag = np.arange(len(lam))
  diff[diag, diag] = np.gradient(q, lam)  # on the diagonal, the derivative
  return np.nanmax(np.abs(diff * sigma[None, :]))


def gram_float32_bound(ns="turbo", shape=(64, 256)):
  """A priori relative error of one float32 evaluation of the Gram-space iteration.

  Within a segment, X_end = q(R) X with R = X Xᵀ. The rounding of step k's state (R_k,
  relative size ~eps32) reaches the result through the rest of the segment's steps,
  amplified by `_amplification` of them over the σ step k sees; the final Q X and each
  restart add one rounding more. Unlike the standard iteration's bound
  (`float32_bound`), it grows with each segment's own polynomial, not the whole ∏|a|.
  """
  ns = as_newton_schulz(ns)
  coeffs = np.asarray(ns.coefficients(), np.float64)
  plan = newton_schulz_plan(shape, dataclasses.replace(ns, gram=True, compute_dtype="float32"),
                            backend="cpu")
  sigma, bound = np.linspace(0, 1, 801)[1:], 0.0
  for start, stop in plan.segments:
    for k in range(start, stop):
      bound += _amplification(coeffs[k:stop], sigma)
      sigma = np.unique(np.abs(_scalar_map(coeffs[k:k + 1], sigma)))
    bound += 1
  return np.finfo(np.float32).eps * bound


def compiled_flops(fn, *args) -> float:
  """XLA's cost-analysis flops of `fn` compiled for `args` (deterministic)."""
  analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return analysis["flops"]


def all_to_all_bytes(lowered_text: str) -> list[int]:
  """The bytes each all-to-all of a lowered (StableHLO) program leaves on a device, in
  program order: bytes, not element types, since 16-bit rows travel as 32-bit words
  (`peer_rows`)."""
  sizes = {"f32": 4, "ui32": 4, "bf16": 2, "f16": 2}
  return [math.prod(int(d) for d in dims.split("x") if d) * sizes[kind] for dims, kind in
          re.findall(r"stablehlo.all_to_all.*-> tensor<((?:\d+x)*)(\w+)>", lowered_text)]
