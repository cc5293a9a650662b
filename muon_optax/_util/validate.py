"""Checks of optimizer settings and inputs, so a bad value fails where it is passed with
a message that names it.

Concrete numbers (Python, NumPy, and jax arrays that are not traced) have their range
checked when the optimizer is built. A traced value cannot be: under
`optax.inject_hyperparams` (or inside `jit`) hyperparameters arrive as tracers, whose
contents are unknown until the step runs.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np


def _concrete(name: str, value: Any, what: str) -> Any:
  """The value as a Python/NumPy number, None for a traced one, or a ValueError."""
  if isinstance(value, jax.core.Tracer):
    return None  # traced or injected: range unknown at build time
  if isinstance(value, jax.Array):
    value = np.asarray(value)
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be {what}, got {value!r} of type {type(value).__name__}.")
  return value


def learning_rate(name: str, value: Any) -> Any:
  """A finite number ≥ 0, a jax/numpy scalar array, or a schedule (a callable of the step).

  A negative rate climbs the loss; a traced one (injected) is not checked."""
  if callable(value):
    return value
  if isinstance(value, (np.ndarray, jax.Array)) and value.ndim:
    raise ValueError(f"{name} must be a scalar or a schedule, got an array of shape "
                     f"{value.shape}.")
  x = _concrete(name, value, "a number, a scalar array or a schedule (a callable of the step)")
  if x is not None and not (np.isfinite(x) and x >= 0):
    raise ValueError(f"{name} must be a finite number ≥ 0, got {value!r}: a negative rate "
                     "ascends the loss, a NaN or infinite one destroys the params.")
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


def floating_dtype(name: str, value: Any) -> Any:
  """None, or a floating dtype (a state buffer of another dtype would stay zero)."""
  if value is None:
    return None
  if isinstance(value, (jax.Array, np.ndarray)):  # how inject_hyperparams passes it
    raise ValueError(f"{name} must be a dtype, got an array ({value!r}); under "
                     f"optax.inject_hyperparams, pass static_args=({name!r},).")
  try:
    dtype = jax.dtypes.canonicalize_dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
    raise ValueError(f"{name} must be None or a floating dtype such as jnp.bfloat16, got "
                     f"{value!r}.")
  return dtype
