"""Newton–Schulz orthogonalization: the array maths, apart from any tree handling."""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

# Keller Jordan's quintic: tuned for speed, singular values land in ~[0.68, 1.13].
_JORDAN = ((3.4445, -4.7750, 2.0315),)

# Amsel et al. 2025 (arXiv 2505.16932), Algorithm 1 with l = 1e-3. The paper divides
# every row but the last by (1.01, 1.01**3, 1.01**5) and the Frobenius norm by 1.01.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
_POLAR_EXPRESS = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW
) + ((1.875, -1.25, 0.375),)

PRESETS = {
    "jordan": (np.asarray(_JORDAN), 1.0),
    "polar_express": (np.asarray(_POLAR_EXPRESS), 1.01),
}

Schedule = Union[str, np.ndarray, jax.Array, tuple]


def coefficient_schedule(ns: Schedule, steps: int) -> tuple[np.ndarray, float]:
  """Returns the (steps, 3) coefficients and the norm safety factor of `ns`.

  A schedule shorter than `steps` repeats its last row; it never wraps around to
  its first row (the first rows of tuned schedules are far too aggressive to reuse).
  """
  if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
    raise ValueError(
        f"ns_steps must be a positive Python int, got {steps!r}. Under "
        "optax.inject_hyperparams pass static_args=('ns_steps',)."
    )
  if isinstance(ns, str):
    if ns not in PRESETS:
      raise ValueError(
          f"unknown Newton–Schulz preset {ns!r}; choose one of {sorted(PRESETS)} "
          "or pass an (n, 3) array of (a, b, c) coefficients."
      )
    table, safety = PRESETS[ns]
  else:
    try:
      table = np.asarray(ns, dtype=np.float64)
    except (TypeError, ValueError) as e:
      raise ValueError(f"ns must be a preset name or an (n, 3) array: {e}") from None
    if table.ndim == 1 and table.shape == (3,):
      table = table[None]
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0:
      raise ValueError(
          f"a Newton–Schulz schedule must have shape (n, 3) with n >= 1, got "
          f"{table.shape}; each row is the (a, b, c) of a X + b (X Xᵀ) X + c (X Xᵀ)² X."
      )
    if not np.all(np.isfinite(table)):
      raise ValueError("a Newton–Schulz schedule must hold finite coefficients only.")
    safety = 1.0
  rows = np.minimum(np.arange(steps), len(table) - 1)
  return table[rows], safety


def _frobenius_normalize(x: jax.Array, safety: float) -> jax.Array:
  """X / (‖X‖_F · safety), exact for any finite scale; 0 stays exactly 0.

  Dividing by max|X| first keeps ‖X‖_F from overflowing (entries ~1e30) or
  underflowing (~1e-30) in float32. The `where`s only guard division by zero.
  """
  peak = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
  x = x / jnp.where(peak > 0, peak, 1)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) * safety
  return x / jnp.where(norm > 0, norm, 1)


def newton_schulz_flops(m: int, n: int, steps: int) -> int:
  """Matmul flops of `steps` quintic iterations on one m×n matrix (wide orientation)."""
  m, n = min(m, n), max(m, n)
  return steps * (4 * m * m * n + 2 * m * m * m)


def newton_schulz(
    x: jax.Array,
    *,
    ns: Schedule = "jordan",
    steps: int = 5,
    compute_dtype=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
) -> jax.Array:
  """Approximate orthogonal polar factor U Vᵀ of each matrix in `x`.

  For X₀ = G / ‖G‖_F (on the wide orientation), iterates
  X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X with the (a, b, c) rows of `ns`.

  Args:
    x: array of shape (..., m, n); leading axes are a batch.
    ns: a preset ("jordan", "polar_express") or an (n, 3) coefficient array. A
      schedule shorter than `steps` repeats its last row.
    steps: number of iterations (a Python int).
    compute_dtype: dtype of the iteration; the result is cast back to x.dtype.
    precision: matmul precision passed to XLA.

  Returns:
    Array of x's shape and dtype. Scale-invariant (NS(k·G) = NS(G)); NS(0) = 0.

  Example:
    >>> import jax, muon_optax as mo
    >>> g = jax.random.normal(jax.random.key(0), (64, 256))
    >>> mo.newton_schulz(g, ns="polar_express", steps=5).shape
    (64, 256)

  References:
    Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks".
    Amsel et al. 2025, "The Polar Express", arXiv 2505.16932.
  """
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs an array of shape (..., m, n), got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"newton_schulz needs a floating array, got {x.dtype}")
  coeffs, safety = coefficient_schedule(ns, steps)
  tall = x.shape[-2] > x.shape[-1]
  out = x.astype(compute_dtype)
  if tall:
    out = jnp.swapaxes(out, -1, -2)
  out = _frobenius_normalize(out, safety)
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  for a, b, c in coeffs:  # unrolled: steps is small and static
    gram = mm(out, jnp.swapaxes(out, -1, -2))
    poly = b * gram + c * mm(gram, gram)
    out = a * out + mm(poly, out)
  if tall:
    out = jnp.swapaxes(out, -1, -2)
  return out.astype(x.dtype)
