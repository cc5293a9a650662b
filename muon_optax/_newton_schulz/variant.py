"""What Newton–Schulz runs on a matrix shape: standard or Gram-space iteration, where the
Gram-space one restarts, the flops, and `newton_schulz_plan`, which says it all."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax._newton_schulz.settings import DEFAULT_NS, NS, NewtonSchulz, as_newton_schulz
from muon_optax._newton_schulz.symmetric import ProductOf, symmetric_flops

# Gram-space iteration: the m×m state is rebuilt from X before some steps (0-based).
# Nothing in Gram space corrects rounding, where the standard iteration, contracting
# near σ = 1, removes it step by step: rounding in R = X Xᵀ reaches the result through
# the segment's polynomial, amplified by up to the product of its |a| coefficients. A
# float32 segment ends before its ∏|a| passes GRAM_SEGMENT_GAIN or its length
# GRAM_SEGMENT_STEPS: each rebuild costs two products with the m×n X, and float32's
# rounding times that gain stays far below the distance of a preset's result from
# U Vᵀ (benchmarks/results/newton_schulz_gram.txt). The turbo preset runs as one
# segment; long convergent schedules end within a few times the standard iteration's
# float32 floor.
GRAM_SEGMENT_GAIN = 256.0
GRAM_SEGMENT_STEPS = 4
# Automatic choice: Gram-space when the long side is at least this many times the short
# one: the measured time crossover lies between 1.5 and 2, where flops alone would put
# it near 1.25 (benchmarks/results/newton_schulz_gram.txt).
GRAM_MIN_ASPECT = 2
# ... and when the operands carry at least float16's mantissa bits, or bfloat16's for the
# presets (at their own steps and scaling) whose bfloat16 Gram space, its products
# centred, the table finds as near U Vᵀ as their bfloat16 standard iteration on the wide
# classes (to 1.0002×, and trains no worse): turbo.
# polar_express's diverges on some heavy-tailed inputs, and deepseek_v4's strays 1.16×
# further on the workload GPT's gradients (benchmarks/results/newton_schulz_precision.txt).
GRAM_MIN_MANTISSA = 10
GRAM_BFLOAT16_PRESETS = ("turbo",)


def gram_restarts(slopes: Optional[Sequence[float]], steps: int, compute_dtype: Any
                  ) -> tuple[int, ...]:
  """Steps before which the Gram-space iteration rebuilds its state.

  `slopes`: |a| of each step, or None when the table is traced (injected), in which case
  the state is rebuilt every 2 steps, as it always is with 16-bit operands (as Gram
  Newton–Schulz restarts its float16 iteration): one restart lets their singular values
  leave the band (benchmarks/results/newton_schulz_gram.txt).
  """
  if slopes is None or jnp.dtype(compute_dtype).itemsize < 4:
    return tuple(range(2, steps, 2))
  restarts, start, gain = [], 0, 1.0
  for k, a in enumerate(slopes):
    if k > 0 and (gain * a > GRAM_SEGMENT_GAIN or k - start == GRAM_SEGMENT_STEPS):
      restarts.append(k)
      start, gain = k, 1.0
    gain *= a
  return tuple(restarts)


def segments(steps: int, restarts: Sequence[int] = ()) -> list[tuple[int, int]]:
  """(start, stop) of each run of steps between Gram-space restarts."""
  cuts = [0] + [r for r in sorted(set(restarts)) if 0 < r < steps] + [steps]
  return list(zip(cuts[:-1], cuts[1:]))


def slopes_of(coeffs: Any) -> Optional[list[float]]:
  """|a| per step of a (steps, 3) table, or None if it is traced."""
  if isinstance(coeffs, jax.core.Tracer):
    return None
  return [abs(float(a)) for a in np.asarray(coeffs)[:, 0]]


def use_gram(m: int, n: int, steps: int, gram: Optional[bool], compute_dtype: Any,
             bfloat16: bool = False) -> bool:
  """Whether the iteration on an m×n matrix runs in Gram space.

  `gram=None` (automatic) picks it when max(m, n) ≥ GRAM_MIN_ASPECT · min(m, n),
  steps ≥ 2 and the compute dtype has at least float16's 10 mantissa bits: float16
  operands, restarted every 2 steps, stay as close to U Vᵀ as float32 ones. bfloat16's
  7 bits qualify where `bfloat16` says the settings were measured in bfloat16 Gram space
  (`bfloat16_gram_measured`).
  """
  if gram is not None:
    return bool(gram)
  m, n = min(m, n), max(m, n)
  mantissa = jnp.finfo(compute_dtype).nmant
  return (steps >= 2 and n >= GRAM_MIN_ASPECT * m
          and (mantissa >= GRAM_MIN_MANTISSA
               or (bfloat16 and jnp.dtype(compute_dtype) == jnp.bfloat16)))


def bfloat16_gram_measured(ns: NewtonSchulz) -> bool:
  """Whether `ns` is one of GRAM_BFLOAT16_PRESETS at its own steps and scaling."""
  return (isinstance(ns.coeffs, str) and ns.coeffs in GRAM_BFLOAT16_PRESETS
          and ns.steps in (None, ns.preset.steps)
          and ns.precondition in (None, ns.preset.precondition))


def shared_settings(ns: NewtonSchulz, devices: int) -> NewtonSchulz:
  """The settings of a matrix shared by `devices` devices (`newton_schulz_column_parts`):
  `ns` on one; on more, with 16-bit operands and the variant left automatic, the
  standard iteration. There
  Gram space's centred m×m copies are gathered and held beside the matrix's part, past
  what the memory cap prices (v5p, Llama-3-8B on 256 chips: 2.58× the state shard,
  against the standard iteration's 1.94×)."""
  if devices > 1 and ns.fn is None and ns.gram is None and ns.dtype().itemsize < 4:
    return dataclasses.replace(ns, gram=False)
  return ns


def whole_product_flops(m: int, k: int, *, of: ProductOf = "x_xt",
                        n: Optional[int] = None) -> int:
  """Matmul flops of an m×m product with inner dimension k, computed whole (`of` and
  `n`, as in `symmetric_flops`, change nothing)."""
  return 2 * m * m * k


def gram_flops(m: int, n: int, parts: Sequence[tuple[int, int]],
               quintic: Optional[Sequence[bool]] = None,
               product: Callable[[int, int], int] = symmetric_flops) -> int:
  """Matmul flops of the Gram-space iteration on one m×n matrix, in these segments.

  With m ≤ n: R = X Xᵀ (symmetric: `symmetric_flops`) and the final Q X (2m²n), and so
  do each restart's R ← X Xᵀ and X ← Q X. Inside a segment of k steps, each quintic
  step squares R (a cubic one, c = 0, does not: `quintic`, per step, default all), all
  but the first update Q ← P Q and all but the last update R ← P (P R): products of
  commuting symmetric m×m matrices, each symmetric. `product(m, k, of=...)` counts a
  symmetric product (`whole_product_flops` where they are computed whole).
  """
  m, n = min(m, n), max(m, n)
  steps = max((stop for _, stop in parts), default=0)
  squares = steps if quintic is None else sum(map(bool, quintic[:steps]))
  return ((product(m, n, of="gram_space_x_xt", n=n) + 2 * m * m * n) * len(parts)
          + (squares + sum(3 * (stop - start - 1) for start, stop in parts))
          * product(m, m, of="gram_space"))


def standard_flops(m: int, n: int, steps: int, quintic: Optional[Sequence[bool]] = None,
                   product: Callable[[int, int], int] = symmetric_flops) -> int:
  """Matmul flops of the standard iteration on one m×n matrix: per step, the symmetric
  A = X Xᵀ (`product`, as in `gram_flops`) and the m×n (a I + …) X (2m²n); per quintic
  step (`quintic`, default all), the symmetric b A + c A²."""
  m, n = min(m, n), max(m, n)
  squares = steps if quintic is None else sum(map(bool, quintic[:steps]))
  return (product(m, n) + 2 * m * m * n) * steps + squares * product(m, m, of="squares", n=n)


def quintic_steps(coeffs: Any) -> Optional[list[bool]]:
  """Per step of a (steps, 3) table, whether it has a (X Xᵀ)² term (c ≠ 0); None if
  the table is traced (every step then computes it)."""
  if isinstance(coeffs, jax.core.Tracer):
    return None
  return [float(c) != 0.0 for c in np.asarray(coeffs)[:, 2]]


class NSPlan(NamedTuple):
  """What `newton_schulz` runs on one matrix shape."""

  variant: str  # "standard" or "gram"
  steps: int
  precondition: str
  compute_dtype: str
  precision: str
  flops: int  # matmul flops per matrix
  segments: tuple[tuple[int, int], ...]  # Gram-space runs between restarts; () if standard
  x_flops: int  # the part of `flops` in products with the m×n X (split with its columns)
  fp8_steps: int = 0  # the first steps with float8 (e4m3) operands, scaled per matrix

  def __str__(self) -> str:
    return (f"{self.variant} · {self.steps} steps · {self.precondition} · "
            f"{self.compute_dtype} operands, float32 accumulation · precision "
            f"{self.precision}" + (f" · first {self.fp8_steps} steps float8_e4m3fn operands"
                                   if self.fp8_steps else ""))


def newton_schulz_plan(shape: tuple[int, ...], ns: NS = DEFAULT_NS, *,
                       backend: Optional[str] = None, symmetric: bool = True) -> NSPlan:
  """The variant, steps, dtype, precision and flops `newton_schulz` uses on `shape`
  (..., m, n) with settings `ns`, on `backend` ("cpu", "gpu", "tpu"; default: jax's,
  which is what `newton_schulz` resolves "auto" against).

  Standard iteration: steps · (4m²n + 2m³) flops with m ≤ n (a cubic step, c = 0,
  skips the 2m³), less what symmetric products save (`standard_flops`). Gram-space: see
  `newton_schulz` and `gram_flops`; its restarts are where rounding would otherwise
  grow. `symmetric=False` counts every product whole, as a mesh that splits the m×m
  products by rows computes them.

  Examples:
    >>> import muon_optax as mo
    >>> print(mo.newton_schulz_plan((768, 3072), backend="cpu"))
    gram · 4 steps · aol · float32 operands, float32 accumulation · precision HIGHEST
  """
  ns = as_newton_schulz(ns)
  if len(shape) < 2:
    raise ValueError(f"newton_schulz_plan needs a shape (..., m, n), got {tuple(shape)}")
  if ns.fn is not None:
    raise ValueError("newton_schulz_plan describes the built-in iteration; this NewtonSchulz "
                     "runs a custom fn.")
  m, n = sorted(shape[-2:])
  steps, dtype, coeffs = ns.num_steps(), ns.dtype(backend), ns.coefficients()
  quintic = quintic_steps(coeffs)
  product = (functools.partial(symmetric_flops, backend=backend) if symmetric
             else whole_product_flops)
  if not ns.fp8_steps and use_gram(m, n, steps, ns.gram, dtype,
                                   bfloat16_gram_measured(ns)):
    parts = tuple(segments(steps, gram_restarts(slopes_of(coeffs), steps, dtype)))
    variant, flops = "gram", gram_flops(m, n, parts, quintic, product)
  else:
    variant, parts, flops = "standard", (), standard_flops(m, n, steps, quintic, product)
  x_xt = product(m, n, of="gram_space_x_xt" if parts else "x_xt", n=n)
  x_flops = (x_xt + 2 * m * m * n) * (len(parts) if parts else steps)
  return NSPlan(variant, steps, ns.preconditioner(), dtype.name,
                ns.matmul_precision(backend).name, flops, parts, x_flops, ns.fp8_steps)


def newton_schulz_flops(m: int, n: int, ns: NS = DEFAULT_NS, *,
                        backend: Optional[str] = None) -> int:
  """Matmul flops of `newton_schulz` with settings `ns` on one m×n matrix."""
  return newton_schulz_plan((m, n), ns, backend=backend).flops
