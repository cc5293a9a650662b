"""Newton–Schulz settings: coefficient presets, platform defaults, flop counts, and
`newton_schulz_plan`, which says what will run for a matrix shape."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

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

# For AOL preconditioning (σ ≤ 1 exactly after the rescaling): greedy minimax odd
# quintics as in the Polar Express construction, 4 steps, first on [4e-3, 1.05], then
# each on the previous step's image with its top widened by 5%, so that bfloat16
# rounding cannot carry σ past the steep rise of the next quintic. σ in [4e-3, 1.05]
# lands in [0.825, 1.175].
_TURBO = (
    (7.951518841534428, -21.27579156824606, 14.298168408212595),
    (3.8143756872188255, -2.5821557451963786, 0.44531995889015424),
    (3.2684254666578316, -2.235316729811077, 0.4123990701159953),
    (2.338941957089388, -1.5862223172358558, 0.35430176694431165),
)


class Preset(NamedTuple):
  table: np.ndarray  # (rows, 3) coefficients (a, b, c)
  safety: float  # Frobenius normalization divides by ‖X‖_F · safety
  precondition: str  # "frobenius" or "aol"
  steps: int  # default number of steps


PRESETS = {
    "jordan": Preset(np.asarray(_JORDAN), 1.0, "frobenius", 5),
    "polar_express": Preset(np.asarray(_POLAR_EXPRESS), 1.01, "frobenius", 5),
    "turbo": Preset(np.asarray(_TURBO), 1.0, "aol", 4),
}
PRECONDITIONS = ("frobenius", "aol")
# What `muon`, `orthogonalize` and `newton_schulz` run when not told otherwise.
DEFAULT_NS = "turbo"

Schedule = Union[str, np.ndarray, jax.Array, tuple]


def _table(ns: Schedule) -> tuple[np.ndarray, Optional[Preset]]:
  if isinstance(ns, str):
    if ns not in PRESETS:
      raise ValueError(
          f"unknown Newton–Schulz preset {ns!r}; choose one of {sorted(PRESETS)} "
          "or pass an (n, 3) array of (a, b, c) coefficients.")
    return PRESETS[ns].table, PRESETS[ns]
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
        f"{table.shape}; each row is the (a, b, c) of a X + b (X Xᵀ) X + c (X Xᵀ)² X.")
  if isinstance(table, np.ndarray) and not np.all(np.isfinite(table)):
    raise ValueError("a Newton–Schulz schedule must hold finite coefficients only.")
  return table, None


def resolve_steps(ns: Schedule, steps: Optional[int]) -> int:
  """`steps`, or when None the preset's default (a custom table: its row count)."""
  if steps is None:
    table, preset = _table(ns)
    return preset.steps if preset else len(table)
  if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
    raise ValueError(
        f"ns_steps must be a positive Python int or None, got {steps!r}. Under "
        "optax.inject_hyperparams pass static_args=('ns_steps',).")
  return int(steps)


def resolve_precondition(ns: Schedule, precondition: Optional[str]) -> str:
  """`precondition`, or when None the preset's own (a custom table: "frobenius")."""
  if precondition is None:
    preset = _table(ns)[1]
    return preset.precondition if preset else "frobenius"
  if precondition not in PRECONDITIONS:
    raise ValueError(f"precondition must be one of {PRECONDITIONS} or None, got "
                     f"{precondition!r}")
  return precondition


def coefficient_schedule(ns: Schedule, steps: Optional[int] = None) -> tuple[np.ndarray, float]:
  """Returns the (steps, 3) coefficients and the norm safety factor of `ns`.

  A schedule shorter than `steps` repeats its last row; it never wraps around to
  its first row (the first rows of tuned schedules are far too aggressive to reuse).
  """
  steps = resolve_steps(ns, steps)
  table, preset = _table(ns)
  rows = np.minimum(np.arange(steps), len(table) - 1)
  return table[rows], preset.safety if preset else 1.0


def _backend(backend: Optional[str]) -> str:
  return backend or jax.default_backend()


def resolve_compute_dtype(compute_dtype, backend: Optional[str] = None) -> jnp.dtype:
  """"auto": bfloat16 operands on GPU and TPU (float32 accumulation), float32 on CPU."""
  if isinstance(compute_dtype, str) and compute_dtype == "auto":
    return jnp.dtype(jnp.float32 if _backend(backend) == "cpu" else jnp.bfloat16)
  try:
    dtype = jnp.dtype(compute_dtype)
  except TypeError:
    raise ValueError(f"compute_dtype must be 'auto' or a floating dtype, got "
                     f"{compute_dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"compute_dtype must be 'auto' or a floating dtype, got {compute_dtype!r}")
  return dtype


def resolve_precision(precision, backend: Optional[str] = None) -> jax.lax.Precision:
  """"auto": HIGHEST on CPU (it costs nothing there), DEFAULT on accelerators, where
  HIGHEST makes float32 cost several bfloat16 passes (TPU) or turns off TF32 (GPU)."""
  if isinstance(precision, str) and precision == "auto":
    cpu = _backend(backend) == "cpu"
    return jax.lax.Precision.HIGHEST if cpu else jax.lax.Precision.DEFAULT
  if isinstance(precision, str) and precision.upper() in jax.lax.Precision.__members__:
    return jax.lax.Precision[precision.upper()]
  try:
    return jax.lax.Precision(precision)
  except (TypeError, ValueError):
    raise ValueError(f"precision must be 'auto' or a jax.lax.Precision, got "
                     f"{precision!r}") from None


# Gram-space iteration: the m×m state is rebuilt from X before these steps (0-based).
# Rounding in R = X Xᵀ is amplified by the product of the a coefficients; one restart
# after step 2 (as in Gram Newton–Schulz) keeps a float32 evaluation within the same a
# priori error bound as the standard iteration (benchmarks/results/newton_schulz_gram.txt).
GRAM_RESTARTS = (2,)
# With 16-bit operands for R = X Xᵀ and Q X, one restart lets singular values leave
# the band; `gram_restarts` then restarts every 2 steps (same results file).
# Automatic choice: Gram-space when the long side is at least this many times the short
# one (the measured crossover; benchmarks/results/newton_schulz_gram.txt).
GRAM_MIN_ASPECT = 2


def gram_restarts(compute_dtype="auto", steps: int = 5) -> tuple[int, ...]:
  """Steps before which the Gram-space iteration rebuilds its state."""
  if resolve_compute_dtype(compute_dtype).itemsize >= 4:
    return GRAM_RESTARTS
  return tuple(range(2, steps, 2))


def segments(steps: int, restarts=GRAM_RESTARTS) -> list[tuple[int, int]]:
  """(start, stop) of each run of steps between Gram-space restarts."""
  cuts = [0] + [r for r in sorted(set(restarts)) if 0 < r < steps] + [steps]
  return list(zip(cuts[:-1], cuts[1:]))


def use_gram(m: int, n: int, steps: int, gram: Optional[bool] = None,
             compute_dtype="auto") -> bool:
  """Whether `newton_schulz` iterates in Gram space for an m×n matrix.

  `gram=None` (automatic) picks it when max(m, n) ≥ GRAM_MIN_ASPECT · min(m, n),
  steps ≥ 2 and the compute dtype has at least 32 bits: with 16-bit operands for
  R = X Xᵀ and the final Q X, Gram-space errors grow well past the standard
  iteration's (benchmarks/results/newton_schulz_gram.txt).
  """
  if gram is not None:
    return bool(gram)
  m, n = min(m, n), max(m, n)
  wide = resolve_compute_dtype(compute_dtype).itemsize >= 4
  return steps >= 2 and n >= GRAM_MIN_ASPECT * m and wide


def gram_newton_schulz_flops(m: int, n: int, steps: int, compute_dtype="float32") -> int:
  """Matmul flops of the Gram-space iteration (restarts included) on one m×n matrix.

  With m ≤ n: R = X Xᵀ and the final Q X cost 2m²n each, and so does each restart's
  X ← Q X, R ← X Xᵀ. Inside a segment of k steps each step squares R (2m³), all
  but the first update Q ← a Q + Z Q (2m³) and all but the last update
  R ← P (P R) (4m³): (8k − 6) m³ a segment.
  """
  m, n = min(m, n), max(m, n)
  parts = segments(steps, gram_restarts(compute_dtype, steps))
  return 4 * m * m * n * len(parts) + sum((8 * (stop - start) - 6) * m**3
                                          for start, stop in parts)


def newton_schulz_flops(m: int, n: int, steps: int, *, gram: Optional[bool] = None,
                        compute_dtype="auto") -> int:
  """Matmul flops of `newton_schulz` with these settings on one m×n matrix.

  Standard iteration (`gram=False`): steps · (4m²n + 2m³) with m ≤ n. `gram=True`
  counts the Gram-space iteration (`gram_newton_schulz_flops`); `gram=None` (the
  default, as in `newton_schulz`) counts whichever of the two runs (see `use_gram`).
  """
  if use_gram(m, n, steps, gram, compute_dtype):
    return gram_newton_schulz_flops(m, n, steps, compute_dtype)
  m, n = min(m, n), max(m, n)
  return steps * (4 * m * m * n + 2 * m * m * m)


class NSPlan(NamedTuple):
  """What `newton_schulz` runs on one matrix shape."""

  variant: str  # "standard" or "gram"
  steps: int
  precondition: str
  compute_dtype: str
  precision: str
  flops: int  # matmul flops per matrix

  def __str__(self) -> str:
    return (f"{self.variant} · {self.steps} steps · {self.precondition} · "
            f"{self.compute_dtype} operands, float32 accumulation · precision "
            f"{self.precision}")


def newton_schulz_plan(shape: tuple[int, ...], *, ns: Schedule = DEFAULT_NS,
                       steps: Optional[int] = None, gram: Optional[bool] = None,
                       compute_dtype="auto", precision="auto",
                       precondition: Optional[str] = None,
                       backend: Optional[str] = None) -> NSPlan:
  """The variant, steps, dtype and precision `newton_schulz` uses on `shape` (..., m, n).

  Args mirror `newton_schulz`; `backend` ("cpu", "gpu", "tpu") defaults to
  `jax.default_backend()`, which is what `newton_schulz` resolves "auto" against.

  Example:
    >>> import muon_optax as mo
    >>> print(mo.newton_schulz_plan((768, 3072), backend="cpu"))
    gram · 4 steps · aol · float32 operands, float32 accumulation · precision HIGHEST
  """
  m, n = shape[-2:]
  steps = resolve_steps(ns, steps)
  dtype = resolve_compute_dtype(compute_dtype, backend)
  gram_on = use_gram(m, n, steps, gram, dtype)
  flops = newton_schulz_flops(m, n, steps, gram=gram_on, compute_dtype=dtype)
  return NSPlan("gram" if gram_on else "standard", steps,
                resolve_precondition(ns, precondition), dtype.name,
                resolve_precision(precision, backend).name, flops)
