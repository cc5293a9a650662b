"""Scaling of the orthogonalized update: by its matrix shape, so one learning rate suits
every shape, or by the dual norm of the momentum (adaptive / PolarGrad)."""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp
import optax

from muon_optax._placement.shardings import explicit_spec, reshard_to
from muon_optax._routing.matrix_view import matrix_view_of
from muon_optax._routing.value import RoutingLike, as_routing
from muon_optax._util import paths

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


def scale_by_shape(scale: Optional[str] = "jordan", *, routing: RoutingLike = None
                   ) -> optax.GradientTransformation:
  """Multiplies each Muon update by a factor of its matrix view's (fan_in, fan_out).

  - "jordan": √max(1, fan_out / fan_in) (Keller Jordan's reference);
  - "moonlight": 0.2·√max(fan_in, fan_out), matching AdamW's update RMS so that
    AdamW's learning rate and weight decay transfer (Liu et al. 2025, arXiv 2502.16982);
  - None: no scaling.

  `routing` gives the matrix views (None: `default_view`).

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.scale_by_shape("moonlight")
    >>> u, _ = tx.update({"w": jnp.ones((16, 64))}, tx.init(None))
    >>> round(float(u["w"][0, 0]), 6)  # 0.2 · √64
    1.6
  """
  shape_factor(scale, 1, 1)  # validate now, not at the first update
  views = as_routing(routing).view

  def scale_leaf(path, x):
    _, fan_in, fan_out = matrix_view_of(views, path, x).matrix_shape(x.shape)
    if not x.size:  # an empty matrix: nothing to scale
      return x
    return x * jnp.asarray(shape_factor(scale, fan_in, fan_out), x.dtype)

  def update_fn(updates, state, params=None):
    del params
    return paths.map_with_path(scale_leaf, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scale_by_dual_norm(orthogonalizer: optax.GradientTransformation, *, routing: RoutingLike = None
                       ) -> optax.GradientTransformation:
  """O ← ⟨M, O⟩ · O per matrix, where O is `orthogonalizer`'s output for the input M.

  ⟨M, O⟩ = tr(Mᵀ O) is the dual norm of M for the spectral norm when O = U Vᵀ, its
  nuclear norm ‖M‖_* = Σσ: the orthogonal direction gets the step length of steepest
  descent under the spectral norm (PolarGrad; `optax.contrib.muon(adaptive=True)`).
  Each matrix of a leaf's view (a layer of a stack, an expert) gets its own factor.

  Args:
    orthogonalizer: usually `orthogonalize(ns)`.
    routing: gives the matrix views (None: `default_view`).

  Returns:
    A transform with `orthogonalizer`'s state.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> def polar(x):  # the exact polar factor, for the example
    ...   u, _, vt = jnp.linalg.svd(x, full_matrices=False)
    ...   return u @ vt
    >>> tx = mo.scale_by_dual_norm(mo.orthogonalize(mo.NewtonSchulz(fn=polar)))
    >>> m = {"w": jnp.diag(jnp.array([3.0, 1.0]))}
    >>> u, _ = tx.update(m, tx.init(m))  # polar factor I, nuclear norm 4
    >>> [round(float(v), 2) for v in jnp.diag(u["w"])]
    [4.0, 4.0]

  References:
    Lau, Long, Su 2025, "PolarGrad: A Class of Matrix-Gradient Optimizers from a Unifying
    Preconditioning Perspective", arXiv 2505.21799.
    Bernstein & Newhouse 2024, "Old optimizer, new norm: an anthology", arXiv 2409.20325.
  """
  views = as_routing(routing).view

  def scale_leaf(path, o, m):
    view = matrix_view_of(views, path, o).normalize(o.ndim)
    acc = jnp.promote_types(o.dtype, jnp.float32)
    m = reshard_to(m, explicit_spec(o))  # Explicit axes: one layout for the product
    dual = view.matrix_sums(m.astype(acc) * o.astype(acc))
    return (dual * o.astype(acc)).astype(o.dtype)

  def update_fn(updates, state, params=None):
    orthogonal, state = orthogonalizer.update(updates, state, params)
    return paths.map_with_path(scale_leaf, orthogonal, updates), state

  return optax.GradientTransformation(orthogonalizer.init, update_fn)
