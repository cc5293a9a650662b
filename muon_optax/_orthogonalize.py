"""Orthogonalize every Muon leaf through its matrix view, one Newton–Schulz call per shape group."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from muon_optax import _paths
from muon_optax._matrix_view import MatrixView, ViewFn, view_fn
from muon_optax._sharded_ns import sharded_solver
from muon_optax._newton_schulz import newton_schulz, newton_schulz_column_parts
from muon_optax._ns_plan import (
    DEFAULT_NS, Schedule, coefficient_schedule, resolve_compute_dtype, resolve_precondition,
    resolve_steps)


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
  m = view.to_matrices(leaf)
  tall = m.shape[-2] > m.shape[-1]
  return _Wide(jnp.swapaxes(m, -1, -2) if tall else m, view, tall)


def _from_wide(stack: jax.Array, wide: _Wide, shape: tuple[int, ...]) -> jax.Array:
  m = jnp.swapaxes(stack, -1, -2) if wide.transposed else stack
  return wide.view.from_matrices(m, shape)


# Orthogonalizes a list of wide (count, rows, cols) stacks, returning them in order.
Solver = Callable[[list[jax.Array]], list[jax.Array]]


def grouped_solver(ns_fn: Callable[[jax.Array], jax.Array]) -> Solver:
  """One `ns_fn` call per (rows, cols, dtype) group: same-shape matrices are
  concatenated into a single batch, which equals orthogonalizing them one by one."""

  def solve(stacks):
    groups = {}
    for i, s in enumerate(stacks):
      groups.setdefault((*s.shape[1:], s.dtype), []).append(i)
    out = [None] * len(stacks)
    for members in groups.values():
      batch = ns_fn(jnp.concatenate([stacks[i] for i in members]))
      start = 0
      for i in members:
        out[i] = batch[start:start + stacks[i].shape[0]]
        start += stacks[i].shape[0]
    return out

  return solve


def orthogonalize_leaves(updates: Any, views: ViewFn, solver: Solver, like: Any = None) -> Any:
  """Sees every Muon leaf as a stack of wide matrices, orthogonalizes all of them with
  `solver`, and puts each result back in its leaf's layout. With `like` (the params),
  the solver also gets their stacks, whose layout the results should take."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_paths.is_masked)
  wides = {i: _to_wide(leaf, matrix_view_of(views, _paths.path_str(path), leaf))
           for i, (path, leaf) in enumerate(flat) if not _paths.is_masked(leaf)}
  stacks = [w.stack for w in wides.values()]
  leaves = [] if like is None else jax.tree_util.tree_leaves(like, is_leaf=_paths.is_masked)
  if like is not None and len(leaves) == len(flat) and all(
      getattr(leaves[i], "shape", None) == flat[i][1].shape for i in wides):
    results = solver(stacks, [_to_wide(leaves[i], w.view).stack for i, w in wides.items()])
  else:
    results = solver(stacks)
  out = [leaf for _, leaf in flat]
  for (i, wide), result in zip(wides.items(), results):
    out[i] = _from_wide(result, wide, flat[i][1].shape)
  return jax.tree_util.tree_unflatten(treedef, out)


def orthogonalize(
    ns: Schedule = DEFAULT_NS,
    ns_steps: Optional[int] = None,
    *,
    views: Optional[ViewFn] = None,
    per_head: bool = False,
    compute_dtype: Any = "auto",
    gram: Optional[bool] = None,
    precondition: Optional[str] = None,
    ns_fn: Optional[Callable[[jax.Array], jax.Array]] = None,
    mesh: Optional[Mesh] = None,
    data_axis: str = "data",
) -> optax.GradientTransformation:
  """Replaces each update by Newton–Schulz's orthogonalization of its matrix view.

  Same-shape matrices (after orienting each wide) are stacked and orthogonalized by
  one batched call, which equals orthogonalizing them one by one. The state is
  empty, so it does not depend on the preset.

  Args:
    ns: a preset name ("turbo", "jordan", "polar_express") or an (n, 3) schedule.
    ns_steps: Newton–Schulz iterations; None takes the preset's.
    views: (path, shape) -> MatrixView | None; None uses `default_view`.
    per_head: with the default views, orthogonalize each attention head on its own.
    compute_dtype: matmul operand dtype, or "auto" (bfloat16 on GPU/TPU, float32 on CPU).
    gram: Gram-space iteration on (True), off (False) or chosen per shape group (None).
    precondition: "frobenius", "aol", or None for the preset's own.
    ns_fn: any function from a (count, m, n) stack of wide matrices (m ≤ n) to an
      array of the same shape, e.g. a Pallas kernel or another polynomial. It replaces
      the built-in iteration, so `ns`, `ns_steps`, `compute_dtype`, `gram` and
      `precondition` must then keep their defaults.
    mesh, data_axis: with a mesh, the matrices are dealt over all devices, balanced by
      flops, in one packed exchange there and one back; each is orthogonalized whole
      on one device, or (built-in iteration only) split by columns over idle devices
      when there are fewer matrices than devices (see `muon_optax._sharded_ns`);
      results equal the single-device ones.

  Returns:
    A stateless `optax.GradientTransformation`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muon_optax as mo
    >>> tx = mo.orthogonalize("polar_express")
    >>> g = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> def polar(x):  # any (..., m, n) -> (..., m, n) function plugs in
    ...   u, _, vt = jnp.linalg.svd(x, full_matrices=False)
    ...   return u @ vt
    >>> u, _ = mo.orthogonalize(ns_fn=polar).update(g, optax.EmptyState())
  """
  if ns_fn is None:
    coefficient_schedule(ns, ns_steps)  # fail early on a bad schedule
    resolve_precondition(ns, precondition)
    resolve_compute_dtype(compute_dtype)
    settings = dict(ns=ns, steps=ns_steps, gram=gram, compute_dtype=compute_dtype,
                    precondition=precondition)
    ns_fn = functools.partial(newton_schulz, **settings)
    split_fn = functools.partial(newton_schulz_column_parts, **settings)
  else:
    split_fn = None  # a custom function sees whole matrices only
    if not callable(ns_fn):
      raise ValueError(f"ns_fn must be a function of a (count, m, n) array, got {ns_fn!r}")
    given = {"ns": ns is not DEFAULT_NS, "ns_steps": ns_steps is not None,
             "compute_dtype": not (isinstance(compute_dtype, str) and compute_dtype == "auto"),
             "gram": gram is not None, "precondition": precondition is not None}
    if any(given.values()):
      raise ValueError(
          f"ns_fn replaces the built-in Newton–Schulz, so {[k for k, v in given.items() if v]} "
          "would be ignored; pass either ns_fn or those options, not both.")
  views = view_fn(views, per_head)
  solver = (grouped_solver(ns_fn) if mesh is None else
            sharded_solver(ns_fn, mesh, data_axis, split_fn=split_fn,
                           steps=5 if split_fn is None else resolve_steps(ns, ns_steps)))

  def update_fn(updates, state, params=None):
    like = params if mesh is not None else None  # on a mesh, results laid out like params
    return orthogonalize_leaves(updates, views, solver, like), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
