"""Helpers shared by the tests: the one tree comparison with explicit tolerances, and
the float64 references and error bounds that Newton–Schulz tolerances come from."""

import jax
import numpy as np

from muon_optax._newton_schulz.settings import as_newton_schulz


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


def compiled_flops(fn, *args) -> float:
  """XLA's cost-analysis flops of `fn` compiled for `args` (deterministic)."""
  analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return analysis["flops"]
