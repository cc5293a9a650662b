"""Build-time checks of optimizer hyperparameters, so a bad value fails where it is passed.

Only concrete Python and NumPy numbers have their range checked. A `jax.Array` passes
unchecked: under `optax.inject_hyperparams` (or inside `jit`) the values are arrays or
tracers, whose contents cannot be inspected without a device sync or at all.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np


def _concrete(name: str, value: Any, what: str) -> Any:
  """The value as a Python/NumPy number, None for a jax array, or a ValueError."""
  if isinstance(value, jax.Array):
    return None  # traced or injected: range unknown at build time
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be {what}, got {value!r} of type {type(value).__name__}.")
  return value


def learning_rate(name: str, value: Any) -> Any:
  """A finite number, a jax/numpy scalar array, or a schedule (a callable of the step)."""
  if callable(value):
    return value
  if isinstance(value, np.ndarray) and value.ndim:
    raise ValueError(f"{name} must be a scalar or a schedule, got an array of shape "
                     f"{value.shape}.")
  x = _concrete(name, value, "a number, a scalar array or a schedule (a callable of the step)")
  if x is not None and not np.isfinite(x):
    raise ValueError(f"{name} must be finite, got {value!r}.")
  return value


def weight_decay(name: str, value: Any) -> Any:
  """A number ≥ 0, a scalar array, or a schedule."""
  if callable(value):
    return value
  x = _concrete(name, value, "a number ≥ 0, a scalar array or a schedule")
  if x is not None and not (np.isfinite(x) and x >= 0):
    raise ValueError(f"{name} must be a finite number ≥ 0, got {value!r}.")
  return value


def decay_rate(name: str, value: Any) -> Any:
  """A number in [0, 1): an EMA decay such as beta, b1 or b2."""
  x = _concrete(name, value, "a number in [0, 1)")
  if x is not None and not 0 <= x < 1:
    raise ValueError(f"{name} must be in [0, 1), got {value!r}: 1 or more never forgets "
                     "(or grows without bound), below 0 flips sign every step.")
  return value


def positive(name: str, value: Any) -> Any:
  """A finite number > 0, such as eps."""
  x = _concrete(name, value, "a number > 0")
  if x is not None and not (np.isfinite(x) and x > 0):
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
  return value
