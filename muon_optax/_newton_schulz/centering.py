"""Where the 16-bit Gram-space iteration splits Q into an exact scalar part and a rounded
rest, so that rounding costs least.

The Gram-space iteration applies Q = P_k … P_0 to X at each restart and at the end. With
16-bit operands it applies c X exactly, in float32, and (Q − c I) X with Q − c I and X
rounded to 16 bits. Each eigenvalue of Q is the gain q(σ) = φ(σ)/σ of the segment's
scalar map φ at a singular value σ of X, so the rounding of X reaches the result scaled
by |q(σ) − c| in each singular direction, and the later segments amplify it by their own
gain w there. c = q(0) = ∏a puts no rounding on the small singular values, which the later
segments amplify most, but the most on the large ones; the midpoint of the gains halves
the largest, but puts some on the small ones. The c taken minimizes
max |q(σ) − c| · w(σ) / √σ over the singular values X has: from its smallest, which an
estimate of Q's largest eigenvalue q(σ_min), erring high, bounds from below, up to 1
(‖X₀‖₂ ≤ 1). The 1/√σ leans further toward the small singular values, whose share of
the result is the smallest: without it an ill-conditioned X strays twice as far from
the float64 polynomial (`test_bfloat16_gram_as_accurate_as_bfloat16_standard`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# The singular values the gains are read at: X₀'s lie in (0, 1].
_GRID = 1024
_SMALLEST = 1e-7
# Bisection steps for the centre: each halves its interval of gains (at most ∏a wide).
_BISECTIONS = 40
# Power iterations for Q's largest eigenvalue, and the share of it they are taken to reach.
_POWER_STEPS = 30
_POWER_REACH = 0.7


def _carried(coeffs) -> list[jax.Array]:
  """The grid carried through the steps: [σ, φ_0(σ), φ_1(φ_0(σ)), …]."""
  values = [jnp.geomspace(_SMALLEST, 1.0, _GRID, dtype=jnp.float32)]
  for a, b, c in coeffs:
    x = values[-1]
    values.append(a * x + b * x ** 3 + c * x ** 5)
  return values


def _minimax(gain: jax.Array, weight: jax.Array, valid: jax.Array) -> jax.Array:
  """argmin_c max over the valid grid points of |gain − c| · weight, per matrix: where
  the largest weighted excess above c meets the largest below it (one falls, the other
  rises with c)."""
  lo = jnp.min(jnp.where(valid, gain, jnp.inf), axis=-1)
  hi = jnp.max(jnp.where(valid, gain, -jnp.inf), axis=-1)

  def halve(_, bounds):
    lo, hi = bounds
    c = 0.5 * (lo + hi)
    above = jnp.max(jnp.where(valid, (gain - c[..., None]) * weight, -jnp.inf), axis=-1)
    below = jnp.max(jnp.where(valid, (c[..., None] - gain) * weight, -jnp.inf), axis=-1)
    return jnp.where(above > below, c, lo), jnp.where(above > below, hi, c)

  lo, hi = jax.lax.fori_loop(0, _BISECTIONS, halve, (lo, hi))
  return 0.5 * (lo + hi)


def largest_eigenvalue(q: jax.Array) -> jax.Array:
  """About the largest eigenvalue of each symmetric positive (…, m, m) `q`, erring
  high: `_POWER_STEPS` power iterations from a fixed vector reach at least
  `_POWER_REACH` of it (their Rayleigh quotient falls short where the top eigenvalues
  cluster, and then by little), divided by that share. Shape (…, 1, 1)."""
  m = q.shape[-1]
  v = jnp.broadcast_to(1.0 + jnp.arange(m, dtype=jnp.float32)[:, None] / m, (*q.shape[:-1], 1))
  for _ in range(_POWER_STEPS):
    v = jnp.matmul(q, v, precision=jax.lax.Precision.HIGHEST)
    v = v / jnp.maximum(jnp.linalg.norm(v, axis=-2, keepdims=True), jnp.finfo(jnp.float32).tiny)
  rayleigh = jnp.sum(v * jnp.matmul(q, v, precision=jax.lax.Precision.HIGHEST), axis=-2,
                     keepdims=True)
  return rayleigh / _POWER_REACH


def gram_centers(coeffs, segments: Sequence[tuple[int, int]], bound: jax.Array
                 ) -> list[jax.Array]:
  """The centre c of each segment's Q (see the module doc), given `bound` (shape
  (..., 1, 1)), about the largest eigenvalue of the first segment's Q or more
  (`largest_eigenvalue`). Shapes (..., 1, 1), in float32."""
  values = _carried(coeffs)
  first = values[segments[0][1]] / values[segments[0][0]]
  # Singular values whose first gain exceeds the bound are not X's; the largest (σ = 1,
  # the least gain) always counts.
  valid = (first <= bound[..., 0]) | (first == jnp.min(first))
  out = []
  for start, stop in segments:
    gain, later = values[stop] / values[start], values[-1] / values[stop]
    out.append(_minimax(gain, later / jnp.sqrt(values[0]), valid)[..., None, None])
  return out
