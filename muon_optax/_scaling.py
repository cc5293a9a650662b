"""Shape-dependent update scaling, so one learning rate suits every matrix shape."""

from __future__ import annotations

import math
from typing import Optional

import jax
import optax

from muon_optax import _paths
from muon_optax._matrix_view import ViewFn, view_fn
from muon_optax._orthogonalize import matrix_view_of

SCALES = ("jordan", "moonlight", None)


def shape_factor(scale: Optional[str], fan_in: int, fan_out: int) -> float:
  """jordan: √max(1, fan_out/fan_in); moonlight: 0.2·√max(fan_in, fan_out); None: 1."""
  if scale == "jordan":
    return math.sqrt(max(1.0, fan_out / fan_in))
  if scale == "moonlight":
    return 0.2 * math.sqrt(max(fan_in, fan_out))
  if scale is None:
    return 1.0
  raise ValueError(f"unknown scale {scale!r}; choose one of {list(SCALES)}.")


def scale_by_shape(
    scale: Optional[str] = "jordan",
    *,
    views: Optional[ViewFn] = None,
    per_head: bool = False,
) -> optax.GradientTransformation:
  """Multiplies each Muon update by a factor of its matrix view's (fan_in, fan_out).

  - "jordan": √max(1, fan_out / fan_in) (Keller Jordan's reference);
  - "moonlight": 0.2·√max(fan_in, fan_out), matching AdamW's update RMS so that
    AdamW's learning rate and weight decay transfer (Liu et al. 2025, arXiv 2502.16982);
  - None: no scaling.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.scale_by_shape("moonlight")
    >>> u, _ = tx.update({"w": jnp.ones((16, 64))}, tx.init(None))
    >>> round(float(u["w"][0, 0]), 6)  # 0.2 · √64
    1.6
  """
  shape_factor(scale, 1, 1)  # validate now, not at the first update
  views = view_fn(views, per_head)

  def scale_leaf(path, x):
    _, fan_in, fan_out = matrix_view_of(views, path, x).matrix_shape(x.shape)
    return x * jax.numpy.asarray(shape_factor(scale, fan_in, fan_out), x.dtype)

  def update_fn(updates, state, params=None):
    del params
    return _paths.map_with_path(scale_leaf, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
