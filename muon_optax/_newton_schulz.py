"""Newton–Schulz orthogonalization: the array maths, apart from any tree handling."""

from __future__ import annotations

from typing import Optional, Union

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
    except jax.errors.TracerArrayConversionError:  # an array traced by optax.inject_hyperparams
      table = jnp.asarray(ns)
    except (TypeError, ValueError) as e:
      raise ValueError(f"ns must be a preset name or an (n, 3) array: {e}") from None
    if table.ndim == 1 and table.shape == (3,):
      table = table[None]
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0:
      raise ValueError(
          f"a Newton–Schulz schedule must have shape (n, 3) with n >= 1, got "
          f"{table.shape}; each row is the (a, b, c) of a X + b (X Xᵀ) X + c (X Xᵀ)² X."
      )
    if isinstance(table, np.ndarray) and not np.all(np.isfinite(table)):
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


# Gram-space iteration: the m×m state is rebuilt from X every this many steps.
# Rounding errors in R = X Xᵀ are amplified by the product of the a coefficients
# (≈ 12 per two jordan steps, ≈ 33 for the first two polar_express steps). On inputs
# with σ down to 1e-6 we measured 1e-4 … 2e-3 relative error without restarts and up
# to 5e-5 with segments of three steps; segments of two match the standard iteration.
GRAM_RESTART_EVERY = 2
# Automatic choice: Gram-space when the long side is at least this many times the short one.
GRAM_MIN_ASPECT = 3


def gram_newton_schulz_flops(m: int, n: int, steps: int) -> int:
  """Matmul flops of the Gram-space iteration (restarts included) on one m×n matrix.

  With m ≤ n: R = X Xᵀ and the final Q X cost 2m²n each; every restart (one per
  `GRAM_RESTART_EVERY` steps after the first segment) costs Q X and X Xᵀ again;
  inside a segment each step squares R (2m³), updates Q ← a Q + Z Q (2m³, not on the
  segment's first step, where Q = P) and, unless it ends the segment, updates
  R ← P (P R) (4m³).
  """
  m, n = min(m, n), max(m, n)
  flops = 2 * (2 * m * m * n)  # first R = X Xᵀ, last Q X
  for start in range(0, steps, GRAM_RESTART_EVERY):
    length = min(GRAM_RESTART_EVERY, steps - start)
    if start:
      flops += 2 * (2 * m * m * n)  # X ← Q X, R ← X Xᵀ
    flops += length * 2 * m**3 + (length - 1) * (2 * m**3 + 4 * m**3)
  return flops


def _low_precision(compute_dtype) -> bool:
  return jnp.dtype(compute_dtype).itemsize < 4


def use_gram(m: int, n: int, steps: int, gram: Optional[bool] = None,
             compute_dtype="float32") -> bool:
  """Whether `newton_schulz` iterates in Gram space for an m×n matrix.

  `gram=None` (automatic) picks it when max(m, n) ≥ GRAM_MIN_ASPECT · min(m, n),
  steps ≥ 2 and the compute dtype has at least 32 bits. Its flops are then at most
  about 0.86× the standard iteration's (0.78× at aspect 4 with 5 steps); below aspect 1.5
  it would cost more. With a 16-bit compute dtype the m×m work stays in float32 (see
  `newton_schulz`), which is slower than 16-bit matmuls on GPU/TPU, so automatic
  mode keeps the standard iteration there.
  """
  if gram is not None:
    return bool(gram)
  m, n = min(m, n), max(m, n)
  return steps >= 2 and n >= GRAM_MIN_ASPECT * m and not _low_precision(compute_dtype)


def newton_schulz_flops(m: int, n: int, steps: int, *, gram: Optional[bool] = None,
                        compute_dtype="float32") -> int:
  """Matmul flops of `newton_schulz` with these settings on one m×n matrix.

  Standard iteration (`gram=False`): steps · (4m²n + 2m³) with m ≤ n. `gram=True`
  counts the Gram-space iteration (`gram_newton_schulz_flops`); `gram=None` (the
  default, as in `newton_schulz`) counts whichever of the two runs (see `use_gram`).
  """
  if use_gram(m, n, steps, gram, compute_dtype):
    return gram_newton_schulz_flops(m, n, steps)
  m, n = min(m, n), max(m, n)
  return steps * (4 * m * m * n + 2 * m * m * m)


def _standard_iterate(x, coeffs, mm):
  """X ← a X + (b A + c A²) X with A = X Xᵀ; three matmuls per step on X itself."""
  for a, b, c in coeffs:  # unrolled: steps is small and static
    gram = mm(x, _t(x))
    poly = b * gram + c * mm(gram, gram)
    x = a * x + mm(poly, x)
  return x


def _gram_iterate(x, coeffs, mm, mm_f32):
  """The same polynomial, carried in Gram space: X_k = Q_k X_0.

  With R_k = X_k X_kᵀ and P_k = a I + b R_k + c R_k², one step is X_{k+1} = P_k X_k,
  so Q_{k+1} = P_k Q_k and R_{k+1} = P_k R_k P_k = P_k (P_k R_k) (P_k and R_k commute).
  Only R_0 = X_0 X_0ᵀ and the final Q X touch the m×n matrix. Every
  GRAM_RESTART_EVERY steps the state is rebuilt (X ← Q X, R ← X Xᵀ, Q ← I): rounding
  in R is otherwise amplified by ∏ a_k and spurious negative eigenvalues of R grow.
  The m×m products use float32 operands whatever the compute dtype: with bfloat16 R
  we measured Polar Express singular values up to 1.5 (3.3 with a single restart),
  far outside its band. Q is kept as α I + D so that α X is applied in float32: a
  16-bit X times the ~∏a_k-sized identity part would swamp the small singular values.
  """
  eye = jnp.eye(x.shape[-2], dtype=jnp.float32)
  for start in range(0, len(coeffs), GRAM_RESTART_EVERY):
    if start:
      x = alpha * x + mm(d, x)
    r = mm(x, _t(x))
    segment = coeffs[start:start + GRAM_RESTART_EVERY]
    for i, (a, b, c) in enumerate(segment):
      z = b * r + c * mm_f32(r, r)
      # Q = alpha I + D: the identity part is applied to X exactly, in float32.
      alpha, d = (a, z) if i == 0 else (a * alpha, a * d + alpha * z + mm_f32(z, d))
      if i + 1 < len(segment):
        p = a * eye + z
        r = mm_f32(p, mm_f32(p, r))
        r = 0.5 * (r + _t(r))  # keep R symmetric as rounding drifts it
  return alpha * x + mm(d, x)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def newton_schulz(
    x: jax.Array,
    *,
    ns: Schedule = "jordan",
    steps: int = 5,
    gram: Optional[bool] = None,
    compute_dtype="float32",
    precision=jax.lax.Precision.HIGHEST,
) -> jax.Array:
  """Approximate orthogonal polar factor U Vᵀ of each matrix in `x`.

  For X₀ = G / (‖G‖_F · safety) on the wide orientation (m ≤ n; transposed when
  rows > cols), iterates X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X with the (a, b, c) rows
  of `ns`. Singular vectors are kept and each singular value follows the scalar map
  σ ← a σ + b σ³ + c σ⁵: after 5 steps `jordan` maps normalized σ ≥ 3e-3 into
  [0.68, 1.21] and `polar_express` maps σ ≥ 1e-3 into [0.84, 1.13].

  Two exact rewritings of the same polynomial are available:
  - standard: three matmuls per step on the m×n X, 4m²n + 2m³ flops;
  - Gram-space (`gram=True`): iterate on the m×m R = X Xᵀ and the accumulated
    Q (X_k = Q_k X₀), multiply by X once per `GRAM_RESTART_EVERY` steps.
    Fewer flops when n > 1.5m (0.78× at n = 4m, 5 steps; `newton_schulz_flops`).

  Measured accuracy (CPU; relative Frobenius error against the same polynomial
  evaluated in float64; Gaussian inputs and inputs with singular values log-spaced
  from 1 to 1e-6; 32×128, 64×256, 768×3072; both presets):
  - float32: standard 1.4e-6 … 1.4e-5, Gram 2.7e-6 … 1.7e-5, max |Gram − standard|
    ≤ 8.1e-6 per entry. The error grows with ill-conditioning in both variants: the
    map amplifies perturbations of small σ by ∏ a_k (≈ 490 for 5 jordan steps).
  - compute_dtype="bfloat16" (float32 accumulation): standard 0.5 … 3.7 %, Gram
    0.75 … 5 %; max |Gram − float32 standard| ≤ 2.3e-2 per entry. The bands above hold
    to within 0.02 (polar_express Gram: lowest σ 0.857 instead of 0.865).
  - `precision` changes nothing on XLA:CPU (float32 dots are computed in float32 at
    every setting; measured bit-identical). On GPU, DEFAULT may use TF32 and on TPU
    single-pass bfloat16 for float32 operands: expect accuracy between the two rows above.

  Args:
    x: array of shape (..., m, n); leading axes are a batch.
    ns: a preset ("jordan", "polar_express") or an (n, 3) coefficient array. A
      schedule shorter than `steps` repeats its last row.
    steps: number of iterations (a Python int).
    gram: True for the Gram-space iteration, False for the standard one, None to
      choose from the shape (Gram when max(m, n) ≥ 3·min(m, n), steps ≥ 2 and a
      32-bit compute dtype; see `use_gram`).
    compute_dtype: dtype of the matmul operands. Products accumulate in float32
      and the polynomial is combined in float32; the m×m Gram-space products
      always use float32 operands. The result is cast back to x.dtype.
    precision: matmul precision passed to XLA (see above).

  Returns:
    Array of x's shape and dtype. Scale-invariant (NS(k·G) = NS(G)); NS(0) = 0.

  Example:
    >>> import jax, muon_optax as mo
    >>> g = jax.random.normal(jax.random.key(0), (64, 256))
    >>> mo.newton_schulz(g, ns="polar_express", steps=5, gram=True).shape
    (64, 256)

  References:
    Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks".
    Amsel et al. 2025, "The Polar Express", arXiv 2505.16932.
    Zhang, Amsel, Chen, Dao 2026, "Gram Newton-Schulz" (blog, tridao.me).
  """
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs an array of shape (..., m, n), got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"newton_schulz needs a floating array, got {x.dtype}")
  try:
    cdt = jnp.dtype(compute_dtype)
  except TypeError:
    raise ValueError(f"compute_dtype must be a floating dtype, got {compute_dtype!r}") from None
  if not jnp.issubdtype(cdt, jnp.floating):
    raise ValueError(f"compute_dtype must be a floating dtype, got {compute_dtype!r}")
  if gram not in (None, True, False):
    raise ValueError(f"gram must be True, False or None (automatic), got {gram!r}")
  coeffs, safety = coefficient_schedule(ns, steps)
  tall = x.shape[-2] > x.shape[-1]
  out = _t(x) if tall else x
  # Normalize in at least float32 so that scale invariance holds for 16-bit inputs too.
  acc = jnp.promote_types(x.dtype, jnp.float32)
  out = _frobenius_normalize(out.astype(acc), safety)

  def mm(a, b, dtype=cdt):  # float32 (or wider) accumulation, operands in `dtype`
    return jnp.matmul(a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=acc)

  if use_gram(*out.shape[-2:], steps, gram, cdt):
    out = _gram_iterate(out, coeffs, mm, lambda a, b: mm(a, b, acc))
  else:
    out = _standard_iterate(out, coeffs, mm)
  if tall:
    out = _t(out)
  return out.astype(x.dtype)
