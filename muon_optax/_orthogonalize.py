"""Orthogonalize every Muon leaf through its matrix view, one Newton–Schulz call per shape group."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from muon_optax import _paths
from muon_optax._matrix_view import MatrixView, ViewFn, default_view, from_matrices, to_matrices
from muon_optax._newton_schulz import Schedule, coefficient_schedule, newton_schulz


def view_fn(views: Optional[ViewFn], per_head: bool) -> ViewFn:
  """The user's view function, or the default one with `per_head`."""
  return views or (lambda path, shape: default_view(path, shape, per_head=per_head))


def matrix_view_of(views: ViewFn, path: str, leaf: Any) -> MatrixView:
  view = views(path, tuple(leaf.shape))
  if view is None:
    raise ValueError(
        f"parameter {path!r} of shape {tuple(leaf.shape)} reached Muon but has no matrix "
        "view; route it to 'adam' or pass views= to say how it is a matrix.")
  if not jnp.issubdtype(leaf.dtype, jnp.floating):
    raise ValueError(
        f"parameter {path!r} reached Muon with dtype {leaf.dtype}; Muon needs real "
        "floating updates. Route it to 'adam' or 'frozen'.")
  return view


class _Wide(NamedTuple):
  """One leaf as a stack of wide (rows ≤ cols) matrices, and how to undo that."""

  stack: jax.Array  # (count, rows, cols), rows ≤ cols
  view: MatrixView
  transposed: bool


def _to_wide(leaf: jax.Array, view: MatrixView) -> _Wide:
  m = to_matrices(leaf, view)
  tall = m.shape[-2] > m.shape[-1]
  return _Wide(jnp.swapaxes(m, -1, -2) if tall else m, view, tall)


def _from_wide(stack: jax.Array, wide: _Wide, shape: tuple[int, ...]) -> jax.Array:
  m = jnp.swapaxes(stack, -1, -2) if wide.transposed else stack
  return from_matrices(m, wide.view, shape)


GroupFn = Callable[[jax.Array], jax.Array]


def orthogonalize_leaves(updates: Any, views: ViewFn, group_fn: GroupFn) -> Any:
  """Applies `group_fn` to one (count, rows, cols) stack per (rows, cols, dtype) group
  and returns the updates with each Muon leaf replaced by its slice of the result."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_paths.is_masked)
  wides, groups = {}, {}
  for i, (path, leaf) in enumerate(flat):
    if _paths.is_masked(leaf):
      continue
    wide = _to_wide(leaf, matrix_view_of(views, _paths.path_str(path), leaf))
    wides[i] = wide
    key = (*wide.stack.shape[1:], wide.stack.dtype)
    groups.setdefault(key, []).append(i)
  out = [leaf for _, leaf in flat]
  for members in groups.values():
    stacked = jnp.concatenate([wides[i].stack for i in members]) if len(members) > 1 \
        else wides[members[0]].stack
    result = group_fn(stacked)
    start = 0
    for i in members:
      count = wides[i].stack.shape[0]
      out[i] = _from_wide(result[start:start + count], wides[i], flat[i][1].shape)
      start += count
  return jax.tree_util.tree_unflatten(treedef, out)


def orthogonalize(
    ns: Schedule = "jordan",
    ns_steps: int = 5,
    *,
    views: Optional[ViewFn] = None,
    per_head: bool = False,
    compute_dtype: Any = "float32",
) -> optax.GradientTransformation:
  """Replaces each update by Newton–Schulz's orthogonalization of its matrix view.

  Same-shape matrices (after orienting each wide) are stacked and orthogonalized by
  one batched call, which equals orthogonalizing them one by one. The state is
  empty, so it does not depend on the preset.

  Args:
    ns: a preset name ("jordan", "polar_express") or an (n, 3) coefficient schedule.
    ns_steps: Newton–Schulz iterations.
    views: (path, shape) -> MatrixView | None; None uses `default_view`.
    per_head: with the default views, orthogonalize each attention head on its own.
    compute_dtype: dtype of the iteration (float32 by default).

  Returns:
    A stateless `optax.GradientTransformation`.

  Example:
    >>> import jax, muon_optax as mo
    >>> tx = mo.orthogonalize("polar_express")
    >>> g = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> u, _ = tx.update(g, tx.init(g))
  """
  coefficient_schedule(ns, ns_steps)  # fail early on a bad schedule
  views = view_fn(views, per_head)
  group_fn = lambda stack: newton_schulz(stack, ns=ns, steps=ns_steps, compute_dtype=compute_dtype)

  def update_fn(updates, state, params=None):
    del params
    return orthogonalize_leaves(updates, views, group_fn), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
