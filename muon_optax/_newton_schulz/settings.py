"""Newton–Schulz settings: the coefficient presets and `NewtonSchulz`, the one value that
says how the iteration runs, checked when it is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

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


# DeepSeek-V4 (as carried by MaxText and NVIDIA Emerging-Optimizers): 8 of Jordan's steps
# bring σ in [1e-4, 1] into his band, then 2 of σ ← 2σ − 1.5σ³ + 0.5σ⁵ (slope 0 at σ = 1)
# pin it there: σ lands in [1 − 1e-15, 1.0021].
_DEEPSEEK_V4 = _JORDAN * 8 + ((2.0, -1.5, 0.5),) * 2

# cubic5 (Huang 2026, "How much orthogonalization does Muon need?", arXiv 2606.00371):
# five cubic steps σ ← aσ + bσ³ (c = 0: two matmuls a step, no (X Xᵀ)²), relaxed to
# Muon's loose band: σ in [1e-2, 1] lands in [0.774, 1.300]; σ = 1e-3 only reaches 0.12.
_CUBIC5 = (
    (3.3656576, -3.3420992, 0.0),
    (2.5744352, -1.4957376, 0.0),
    (2.5368962, -1.4312570, 0.0),
    (2.4418906, -1.2764040, 0.0),
    (2.2230472, -0.9630650, 0.0),
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
    "deepseek_v4": Preset(np.asarray(_DEEPSEEK_V4), 1.0, "frobenius", 10),
    "cubic5": Preset(np.asarray(_CUBIC5), 1.0, "frobenius", 5),
}
PRECONDITIONS = ("frobenius", "aol")


def _table(coeffs: Any) -> Any:
  """A checked (n, 3) coefficient table: a tuple of float rows, or a traced array (a
  table injected by `optax.inject_hyperparams` is traced; only its shape is checked)."""
  try:
    table = np.asarray(coeffs, dtype=np.float64)
  except jax.errors.TracerArrayConversionError:
    table = jnp.asarray(coeffs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"NewtonSchulz coeffs must be a preset name {sorted(PRESETS)} or an "
                     f"(n, 3) array of (a, b, c) rows: {e}") from None
  if table.shape == (3,):
    table = table[None]
  if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0:
    raise ValueError(
        f"a Newton–Schulz table must have shape (n, 3) with n >= 1, got {table.shape}; "
        "each row is the (a, b, c) of a X + b (X Xᵀ) X + c (X Xᵀ)² X.")
  if not isinstance(table, np.ndarray):
    return table
  if not np.all(np.isfinite(table)):
    raise ValueError("a Newton–Schulz table must hold finite coefficients only.")
  return tuple(tuple(float(c) for c in row) for row in table)


def _compute_dtype(value: Any) -> Any:
  if isinstance(value, str) and value == "auto":
    return value
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"NewtonSchulz compute_dtype must be 'auto' or a floating dtype, got "
                     f"{value!r}.")
  return dtype


def _precision(value: Any) -> Any:
  if isinstance(value, str) and value == "auto":
    return value
  if isinstance(value, str) and value.upper() in jax.lax.Precision.__members__:
    return jax.lax.Precision[value.upper()]
  try:
    return jax.lax.Precision(value)
  except (TypeError, ValueError):
    raise ValueError(f"NewtonSchulz precision must be 'auto' or a jax.lax.Precision (or its "
                     f"name), got {value!r}.") from None


def _backend(backend: Optional[str]) -> str:
  return backend or jax.default_backend()


@dataclasses.dataclass(frozen=True)
class NewtonSchulz:
  """How Newton–Schulz runs: one value, checked when built, accepted wherever it runs
  (`muon` and the family, `scale_by_muon`, `orthogonalize`, `newton_schulz`,
  `newton_schulz_plan`, `describe`). A preset name stands for `NewtonSchulz(name)`.

  Args:
    coeffs: a preset ("turbo", "jordan", "polar_express", "deepseek_v4", "cubic5"; see
      `PRESETS`) or an (n, 3)
      table of (a, b, c) rows. A table shorter than `steps` repeats its last row.
    steps: iterations (a Python int); None takes the preset's (a table: its rows).
    gram: True for the Gram-space iteration, False for the standard one, None to choose
      per matrix shape and dtype (see `newton_schulz`).
    precondition: "frobenius", "aol", or None for the preset's own (a table: frobenius).
    compute_dtype: matmul operand dtype, or "auto": bfloat16 on GPU and TPU, float32 on
      CPU. Products accumulate in float32. float16 (on GPU) has 3 more bits than
      bfloat16, enough for the Gram-space iteration to run as accurately as in float32;
      with bfloat16 `use_gram` picks Gram space for turbo alone
      (benchmarks/results/newton_schulz_precision.txt).
    precision: matmul precision, or "auto": HIGHEST on CPU, DEFAULT on accelerators.
    fp8_steps: how many of the first steps read their operands as float8 (e4m3), each
      matrix scaled by a power of two so that its largest entry is 128 to 256 (a Python
      int, 0 by default; fewer than the steps). They run the standard iteration: Gram
      space cannot hold its state in 8 bits. An option, not a default, for gentle
      schedules ("jordan"): a steep first step ("turbo") cancels large terms that 8 bits
      cannot hold, and diverges on some inputs
      (benchmarks/results/newton_schulz_precision.txt).
    fn: any function from a (count, m, n) stack of wide matrices (m ≤ n) to an array of
      the same shape (a Pallas kernel, another polynomial); it replaces the built-in
      iteration, so the other settings must keep their defaults.

  Examples:
    >>> import muon_optax as mo
    >>> mo.NewtonSchulz("jordan", steps=5, gram=False).coefficients().shape
    (5, 3)
  """

  coeffs: Any = "turbo"
  steps: Optional[int] = None
  gram: Optional[bool] = None
  precondition: Optional[str] = None
  compute_dtype: Any = "auto"
  precision: Any = "auto"
  fp8_steps: int = 0
  fn: Optional[Callable[[jax.Array], jax.Array]] = None

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    if isinstance(self.coeffs, str):
      if self.coeffs not in PRESETS:
        raise ValueError(f"unknown Newton–Schulz preset {self.coeffs!r}; choose one of "
                         f"{sorted(PRESETS)} or pass an (n, 3) array of (a, b, c) rows.")
    else:
      set_("coeffs", _table(self.coeffs))
    if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(
        self.steps, (int, np.integer)) or self.steps < 1):
      raise ValueError(f"NewtonSchulz steps must be a positive Python int or None, got "
                       f"{self.steps!r}.")
    if self.steps is not None:
      set_("steps", int(self.steps))
    if not (self.gram is None or isinstance(self.gram, (bool, np.bool_))):
      raise ValueError(f"NewtonSchulz gram must be True, False or None (per shape), got "
                       f"{self.gram!r}.")
    if self.precondition not in (None, *PRECONDITIONS):
      raise ValueError(f"NewtonSchulz precondition must be one of {PRECONDITIONS} or None, "
                       f"got {self.precondition!r}.")
    if isinstance(self.fp8_steps, bool) or not isinstance(self.fp8_steps, (int, np.integer)) \
        or not 0 <= self.fp8_steps < self.num_steps():
      raise ValueError(f"NewtonSchulz fp8_steps must be a Python int from 0 to steps - 1 "
                       f"({self.num_steps() - 1}): the last step reads wider operands; got "
                       f"{self.fp8_steps!r}.")
    set_("fp8_steps", int(self.fp8_steps))
    if self.fp8_steps and self.gram:
      raise ValueError("NewtonSchulz fp8_steps run in the standard iteration (Gram space "
                       "cannot hold its state in 8 bits); pass gram=False or None with them.")
    set_("compute_dtype", _compute_dtype(self.compute_dtype))
    set_("precision", _precision(self.precision))
    if self.fn is not None:
      if not callable(self.fn):
        raise ValueError(f"NewtonSchulz fn must be a function of a (count, m, n) array, got "
                         f"{self.fn!r}.")
      given = [name for name, value in (
          ("coeffs", not (isinstance(self.coeffs, str) and self.coeffs == "turbo")),
          ("steps", self.steps is not None), ("gram", self.gram is not None),
          ("precondition", self.precondition is not None),
          ("compute_dtype", not isinstance(self.compute_dtype, str)),
          ("fp8_steps", self.fp8_steps != 0),
          ("precision", not isinstance(self.precision, str))) if value]
      if given:
        raise ValueError(f"NewtonSchulz fn replaces the built-in iteration, so {given} would "
                         "be ignored; pass either fn or those settings, not both.")

  @property
  def preset(self) -> Optional[Preset]:
    return PRESETS[self.coeffs] if isinstance(self.coeffs, str) else None

  def num_steps(self) -> int:
    """`steps`, or the preset's (a table: its row count)."""
    if self.steps is not None:
      return self.steps
    return self.preset.steps if self.preset else len(self.coeffs)

  def coefficients(self) -> Any:
    """The (steps, 3) coefficients, one row per step: a short table repeats its last row
    and never wraps around (the first rows of tuned schedules are far too aggressive)."""
    table = self.preset.table if self.preset else self.coeffs
    table = table if isinstance(table, (np.ndarray, jax.Array)) else np.asarray(table)
    return table[np.minimum(np.arange(self.num_steps()), len(table) - 1)]

  def safety(self) -> float:
    """Frobenius normalization divides by ‖X‖_F · safety."""
    return self.preset.safety if self.preset else 1.0

  def preconditioner(self) -> str:
    """`precondition`, or the preset's own (a table: "frobenius")."""
    if self.precondition is not None:
      return self.precondition
    return self.preset.precondition if self.preset else "frobenius"

  def dtype(self, backend: Optional[str] = None) -> jnp.dtype:
    """The matmul operand dtype on `backend` (default: jax's)."""
    if isinstance(self.compute_dtype, str):
      return jnp.dtype(AUTO_DTYPES.get(_backend(backend), jnp.bfloat16))
    return self.compute_dtype

  def on(self, backend: str) -> NewtonSchulz:
    """These settings with "auto" operands and precision fixed for `backend`: what runs
    on a mesh of that platform's devices, whatever jax's default backend is."""
    return dataclasses.replace(self, compute_dtype=self.dtype(backend),
                               precision=self.matmul_precision(backend))

  def matmul_precision(self, backend: Optional[str] = None) -> jax.lax.Precision:
    """HIGHEST on CPU (free there), DEFAULT on accelerators, where HIGHEST makes float32
    cost several bfloat16 passes (TPU) or turns off TF32 (GPU); or the given one."""
    if isinstance(self.precision, str):
      cpu = _backend(backend) == "cpu"
      return jax.lax.Precision.HIGHEST if cpu else jax.lax.Precision.DEFAULT
    return self.precision


# "auto" operands per platform: float32 on CPU, bfloat16 elsewhere. On GPU, float16 (as
# fast on tensor cores, 3 more bits) lets Gram space run as accurately as float32, but
# its convergence check trained worse on average than bfloat16's
# (benchmarks/results/newton_schulz_precision.txt). float16 is not native on TPU.
AUTO_DTYPES = {"cpu": jnp.float32, "gpu": jnp.bfloat16, "tpu": jnp.bfloat16}

NS = Union[str, NewtonSchulz]
DEFAULT_NS = NewtonSchulz()


def as_newton_schulz(ns: Any) -> NewtonSchulz:
  """`ns` as a `NewtonSchulz`: a preset name or an (n, 3) table is shorthand for one."""
  if isinstance(ns, NewtonSchulz):
    return ns
  if ns is None:
    return DEFAULT_NS
  if callable(ns):
    raise ValueError("to plug in your own orthogonalization pass ns=NewtonSchulz(fn=...).")
  return NewtonSchulz(ns)
