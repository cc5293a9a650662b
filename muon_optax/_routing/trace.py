"""Routing read from the computation: how `f(params, *args)` uses each leaf, from its jaxpr."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import jax
import numpy as np

from muon_optax._routing.jaxpr_uses import Product, Track, Use, Walker
from muon_optax._routing.matrix_view import MatrixView, ViewFn, default_view
from muon_optax._routing.name_rules import (
  ADAM,
  BY_NAME,
  FROZEN,
  MUON,
  Rule,
  check_rules,
  first_match,
)
from muon_optax._routing.value import Decision, Routing
from muon_optax._util import paths


def _per_head(view: MatrixView) -> MatrixView:
  """Attention kernels (d, h, k) / (h, k, d): the first of a grouped fan axis is the head."""
  if len(view.fan_out) > 1:
    return MatrixView(tuple(sorted(view.batch + view.fan_out[:1])), view.fan_in, view.fan_out[1:])
  if len(view.fan_in) > 1:
    return MatrixView(tuple(sorted(view.batch + view.fan_in[:1])), view.fan_in[1:], view.fan_out)
  return view


def _decide(path: str, shape, uses: list[Use], head: bool, per_head: bool,
            blocks: int = 1) -> Decision:
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
  if head:
    return Decision(ADAM, None, "feeds the output → head")
  if blocks > 1 and "conv" not in kinds:  # a fused projection: one matrix per block
    view = view._replace(blocks=blocks)
  elif per_head and "dot" in kinds:
    view = _per_head(view)
  if "conv" in kinds:
    return Decision(MUON, view, next(u.detail for u in uses if u.kind == "conv"))
  return Decision(MUON, view, f"dot_general → {view.describe(shape)}")


def _override(rules, path: str, leaf, shape, per_head: bool, inferred) -> Optional[Decision]:
  found = first_match(rules, path, leaf)
  if found is None:
    return None
  label, why = found
  why, view = why.replace("rule", "override", 1), None
  if label == MUON and inferred is not None and inferred.view is not None:
    view = inferred.view
  elif label == MUON:  # the computation gave no view: the name's
    view, why = default_view(path, tuple(shape), per_head=per_head), f"{why}, {BY_NAME}"
  return Decision(label, view, why)


def _abstract(x):
  """Shape, dtype and (for arrays on a mesh) sharding: what tracing needs, no data."""
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _split_call(f, args) -> tuple[Callable[..., Any], Any, tuple]:
  """(fn(params, *args, **kwargs), params, args) from `infer_routing`'s f and args."""
  nnx, eqx = sys.modules.get("flax.nnx"), sys.modules.get("equinox")
  linen = sys.modules.get("flax.linen")
  is_module = lambda m: ((nnx is not None and isinstance(m, nnx.Module))
                         or (eqx is not None and isinstance(m, eqx.Module)))
  # A method of a Module (model.encode) routes the Module's params, as the Module does.
  owner, method = getattr(f, "__self__", None), getattr(f, "__func__", None)
  module, call = (owner, method) if method is not None and is_module(owner) else (
      f, lambda m, *a, **k: m(*a, **k))
  if nnx is not None and isinstance(module, nnx.Module):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    # The rest (batch stats, RNG counts) is traced too, so that the call may update it.
    fn = lambda p, rest, *a, **k: call(nnx.merge(graphdef, p, rest), *a, **k)
    return fn, params, (rest, *args)
  if eqx is not None and isinstance(module, eqx.Module):
    # The params are what eqx.filter(model, eqx.is_inexact_array) keeps, at its paths.
    params, static = eqx.partition(module, eqx.is_inexact_array)
    return lambda p, *a, **k: call(eqx.combine(p, static), *a, **k), params, args
  if linen is not None and (isinstance(f, linen.Module)
                            or (isinstance(f, type) and issubclass(f, linen.Module))):
    what = "Module class" if isinstance(f, type) else "Module"
    raise ValueError(f"infer_routing got a Linen {what} as f; pass an instance's apply and "
                     "the variables: infer_routing(model.apply, variables, *args).")
  if not callable(f):
    raise ValueError(f"infer_routing's f must be callable, got a {type(f).__name__}; pass a "
                     "function f(params, *args) (for haiku: lambda p, x: model.apply(p, None, "
                     "x)), an nnx.Module or an equinox Module.")
  held = [p for p, x in paths.leaves_with_path(f) if x is not f and _is_array(x)]
  if held:
    raise ValueError(f"f holds arrays of its own (at {held[:3]}), which would not be routed; "
                     "pass them as the params: infer_routing(f, params, *args).")
  if not args:
    raise ValueError("infer_routing(f, params, *args): pass the params to route.")
  return f, args[0], args[1:]


def _check_params(params) -> None:
  """A clear error for params that are not a pytree of arrays."""
  leaves = paths.leaves_with_path(params)
  for path, x in leaves:
    if not (_is_array(x) or isinstance(x, (bool, int, float, complex))):
      where = f"the leaf at {path!r}" if path else "params itself"
      raise ValueError(
          f"infer_routing routes a pytree of arrays, but {where} is a {type(x).__name__}. "
          "Pass an nnx or equinox Module itself as f (infer_routing(model, *args)), or only "
          "the arrays to route as params (e.g. eqx.filter(model, eqx.is_inexact_array)).")
  if not leaves:
    raise ValueError("infer_routing found no arrays in the params to route; pass "
                     "f, params, *args (or an nnx / equinox Module, then its inputs).")


def _variables_hint(error: Exception, params) -> str:
  """What to pass when a Linen apply, given the params, finds no "params" collection."""
  flax_errors = sys.modules.get("flax.errors")
  if (flax_errors is None or not isinstance(error, flax_errors.ScopeCollectionNotFound)
      or not isinstance(params, Mapping) or "params" in params):
    return ""
  return ("\nA Linen apply takes the variables, not the params: pass the variables, "
          "{'params': params}: infer_routing(model.apply, {'params': params}, *args).")


def _trace(fn, params, args, kwargs, output):
  """The jaxpr of fn(params, *args, **kwargs) and the names of its output arrays; with
  `output`, the arrays it picks come first and the count of them is returned."""
  flat, tree = jax.tree_util.tree_flatten((args, kwargs))
  arrays = [_abstract(x) for x in flat if _is_array(x)]

  def traced(p, arrays):
    it = iter(arrays)
    a, k = jax.tree_util.tree_unflatten(tree, [next(it) if _is_array(x) else x for x in flat])
    out = fn(p, *a, **k)
    return out if output is None else (output(out), out)

  try:
    closed, shape = jax.make_jaxpr(traced, return_shape=True)(
        jax.tree.map(_abstract, params), arrays)
  except Exception as e:  # any failure of the user's f (or output)
    what = "f(params, *args)" + (" and output(...)" if output is not None else "")
    raise ValueError(f"infer_routing could not trace {what}: {type(e).__name__}: {e}"
                     f"{_variables_hint(e, params)}") from e
  if output is not None:
    picked = len(jax.tree.leaves(shape[0]))
    if not picked:
      raise ValueError("output= picked no array from f's result; give a function of the "
                       "result that returns the model's output, e.g. output=lambda out: out[0].")
    return closed, [], picked
  flat_out = jax.tree_util.tree_flatten_with_path(shape)[0]
  return closed, ["out" + jax.tree_util.keystr(p) for p, _ in flat_out], None


def _heads(out_l, fed, names, picked, outcome, paths) -> frozenset:
  """The leaves judged heads: those last before the picked output and fed to no other
  dot/conv; with no pick, those of any output, unless their routing depends on which
  output is the model's."""
  if picked is not None:
    return frozenset().union(*out_l[:picked]) - fed
  candidates = [(n, l - fed) for n, l in zip(names, out_l) if l]  # outputs a dot/conv reaches
  heads = frozenset().union(*(l for _, l in candidates))
  split = [i for i in sorted(heads) if len({outcome(i, i in l) for _, l in candidates}) > 1]
  if not split:
    return heads
  shown = "; ".join(f"{paths[i]!r} is a head (→ adam) only if the output is "
                    f"{' or '.join(n for n, l in candidates if i in l)}" for i in split[:5])
  more = f"; and {len(split) - 5} more" if len(split) > 5 else ""
  listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
  example = next((n for n, _ in candidates if "logit" in n), candidates[0][0])
  raise ValueError(
      f"f returns {len(names)} arrays ({listed}), and which parameters are heads depends on "
      f"which one is the model's output: {shown}{more}. Pass output=, a function of f's "
      f"result that picks the model's output, e.g. output=lambda out: {example}.")


def _route_leaf(path, leaf, shape, uses, head, per_head, overrides, views, blocks) -> Decision:
  """The leaf's decision: the first matching override, else the inferred one."""
  dtype = jax.numpy.result_type(leaf)
  try:
    if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):  # a counter, an index table
      inferred, error = Decision(FROZEN, None, f"{dtype} → frozen"), None
    else:
      inferred, error = _decide(path, shape, uses, head, per_head, blocks), None
  except ValueError as e:
    inferred, error = None, e
  decision = _override(overrides, path, leaf, shape, per_head, inferred)
  if decision is None and error is not None:
    raise error
  decision = decision or inferred
  view = views(path, shape) if views is not None and decision.label == MUON else None
  if view is not None:  # the cause stays; the view the reason named is replaced
    cause = decision.reason.split(" → ")[0].removesuffix(f", {BY_NAME}")
    decision = Decision(MUON, view, f"{cause} → {view.describe(shape)} (view given)")
  return decision


def infer_routing(f: Callable[..., Any], *args: Any, overrides: Sequence[Rule] = (),
                  per_head: bool = False, views: Optional[ViewFn] = None,
                  output: Optional[Callable[[Any], Any]] = None, **kwargs: Any) -> Routing:
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
  - a dot_general whose result is only ever cut into equal blocks along its fan-out (a
    fused q/k/v kernel (d, 3d) split into q, k and v, a fused gate/up (d, 2f)): one
    matrix per block (`MatrixView(blocks=...)`), as the model uses them;
  - a dot_general or conv whose result reaches the output with no other parameter's
    dot_general or conv after it, and feeds none (the head) → "adam"; elementwise use
    only → "adam".

  Args:
    f: a function `f(params, *args, **kwargs)`; or an `nnx.Module` or an equinox
      Module (or a method of one) called as `model(*args, **kwargs)`, whose
      `nnx.Param` state, or whose inexact arrays (`eqx.filter(model,
      eqx.is_inexact_array)`), are routed.
    *args: `params` (unless `f` is a Module), then example inputs: arrays or
      `jax.ShapeDtypeStruct`s; other values are passed as they are.
    **kwargs: keyword inputs of `f`, as `args`.
    overrides: (regex, label) pairs or callables (path, leaf) -> label | None, first
      match wins, applied before the inferred routing.
    per_head: one matrix per attention head.
    views: (path, shape) -> MatrixView | None; where it gives a view for a Muon
      leaf, that view replaces the inferred one.
    output: a function of f's result that picks the model's output (e.g.
      `lambda out: out.logits`); heads are judged by it alone. Needed when f returns
      several arrays (logits and hidden states) whose choice changes the routing.

  Returns:
    A `Routing`: pass it to `muon(routing=...)`, `describe`, `Checkpointer`.

  Raises:
    ValueError: `f` fails to trace; params are not a pytree of arrays; a leaf is unused
      or used in incompatible ways (the message names the path and its uses;
      `overrides` settle it); f returns several arrays and no `output` says which.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"emb": jnp.ones((10, 4)), "w": jnp.ones((4, 4)), "out": jnp.ones((4, 10))}
    >>> f = lambda p, ids: (p["emb"][ids] @ p["w"]) @ p["out"]
    >>> mo.infer_routing(f, params, jnp.zeros(3, int)).labels(params)
    {'emb': 'adam', 'out': 'adam', 'w': 'muon'}
  """
  overrides = check_rules(overrides)
  fn, params, args = _split_call(f, args)
  _check_params(params)
  leaves = paths.leaves_with_path(params)
  closed, names, picked = _trace(fn, params, args, kwargs, output)
  shapes = [tuple(np.shape(x)) for _, x in leaves]
  n = len(shapes)
  walker = Walker(shapes)
  tracks = [Track(i, tuple((a,) for a in range(len(s))), frozenset()) for i, s in enumerate(shapes)]
  invars = closed.jaxpr.invars
  out_t, out_l = walker.walk(closed.jaxpr, tracks + [None] * (len(invars) - n),
                             [frozenset()] * len(invars))
  for t in out_t:  # a product f returns is used whole
    if isinstance(t, Product):
      walker.whole[t.leaf] = True
  route = lambda i, head: _route_leaf(leaves[i][0], leaves[i][1], shapes[i],
                                      list(walker.uses[i]), head, per_head, overrides, views,
                                      walker.blocks(i))

  def outcome(i, head):
    try:
      decision = route(i, head)
      return decision.label, decision.view
    except ValueError as e:
      return str(e)

  heads = _heads(out_l, walker.fed, names, picked, outcome, [p for p, _ in leaves])
  decisions = {path: (shapes[i], route(i, i in heads)) for i, (path, _) in enumerate(leaves)}
  return Routing(decisions=decisions, per_head=per_head)
