"""Where the 16-bit Gram-space iteration splits Q into an exact scalar part and a rounded
rest, so that rounding costs least.

The Gram-space iteration applies Q = P_k … P_0 to X at each restart and at the end. With
16-bit operands it applies c X exactly, in float32, and (Q − c I) X with Q − c I and X
rounded to 16 bits. X's rounding error E spreads about evenly over Q's eigendirections
and reaches the result as (Q − c I) E: in direction i scaled by q_i − c, q_i being the
gain φ(σ_i)/σ_i of the segment's scalar map φ at a singular value σ_i of X, and then by
the later segments' own gain w_i there. The squared error Σ (q_i − c)² w_i² is least at
the weighted mean c = Σ q_i w_i² / Σ w_i². The q_i are not known, but the traces of Q
and Q² are, read from its diagonal and its squared entries:
- the last apply (w = 1) takes the mean eigenvalue, tr Q / m;
- an earlier one weighs each eigenvalue by itself, c = tr Q² / tr Q: the later gain
  grows with q (both grow as σ falls), and q is the one positive weight whose sums are
  those traces. A least-squares line through w² against q came nearer the true weights
  in a probe, but its weights turn negative on the larger singular values, and its
  centre then jumps across the range where their sum crosses zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gram_center(mean: jax.Array, square_mean: jax.Array, last: bool) -> jax.Array:
  """The centre c of a segment's Q (see the module doc), from the means of its
  eigenvalues and of their squares (tr Q / m, tr Q² / m); `last`: the final apply. Q's
  eigenvalues are the gains, positive for every preset's map on (0, 1]; a table whose
  Q has a zero trace is centred at 0."""
  if last:
    return mean
  return jnp.where(mean != 0, square_mean / jnp.where(mean != 0, mean, 1), 0)
