"""Newton–Schulz orthogonalization: the array maths, apart from any tree handling."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from muon_optax._newton_schulz.centering import gram_center
from muon_optax._newton_schulz.operands import (
  Float8Matmul,
  Matmul,
  Reduce,
  frobenius_normalize,
  power_of_two_peak,
  whole,
)
from muon_optax._newton_schulz.row_blocks import RowBlocks, whole_rows
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS, NewtonSchulz, as_newton_schulz
from muon_optax._newton_schulz.variant import NSPlan, newton_schulz_plan, shared_settings
from muon_optax._util.order import after


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _aol(x: jax.Array, r: jax.Array, peak: Optional[jax.Array],
         blocks: RowBlocks) -> tuple[jax.Array, jax.Array]:
  """Almost-orthogonal-layer rescaling X ← S X / peak, R ← S R S, S = diag(1/√Σ_j |R_ij|)
  with R = (X / peak)(X / peak)ᵀ (`gram_rows`; no peak: X is already divided by it).

  ‖S X / peak‖₂ ≤ 1 (Schur test on S R S, whose absolute row sums are ≤ 1), and the
  bound is much tighter than ‖X‖_F, so fewer steps lift the small singular values.
  Zero rows keep a zero scale. R (this part's rows) is reused by the first step.
  """
  rows = jnp.sum(jnp.abs(r), axis=-1, keepdims=True)
  s = jnp.where(rows > 0, jax.lax.rsqrt(jnp.where(rows > 0, rows, 1)), 0)
  scale = blocks.gather(s)
  return (scale if peak is None else scale / peak) * x, s * r * _t(scale)


def _kept(total: jax.Array) -> jax.Array:
  """A sum of products, computed once and kept: without the barrier a compiler may fuse
  the sum into each of its consumers, holding every term live until the last of them
  (XLA's GPU and TPU pipelines keep the barrier; its CPU pipeline drops it, where
  operands are 32-bit by default and sums are folded into one product instead)."""
  return jax.lax.optimization_barrier(total)


def _apply(scale, m, x, mm, blocks: RowBlocks, eye):
  """(scale · I + M) X, M being this part's rows. With `eye` (this part's rows of I,
  float32 operands) it is one product, so that X's old value dies with it: written
  scale · X + M X, the compiler may fuse that sum into each of the result's consumers,
  keeping both X and M X live until the last of them. Without `eye` (16-bit operands)
  scale · X stays exact in float32, and the sum is kept (`_kept`)."""
  if eye is not None:
    return blocks.apply(scale * eye + m, x, mm)
  return _kept(scale * x + blocks.apply(m, x, mm))


def _static_zero(c) -> bool:
  """Whether a coefficient is a concrete 0 (a table injected as a hyperparameter is
  traced: its zeros are not known when the iteration is traced)."""
  return not isinstance(c, jax.core.Tracer) and float(c) == 0.0


def _polynomial(r, b, c, mm, blocks: RowBlocks, eye):
  """This part's rows of b R + c R². With `eye` (float32 operands), one product,
  R (b I + c R), so that the result is a product's output which the compiler keeps, not
  a sum it may fuse into every consumer, keeping the products it adds live; without
  `eye` (16-bit operands), b R + c R R, b R exact in float32. A cubic step (c a static
  0) is b R alone: no product."""
  if _static_zero(c):
    return b * r
  if eye is not None:
    return blocks.product(r, b * eye + c * r, mm)
  return _kept(b * r + c * blocks.product(r, r, mm))


def _standard_iterate(x, r, coeffs, mm, blocks: RowBlocks, eye, fp8_steps: int = 0):
  """X ← a X + (b A + c A²) X with A = X Xᵀ; three matmuls per step on X itself.
  `r` is this part's rows of A for the first step when the preconditioner formed it;
  A and the polynomial are this part's rows (`blocks`), gathered whole where X needs.
  The first `fp8_steps` steps read float8 operands (`Float8Matmul`), and keep a X and
  b A exact in float32 rather than rounding a I + M to 8 bits."""
  fp8 = Float8Matmul(mm.accumulate, mm.precision)
  for i, (a, b, c) in enumerate(coeffs):  # unrolled: steps is small and static
    step_mm, step_eye = (fp8, None) if i < fp8_steps else (mm, eye)
    gram = r if i == 0 and r is not None else blocks.gram_rows(x, step_mm)
    x = _apply(a, _polynomial(gram, b, c, step_mm, blocks, step_eye), x, step_mm, blocks,
               step_eye)
  return x


def _means(blocks: RowBlocks, *rows: jax.Array) -> list[jax.Array]:
  """The mean over all rows of each per-row value given for this part's rows (shape
  (..., rows)); one gather for all of them. Shapes (..., 1, 1)."""
  total = jnp.mean(blocks.gather(jnp.stack(rows, -1)), axis=-2)
  return [total[..., k, None, None] for k in range(len(rows))]


def _diagonal(a: jax.Array, eye: jax.Array) -> jax.Array:
  """This part's rows' diagonal entries (`eye`: its rows of I)."""
  return jnp.sum(a * eye, axis=-1)


def _centred_product(a, ca, b, cb, mm: Matmul, blocks: RowBlocks, eye):
  """This part's rows of A B with A = ca I + A', B = cb I + B': cb A + ca B' + A' B'.
  The scalar parts stay exact in float32 and only A' and B' are rounded, so that
  16-bit operands round each matrix's spread about its mean eigenvalue `ca`, `cb`, not
  the identity part that is most of R, P − a I and Q − α I as the iteration converges.
  """
  a0, b0 = a - ca * eye, b - cb * eye
  return _kept(cb * a + ca * b0 + blocks.product(a0, b0, mm))


def _gram_iterate(x, r, coeffs, mm, parts, blocks: RowBlocks, fold: bool):
  """The same polynomial, carried in Gram space: X_k = Q_k X_0.

  With R_k = X_k X_kᵀ and P_k = a I + b R_k + c R_k², one step is X_{k+1} = P_k X_k,
  so Q_{k+1} = P_k Q_k and R_{k+1} = P_k R_k P_k = P_k (P_k R_k) (P_k and R_k commute).
  Only R_0 = X_0 X_0ᵀ and the final Q X touch the m×n matrix. At the start of each of
  the (start, stop) `parts` but the first, the state is rebuilt (X ← Q X, R ← X Xᵀ,
  Q ← I): rounding in R is otherwise amplified by ∏ a_k. Products accumulate in float32,
  as the state is kept. With 32-bit operands (`fold`) each state matrix is one
  product's output (see `_polynomial`, `_apply`). With 16-bit operands every m×m
  product reads centred operands (`_centred_product`): R about its mean eigenvalue,
  Z = b R + c R² about b ρ + c tr(R²)/m, Q = α I + D about α + its own; and Q X is
  applied as c X + (Q − c I) X, c X exact, with c the centre of `centering`. The means
  are read from diagonals and sums of squares: gathered where the rows are split. R, Q
  and every product are this part's rows (`blocks`).
  """
  eye = blocks.rows(jnp.eye(x.shape[-2], dtype=jnp.float32))
  folded = eye if fold else None
  alpha, d = 1.0, None  # Q = α I + D, set by the first step of the first segment

  def apply(x, k):
    if fold:
      return _apply(alpha, d, x, mm, blocks, folded)
    q = alpha * eye + d
    mean, square_mean = _means(blocks, _diagonal(q, eye), jnp.sum(q * q, axis=-1))
    c = gram_center(mean, square_mean, last=k + 1 == len(parts))
    return _apply(c, d + (alpha - c) * eye, x, mm, blocks, None)

  for k, (start, stop) in enumerate(parts):
    if start:
      x = apply(x, k - 1)
    if start or r is None:
      r = blocks.gram_rows(x, mm)
    segment = coeffs[start:stop]
    for i, (a, b, c) in enumerate(segment):
      if i:  # keep R symmetric as rounding drifts it
        r = 0.5 * (r + blocks.transposed(r))
      if fold:
        z = _polynomial(r, b, c, mm, blocks, folded)
        p = a * eye + z
        alpha, d = 0.0, p if i == 0 else blocks.product(p, d, mm)  # Q = D: P_0, P_k Q
        if i + 1 < len(segment):
          if i:  # after Q's product: one product's block rows live at a time, not two
            p, r = after((p, r), d)
          r = blocks.product(p, blocks.product(p, r, mm), mm)
        continue
      # R's and R²'s mean eigenvalues (tr R² = Σ R_ij², R symmetric), and D's.
      rho, rho2, *delta = _means(blocks, _diagonal(r, eye), jnp.sum(r * r, axis=-1),
                                 *([_diagonal(d, eye)] if i else []))
      z = b * r if _static_zero(c) else _kept(
          b * r + c * _centred_product(r, rho, r, rho, mm, blocks, eye))
      zeta = b * rho + c * rho2
      alpha, d = (a, z) if i == 0 else (a * alpha, _kept(
          a * d + alpha * z + _centred_product(z, zeta, d, delta[0], mm, blocks, eye)))
      if i + 1 < len(segment):  # R ← P (P R), P = a I + Z
        if i:
          z, r = after((z, r), d)
        t = _kept(a * r + _centred_product(z, zeta, r, rho, mm, blocks, eye))
        tau, = _means(blocks, _diagonal(t, eye))
        r = _kept(a * t + _centred_product(z, zeta, t, tau, mm, blocks, eye))
  return apply(x, len(parts) - 1)


def newton_schulz(x: jax.Array, ns: NS = DEFAULT_NS) -> jax.Array:
  """Approximate orthogonal polar factor U Vᵀ of each matrix in `x`.

  On the wide orientation (m ≤ n; transposed when rows > cols), X₀ is G scaled so
  that ‖X₀‖₂ ≤ 1, then X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X with the (a, b, c) rows of
  the settings' table. Singular vectors are kept and each singular value of X₀ follows
  the scalar map σ ← a σ + b σ³ + c σ⁵ (its band: `PRESETS`). Two scalings
  (`NewtonSchulz.precondition`):
  - "frobenius": X₀ = G / (‖G‖_F · safety);
  - "aol": X₀ = S G with S = diag(1/√Σ_j |(G Gᵀ)_ij|) (Turbo-Muon). It keeps ‖X₀‖₂ ≤ 1
    with a far smaller gap than ‖G‖_F, so the "turbo" preset needs 4 steps. S reweights
    rows, so the result approximates the polar factor of S G, not exactly of G.

  Two exact rewritings of the same polynomial (`NewtonSchulz.gram`):
  - standard: three matmuls per step on the m×n X, 4m²n + 2m³ flops;
  - Gram-space: iterate on the m×m R = X Xᵀ and the accumulated Q (X_k = Q_k X₀),
    touching X only at the start, at each restart and at the end. Fewer flops when
    n > 1.5m; `newton_schulz_plan` says which runs, where it restarts, and its flops.

  Args:
    x: array of shape (..., m, n); leading axes are a batch.
    ns: a `NewtonSchulz`, or a preset name (see `PRESETS`).

  Returns:
    Array of x's shape and dtype. Scale-invariant (NS(k·G) = NS(G)); NS(0) = 0.

  Examples:
    >>> import jax, muon_optax as mo
    >>> g = jax.random.normal(jax.random.key(0), (64, 256))
    >>> mo.newton_schulz(g, mo.NewtonSchulz("polar_express", steps=5, gram=True)).shape
    (64, 256)

  References:
    Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks".
    Amsel et al. 2025, "The Polar Express", arXiv 2505.16932.
    Boissin et al. 2025, "Turbo-Muon", arXiv 2512.04632.
    Zhang, Amsel, Chen, Dao 2026, "Gram Newton-Schulz" (blog, tridao.me).
  """
  return _newton_schulz(x, as_newton_schulz(ns), blocks=None)


def newton_schulz_whole_products(x: jax.Array, ns: NS = DEFAULT_NS) -> jax.Array:
  """`newton_schulz` with every product formed whole, as a mesh runs it: on TPU chips a
  symmetric product's block rows cost more HBM traffic and memory than their flops
  save, and on a CPU mesh, where each round of matrices is its own call, they multiply
  the compile time (benchmarks/results/mesh_products.txt)."""
  return _newton_schulz(x, as_newton_schulz(ns), blocks=1)


def _newton_schulz(x: jax.Array, ns: NewtonSchulz, blocks: Optional[int]) -> jax.Array:
  """The iteration on whole matrices, their symmetric products in `blocks` block rows
  (`whole_rows`; None: the platform's count for the iteration that runs)."""
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs an array of shape (..., m, n), got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"newton_schulz needs a floating array, got {x.dtype}")
  tall = x.shape[-2] > x.shape[-1]
  wide = _t(x) if tall else x
  if ns.fn is not None:  # a custom function takes a (count, m, n) stack
    out = ns.fn(wide.reshape(-1, *wide.shape[-2:])).reshape(wide.shape)
  else:
    plan = newton_schulz_plan(wide.shape[-2:], ns)
    out = _orthogonalize_wide(wide, wide.shape[-2:], whole, ns,
                              whole_rows(blocks=blocks, gram_space=plan.variant == "gram",
                                         cols=wide.shape[-1]), plan)
  return _t(out) if tall else out


def newton_schulz_column_parts(x: jax.Array, parts: int, reduce: Reduce,
                               ns: NS = DEFAULT_NS, rows: Optional[RowBlocks] = None
                               ) -> jax.Array:
  """`newton_schulz` of wide matrices whose columns are split into `parts` equal parts
  (one per device): `x` is this device's (..., m, n / parts) part, and
  `reduce(partial, op)` combines a per-part result over the parts (op `jnp.add` or
  `jnp.maximum`). Every sum over columns (norms, X Xᵀ) goes through it; the rest of
  the iteration is column-local, so each part of the result is that part of the whole
  matrix's result, with the settings `newton_schulz` picks but where `shared_settings`
  keeps 16-bit operands out of Gram space.
  `rows` (`RowBlocks`) splits the m×m matrices and products by rows over the parts too,
  so that each part does 1/parts of all the work; without it every part holds them
  whole (`whole_rows`) and forms its products whole, as a mesh does (see
  `newton_schulz_whole_products`)."""
  m, cols = x.shape[-2:]
  return _orthogonalize_wide(x, (m, cols * parts), reduce,
                             shared_settings(as_newton_schulz(ns), parts),
                             rows or whole_rows(reduce, blocks=1))


def _orthogonalize_wide(x, shape, reduce: Reduce, ns: NewtonSchulz, blocks: RowBlocks,
                        plan: Optional[NSPlan] = None):
  """The iteration on wide (m ≤ n) matrices of logical (m, n) `shape`, as `plan`
  (default: `newton_schulz_plan`'s for them) says."""
  plan = plan or newton_schulz_plan(shape, ns)
  cdt, precision = jnp.dtype(plan.compute_dtype), jax.lax.Precision[plan.precision]
  coeffs = ns.coefficients()
  # Scale in at least float32 so that scale invariance holds for 16-bit inputs too.
  acc = jnp.promote_types(x.dtype, jnp.float32)

  mm = Matmul(cdt, acc, precision)

  out, r = x.astype(acc), None
  if plan.precondition == "aol":
    # A mesh divides X by its peak inside the Gram sum (`gram_rows`) and with S, not as
    # a copy of its own; a whole matrix is divided first (its Gram's operands are one
    # copy of X anyway), and so is X where the operands' range is narrower (float16).
    peak = power_of_two_peak(out, reduce)
    if blocks.gram is None or jnp.finfo(cdt).maxexp < jnp.finfo(acc).maxexp:
      out, peak = out / peak, None
    out, r = _aol(out, blocks.gram_rows(out, mm, peak), peak, blocks)
  else:
    out = frobenius_normalize(out, ns.safety(), reduce)
  # With operands of 32 bits or more, a X + M X is applied as one product (`_apply`).
  fold = cdt.itemsize >= 4
  if plan.variant == "gram":
    out = _gram_iterate(out, r, coeffs, mm, plan.segments, blocks, fold)
  else:
    eye = blocks.rows(jnp.eye(shape[0], dtype=acc)) if fold else None
    out = _standard_iterate(out, r, coeffs, mm, blocks, eye, plan.fp8_steps)
  return out.astype(x.dtype)
