"""Hyperball: each matrix stays on the sphere of its initial Frobenius norm, moved along
it by a step relative to that norm, instead of being decayed."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from muon_optax._routing.matrix_view import MatrixView, matrix_view_of
from muon_optax._routing.value import RoutingLike, as_routing
from muon_optax._util import paths, validate
from muon_optax._util.types import ScalarOrSchedule


class HyperballState(NamedTuple):
  count: jax.Array  # int32 scalar: steps taken (for a schedule).
  # Per matrix of each leaf's view: its Frobenius norm at init, float32 (float64 for
  # float64 params), the leaf's shape with its matrix axes of size 1 (full-size where
  # the view cuts the fan-out into blocks).
  radius: optax.Updates


def _matrix_norms(x: jax.Array, view: MatrixView, dtype: Any) -> jax.Array:
  """‖·‖_F of each matrix of the view, broadcastable against the leaf."""
  x = x.astype(dtype)
  return jnp.sqrt(view.matrix_sums(x * x))


def _refuse_zero_norms(path: str, radius: ArrayLike, eps: ArrayLike) -> None:
  if np.any(np.asarray(radius) <= np.asarray(eps)):
    raise ValueError(f"{path}: a matrix of norm zero cannot keep its norm on the hyperball "
                     "(it would never move). Initialize it nonzero, or route it elsewhere.")


def hyperball(learning_rate: ScalarOrSchedule = 0.01, *, eps: ArrayLike = 1e-10,
              routing: RoutingLike = None) -> optax.GradientTransformation:
  """The step of a direction U on the sphere of each matrix's initial norm r:

      W' = r · (W − lr·r·U/‖U‖_F) / ‖W − lr·r·U/‖U‖_F‖_F

  so every matrix moves by about lr·r whatever U's scale, and ‖W'‖_F = r always: the
  sphere takes the place of weight decay. Norms are per matrix of the leaf's matrix view
  (a layer of a stack, an expert). It outputs W' − W, so it ends a chain (it replaces
  weight decay and the learning rate) and its update needs the params.

  Args:
    learning_rate: the step relative to r (≥ 0), or a schedule of the step.
    eps: floor of the norms divided by, > 0.
    routing: gives the matrix views (None: `default_view`).

  Returns:
    An `optax.GradientTransformation` with a `HyperballState`. Init raises a ValueError
    naming a matrix whose norm is zero (its sphere is a point): at once on concrete
    params, when the init runs under `jax.jit` (an XLA runtime error that carries it). A
    zero-initialized matrix needs another init to train this way.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, muon_optax as mo
    >>> tx = optax.chain(mo.scale_by_muon(scale=None), mo.hyperball(0.05))
    >>> p = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> u, _ = tx.update(p, tx.init(p), p)
    >>> bool(jnp.allclose(jnp.linalg.norm(p["w"] + u["w"]), jnp.linalg.norm(p["w"])))
    True

  References:
    "Hyperball" / MuonH, arXiv 2606.16899.
  """
  validate.learning_rate("learning_rate", learning_rate)
  validate.positive("eps", eps)
  views = as_routing(routing).view

  def init_leaf(path, p):
    view = matrix_view_of(views, path, p).normalize(p.ndim)
    radius = _matrix_norms(p, view, jnp.promote_types(p.dtype, jnp.float32))
    if p.size and isinstance(radius, jax.core.Tracer):
      # Traced (jax.jit(tx.init), as on a mesh): checked when the init runs.
      jax.debug.callback(functools.partial(_refuse_zero_norms, path), radius, eps)
    elif p.size:
      _refuse_zero_norms(path, radius, eps)
    return radius

  def init_fn(params):
    return HyperballState(jnp.zeros([], jnp.int32), paths.map_with_path(init_leaf, params))

  def step_leaf(path, u, radius, p, lr):
    if not u.size:
      return u
    view = matrix_view_of(views, path, u).normalize(u.ndim)
    u_norm = jnp.maximum(_matrix_norms(u, view, radius.dtype), eps)
    w = p.astype(radius.dtype)
    moved = w - (lr * radius / u_norm) * u.astype(radius.dtype)
    projected = moved * (radius / jnp.maximum(_matrix_norms(moved, view, radius.dtype), eps))
    return (projected - w).astype(u.dtype)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("hyperball needs the params: call update(updates, state, params).")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    out = paths.map_with_path(lambda path, u, r, p: step_leaf(path, u, r, p, lr),
                              updates, state.radius, params)
    return out, HyperballState(optax.safe_increment(state.count), state.radius)

  return optax.GradientTransformation(init_fn, update_fn)
