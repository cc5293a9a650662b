"""Routing read from the computation: how `f(params, *args)` uses each leaf, from its jaxpr."""

from __future__ import annotations

import math
import re
import sys
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.extend.core as jcore
import numpy as np

from muon_optax import _paths
from muon_optax._matrix_view import MatrixView, default_view
from muon_optax._routing import ADAM, MUON, Decision, Routing, Rule, check_rules


class _Track(NamedTuple):
  """A value that is one parameter leaf seen through layout-only ops."""
  leaf: int
  dims: tuple[tuple[int, ...], ...]  # per value dim: the leaf axes it holds
  sliced: frozenset  # leaf axes indexed away (scan, dynamic index, size-1 squeeze)
  dynamic: bool = False  # indexed by a traced integer (an embedding-style lookup)


class _Use(NamedTuple):
  kind: str  # "dot", "conv", "grouped_conv", "gather", "dynamic", "elementwise"
  view: Optional[MatrixView] = None
  detail: str = ""


_LAYOUT = {"convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint",
           "device_put", "optimization_barrier", "rev", "slice"}
_SCALAR_OPS = {"mul", "div", "neg", "add", "sub"}  # w * 0.5 is still w for routing


def _reshape(in_shape, out_shape, dims):
  """Leaf axes per output dim of a reshape: merged dims join, split dims share."""
  sliced, src = set(), []
  for s, d in zip(in_shape, dims):
    (sliced.update(d) if s == 1 else src.append((s, d)))
  out = [()] * len(out_shape)
  tgt = [i for i, s in enumerate(out_shape) if s != 1]
  i = j = 0
  while i < len(src) and j < len(tgt):
    gi, gj, pi, pj = [i], [j], src[i][0], out_shape[tgt[j]]
    while pi != pj:
      if pi < pj:
        i += 1
        pi *= src[i][0]
        gi.append(i)
      else:
        j += 1
        pj *= out_shape[tgt[j]]
        gj.append(j)
    axes = tuple(sorted(set().union(*(src[k][1] for k in gi))))
    for k in gj:
      out[tgt[k]] = axes
    i, j = i + 1, j + 1
  return tuple(out), sliced


def _layout(eqn, t: _Track) -> Optional[_Track]:
  """The track of a layout-only op's output, or None if the op is not one."""
  name, p = eqn.primitive.name, eqn.params
  in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  if name in _LAYOUT:
    return t if len(out_shape) == len(in_shape) else None
  if name == "transpose":
    return t._replace(dims=tuple(t.dims[a] for a in p["permutation"]))
  if name == "squeeze":
    gone = set().union(*(t.dims[a] for a in p["dimensions"]))
    return t._replace(dims=tuple(d for a, d in enumerate(t.dims) if a not in p["dimensions"]),
                      sliced=t.sliced | gone)
  if name == "reshape":
    dims, gone = _reshape(in_shape, out_shape, t.dims)
    return t._replace(dims=dims, sliced=t.sliced | gone)
  if name == "broadcast_in_dim":
    dims, gone = [()] * len(out_shape), set()
    for k, o in enumerate(p["broadcast_dimensions"]):
      (dims.__setitem__(o, t.dims[k]) if in_shape[k] == out_shape[o] else gone.update(t.dims[k]))
    return t._replace(dims=tuple(dims), sliced=t.sliced | gone)
  if name == "dynamic_slice":
    dims, gone, dynamic = list(t.dims), set(), t.dynamic
    for k, size in enumerate(p["slice_sizes"]):
      if size == 1 and in_shape[k] > 1:
        gone.update(dims[k])
        dims[k] = ()
        dynamic = dynamic or not isinstance(eqn.invars[1 + k], jcore.Literal)
    return t._replace(dims=tuple(dims), sliced=t.sliced | gone, dynamic=dynamic)
  return None


def _matrix_view(batch, fan_in, fan_out, rank) -> Optional[MatrixView]:
  fan_in, fan_out = sorted(set(fan_in)), sorted(set(fan_out))
  if set(fan_in) & set(fan_out) or set(batch) & (set(fan_in) | set(fan_out)):
    return None  # a leaf axis split and used two ways
  if fan_in and fan_out:  # a free axis before the contraction and one after it: a vmapped stack
    before = [a for a in fan_out if a < fan_in[0]]
    if before and any(a > fan_in[-1] for a in fan_out):
      batch, fan_out = set(batch) | set(before), [a for a in fan_out if a not in before]
  rest = set(range(rank)) - set(batch) - set(fan_in) - set(fan_out)
  return MatrixView(tuple(sorted(set(batch) | rest)), tuple(fan_in), tuple(fan_out))


def _dot_use(eqn, side: int, t: _Track, shape) -> _Use:
  (contract, batch_dims) = eqn.params["dimension_numbers"]
  c, b = set(contract[side]), set(batch_dims[side])
  fan_in = [a for k in c for a in t.dims[k]]
  batch = [a for k in b for a in t.dims[k]] + list(t.sliced)
  fan_out = [a for k, d in enumerate(t.dims) if k not in c | b for a in d]
  view = _matrix_view(batch, fan_in, fan_out, len(shape))
  if view is None:
    return _Use("dot", None, "dot_general on part of an axis")
  return _Use("dot", view, f"dot_general as {view.describe(shape)}")


def _conv_use(eqn, t: _Track, rank: int, shape) -> _Use:
  p = eqn.params
  groups = max(p["feature_group_count"], p["batch_group_count"])
  out_dim, in_dim, *spatial = p["dimension_numbers"].rhs_spec
  if groups > 1:
    return _Use("grouped_conv", None, f"grouped conv ({groups} groups)")
  fan_in = [a for k in spatial + [in_dim] for a in t.dims[k]]
  view = _matrix_view(list(t.sliced), fan_in, t.dims[out_dim], rank)
  if view is None:
    return _Use("dot", None, "conv on part of an axis")
  size = lambda axes: math.prod(shape[a] for a in axes)
  kernel = "×".join(str(size(t.dims[k])) for k in spatial)
  _, fi, fo = view.matrix_shape(shape)
  return _Use("conv", view, f"conv {kernel}×{size(t.dims[in_dim])}→{size(t.dims[out_dim])} "
              f"→ {fi}×{fo}")


def _sub_jaxpr(eqn):
  """The call's inner jaxpr when its inputs map 1:1 to the call's (jit, remat, custom_jvp/vjp,
  shard_map, ...), else None."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = eqn.params.get(key)
    j = getattr(j, "jaxpr", j)
    if isinstance(j, jcore.Jaxpr) and len(j.invars) == len(eqn.invars):
      return j
  return None


class _Walker:
  """Records every use of every leaf; `lasts` are the leaves whose dot_general result a
  value carries with no other parameter's dot_general or conv after it."""

  def __init__(self, shapes):
    self.shapes = shapes
    self.uses = [dict() for _ in shapes]

  def use(self, leaf, u: _Use):
    self.uses[leaf].setdefault(u, None)

  def walk(self, jaxpr, tracks, lasts):
    env_t, env_l = {}, {}
    for v, t, l in zip(jaxpr.invars, tracks, lasts):
      env_t[v], env_l[v] = t, l
    get = lambda env, a, d: d if isinstance(a, jcore.Literal) else env.get(a, d)
    for eqn in jaxpr.eqns:
      ts = [get(env_t, a, None) for a in eqn.invars]
      ls = [get(env_l, a, frozenset()) for a in eqn.invars]
      out_t, out_l = self.eqn(eqn, ts, ls)
      for v, t, l in zip(eqn.outvars, out_t, out_l):
        env_t[v], env_l[v] = t, l
    out_t = [get(env_t, a, None) for a in jaxpr.outvars]
    out_l = [get(env_l, a, frozenset()) for a in jaxpr.outvars]
    return out_t, out_l

  def loop(self, body, consts, carry, xs, n_out_carry):
    """Walks a loop body until the carried `lasts` stop growing."""
    carry = list(carry)
    while True:
      out_t, out_l = body([*consts[0], *[None] * len(carry), *xs[0]],
                          [*consts[1], *carry, *xs[1]])
      grown = [c | o for c, o in zip(carry, out_l[:n_out_carry])]
      if grown == carry:
        return out_l
      carry = grown

  def eqn(self, eqn, ts, ls):
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    union = frozenset().union(*ls)
    tracked = [(k, t) for k, t in enumerate(ts) if t is not None]
    if not tracked:
      if name in ("scan", "while", "cond") or _sub_jaxpr(eqn) is not None:
        return self.control(eqn, ts, ls)
      return [None] * n_out, [union] * n_out
    if name == "dot_general":
      for k, t in tracked:
        self.use(t.leaf, _dot_use(eqn, k, t, self.shapes[t.leaf]))
      return [None], [frozenset(t.leaf for _, t in tracked)]
    if name == "conv_general_dilated":
      for k, t in tracked:
        shape = self.shapes[t.leaf]
        self.use(t.leaf, _conv_use(eqn, t, len(shape), shape) if k == 1 else _Use("elementwise"))
      return [None], [frozenset()]
    if name == "gather" and tracked[0][0] == 0:
      self.use(tracked[0][1].leaf, _Use("gather", None, "gather"))
      return [None], [union]
    if name in ("scan", "while", "cond") or _sub_jaxpr(eqn) is not None:
      return self.control(eqn, ts, ls)
    if len(tracked) == 1 and tracked[0][0] == 0 and n_out == 1:
      t = _layout(eqn, tracked[0][1])
      others = eqn.invars[1:]
      if t is None and name in _SCALAR_OPS and all(
          isinstance(a, jcore.Literal) or a.aval.shape == () for a in others) and (
              eqn.outvars[0].aval.shape == eqn.invars[0].aval.shape):
        t = tracked[0][1]
      if t is not None:
        return [t], [union]
    if len(tracked) == 1 and tracked[0][0] == 1 and name in _SCALAR_OPS and (
        eqn.outvars[0].aval.shape == eqn.invars[1].aval.shape and not eqn.invars[0].aval.shape):
      return [tracked[0][1]], [union]
    for _, t in tracked:
      self.use(t.leaf, _Use("dynamic" if t.dynamic else "elementwise"))
    return [None] * n_out, [union] * n_out

  def control(self, eqn, ts, ls):
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
      nc, ncar = p["num_consts"], p["num_carry"]
      xs_t = [None if t is None else
              t._replace(dims=t.dims[1:], sliced=t.sliced | set(t.dims[0])) for t in ts[nc + ncar:]]
      body = lambda t, l: self.walk(p["jaxpr"].jaxpr, t, l)
      consts = (ts[:nc], ls[:nc])
      out_l = self.loop(body, consts, ls[nc:nc + ncar], (xs_t, ls[nc + ncar:]), ncar)
      return [None] * len(eqn.outvars), out_l
    if name == "while":
      cn, bn = p["cond_nconsts"], p["body_nconsts"]
      carry = ls[cn + bn:]
      self.walk(p["cond_jaxpr"].jaxpr, ts[:cn] + [None] * len(carry), ls[:cn] + carry)
      body = lambda t, l: self.walk(p["body_jaxpr"].jaxpr, t, l)
      out_l = self.loop(body, (ts[cn:cn + bn], ls[cn:cn + bn]), carry, ([], []), len(carry))
      return [None] * len(eqn.outvars), out_l
    if name == "cond":
      outs = [self.walk(b.jaxpr, ts[1:], ls[1:]) for b in p["branches"]]
      out_l = [frozenset().union(*col) for col in zip(*(o[1] for o in outs))]
      return [None] * len(eqn.outvars), out_l
    return self.walk(_sub_jaxpr(eqn), ts, ls)


def _per_head(view: MatrixView) -> MatrixView:
  """Attention kernels (d, h, k) / (h, k, d): the first of a grouped fan axis is the head."""
  if len(view.fan_out) > 1:
    return MatrixView(tuple(sorted(view.batch + view.fan_out[:1])), view.fan_in, view.fan_out[1:])
  if len(view.fan_in) > 1:
    return MatrixView(tuple(sorted(view.batch + view.fan_in[:1])), view.fan_in[1:], view.fan_out)
  return view


def _decide(path: str, shape, uses: list[_Use], head: bool, per_head: bool) -> Decision:
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
    return Decision(ADAM, None, next(u.detail for u in uses if u.kind == "grouped_conv") + " → adam")
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
  for rule in rules:
    if callable(rule):
      label, why = rule(path, leaf), f"override {getattr(rule, '__name__', 'callable')}"
    else:
      label, why = (rule[1] if re.search(rule[0], path) else None), f"override {rule[0]!r}"
    if label is not None:
      view = None
      if label == MUON:
        view = inferred.view if inferred is not None and inferred.view is not None else (
            default_view(path, tuple(shape), per_head=per_head))
      return Decision(label, view, why)
  return None


def _abstract(x):
  return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def infer_routing(f: Callable[..., Any], *args: Any, overrides: Sequence[Rule] = (),
                  per_head: bool = False, **kwargs: Any) -> Routing:
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
    fn = lambda p, *a, **k: nnx.merge(graphdef, p, rest)(*a, **k)
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
  walker = _Walker(shapes)
  tracks = [_Track(i, tuple((a,) for a in range(len(s))), frozenset()) for i, s in enumerate(shapes)]
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
    decisions[path] = (shapes[i], decision or inferred)
  return Routing(decisions=decisions, per_head=per_head)
