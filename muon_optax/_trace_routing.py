"""Routing read from the computation: how `f(params, *args)` uses each leaf, from its jaxpr."""

from __future__ import annotations

import re
import sys
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from muon_optax import _paths
from muon_optax._jaxpr_uses import Track, Use, Walker
from muon_optax._matrix_view import MatrixView, ViewFn, default_view
from muon_optax._name_rules import ADAM, MUON, Rule, check_rules, first_match
from muon_optax._routing import Decision, Routing


def _per_head(view: MatrixView) -> MatrixView:
  """Attention kernels (d, h, k) / (h, k, d): the first of a grouped fan axis is the head."""
  if len(view.fan_out) > 1:
    return MatrixView(tuple(sorted(view.batch + view.fan_out[:1])), view.fan_in, view.fan_out[1:])
  if len(view.fan_in) > 1:
    return MatrixView(tuple(sorted(view.batch + view.fan_in[:1])), view.fan_in[1:], view.fan_out)
  return view


def _decide(path: str, shape, uses: list[Use], head: bool, per_head: bool) -> Decision:
  kinds = {u.kind for u in uses}
  matrix = {u.view for u in uses if u.kind in ("dot", "conv")}
  shown = ", ".join(sorted({u.detail or u.kind for u in uses}))
  fail = lambda why: ValueError(
      f"parameter {path!r} (shape {tuple(shape)}) {why} ({shown}); settle it with "
      f"overrides=[({re.escape(path)!r}, 'muon' | 'adam' | 'frozen')].")
  if not uses:
    raise ValueError(
        f"parameter {path!r} (shape {tuple(shape)}) is not used by f(params, *args); give "
        f"example args that use it, or overrides=[({re.escape(path)!r}, 'adam' | 'frozen')].")
  embedding = "gather" in kinds or ("dynamic" in kinds and not matrix)
  if None in matrix:
    raise fail("is used in a way that splits one of its axes")
  if "grouped_conv" in kinds:
    if matrix:
      raise fail("is used in incompatible ways")
    grouped = next(u.detail for u in uses if u.kind == "grouped_conv")
    return Decision(ADAM, None, f"{grouped} → adam")
  if embedding:
    tied = " (tied: also the output projection)" if matrix else ""
    how = "gather" if "gather" in kinds else "dynamic index"
    return Decision(ADAM, None, f"{how} → embedding{tied}")
  if len(shape) < 2 or not matrix:
    return Decision(ADAM, None, "rank < 2" if len(shape) < 2 else "elementwise only")
  if len(matrix) > 1:
    raise fail("is used in incompatible ways")
  view = matrix.pop()
  if head and "dot" in kinds:
    return Decision(ADAM, None, "feeds the output → head")
  if per_head and "dot" in kinds:
    view = _per_head(view)
  if "conv" in kinds:
    return Decision(MUON, view, next(u.detail for u in uses if u.kind == "conv"))
  return Decision(MUON, view, f"dot_general → {view.describe(shape)}")


def _override(rules, path: str, leaf, shape, per_head: bool, inferred) -> Optional[Decision]:
  found = first_match(rules, path, leaf)
  if found is None:
    return None
  label, why = found
  view = None
  if label == MUON:
    view = inferred.view if inferred is not None and inferred.view is not None else (
        default_view(path, tuple(shape), per_head=per_head))
  return Decision(label, view, why.replace("rule", "override", 1))


def _abstract(x):
  """Shape, dtype and (for arrays on a mesh) sharding: what tracing needs, no data."""
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def infer_routing(f: Callable[..., Any], *args: Any, overrides: Sequence[Rule] = (),
                  per_head: bool = False, views: Optional[ViewFn] = None,
                  **kwargs: Any) -> Routing:
  """Routes every parameter by how `f(params, *args, **kwargs)` uses it.

  `f` is traced once with `jax.make_jaxpr` on abstract values (nothing is computed or
  allocated), and each leaf is followed through layout-only ops (reshape, transpose,
  broadcast, convert, squeeze, static and dynamic slices) and into jit, scan, while,
  cond, remat, custom_jvp / custom_vjp and shard_map bodies:

  - gather, or a dynamic index (an embedding lookup) → "adam"; tied too;
  - dot_general → "muon", matrix (fan_in × fan_out) = (its contracted axes × its free
    axes), its batch axes and the axes a scan slices are a batch of matrices;
    attention kernels (d, h, k) and (h, k, d) are d×(h·k) and (h·k)×d, or one matrix
    per head with `per_head=True`;
  - conv_general_dilated → "muon", (spatial · in_features) × out_features from the
    dimension numbers; grouped / depthwise → "adam";
  - a dot_general whose result reaches the output with no other parameter's
    dot_general or conv after it (the head) → "adam"; elementwise use only → "adam".

  Args:
    f: a function `f(params, *args, **kwargs)`, or an `nnx.Module` called as
      `model(*args, **kwargs)` (its `nnx.Param` state is routed).
    *args, **kwargs: `params` (unless `f` is a Module), then example inputs: arrays
      or `jax.ShapeDtypeStruct`s; other values are passed as they are.
    overrides: (regex, label) pairs or callables (path, leaf) -> label | None, first
      match wins, applied before the inferred routing.
    per_head: one matrix per attention head.
    views: (path, shape) -> MatrixView | None; where it gives a view for a Muon
      leaf, that view replaces the inferred one.

  Returns:
    A `Routing`: pass it to `muon(routing=...)`, `describe`, `Checkpointer`.

  Raises:
    ValueError: `f` fails to trace, or a leaf is unused or used in incompatible
      ways (the message names the path and its uses; `overrides` settle it).

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"emb": jnp.ones((10, 4)), "w": jnp.ones((4, 4)), "out": jnp.ones((4, 10))}
    >>> f = lambda p, ids: (p["emb"][ids] @ p["w"]) @ p["out"]
    >>> mo.infer_routing(f, params, jnp.zeros(3, int)).labels(params)
    {'emb': 'adam', 'out': 'adam', 'w': 'muon'}
  """
  overrides = check_rules(overrides)
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(f, nnx.Module):
    graphdef, params, rest = nnx.split(f, nnx.Param, ...)
    # The rest (batch stats, RNG counts) is traced too, so that the call may update it.
    fn = lambda p, rest, *a, **k: nnx.merge(graphdef, p, rest)(*a, **k)
    args = (rest, *args)
  elif not args:
    raise ValueError("infer_routing(f, params, *args): pass the params to route.")
  else:
    fn, params, args = f, args[0], args[1:]
  flat, tree = jax.tree_util.tree_flatten((args, kwargs))
  arrays = [_abstract(x) for x in flat if _is_array(x)]

  def traced(p, arrays):
    it = iter(arrays)
    a, k = jax.tree_util.tree_unflatten(tree, [next(it) if _is_array(x) else x for x in flat])
    return fn(p, *a, **k)

  leaves = _paths.leaves_with_path(params)
  try:
    closed = jax.make_jaxpr(traced)(jax.tree.map(_abstract, params), arrays)
  except Exception as e:  # any failure of the user's f
    raise ValueError(f"infer_routing could not trace f(params, *args): {type(e).__name__}: {e}"
                     ) from e
  shapes = [tuple(np.shape(x)) for _, x in leaves]
  n = len(shapes)
  walker = Walker(shapes)
  tracks = [Track(i, tuple((a,) for a in range(len(s))), frozenset()) for i, s in enumerate(shapes)]
  invars = closed.jaxpr.invars
  _, out_l = walker.walk(closed.jaxpr, tracks + [None] * (len(invars) - n),
                         [frozenset()] * len(invars))
  heads = frozenset().union(*out_l)
  decisions = {}
  for i, (path, leaf) in enumerate(leaves):
    uses = list(walker.uses[i])
    try:
      inferred, error = _decide(path, shapes[i], uses, i in heads, per_head), None
    except ValueError as e:
      inferred, error = None, e
    decision = _override(overrides, path, leaf, shapes[i], per_head, inferred)
    if decision is None and error is not None:
      raise error
    decision = decision or inferred
    view = views(path, shapes[i]) if views is not None and decision.label == MUON else None
    if view is not None:
      decision = Decision(MUON, view, f"{decision.reason} (view given)")
    decisions[path] = (shapes[i], decision)
  return Routing(decisions=decisions, per_head=per_head)
