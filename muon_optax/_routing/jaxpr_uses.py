"""How a traced computation uses each parameter leaf: its jaxpr walked use by use."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax.extend.core as jcore

from muon_optax._routing.matrix_view import MatrixView


class Track(NamedTuple):
  """A value that is one parameter leaf seen through layout-only ops."""
  leaf: int
  dims: tuple[tuple[int, ...], ...]  # per value dim: the leaf axes it holds
  sliced: frozenset  # leaf axes indexed away (scan, dynamic index, size-1 squeeze)
  dynamic: bool = False  # indexed by a traced integer (an embedding-style lookup)


class Product(NamedTuple):
  """The result of a leaf's dot_general, followed to see whether the model only ever cuts
  it into equal blocks along `axis`, the result dim that holds the major part of the
  leaf's fan-out (`size` long): a fused projection, q, k and v in one kernel."""
  leaf: int
  axis: int
  size: int
  # One per dot_general: the slices of the values it becomes (the same cut of the same
  # product, taken in several ops) are gathered to check that together they tile it.
  origin: int


class Use(NamedTuple):
  kind: str  # "dot", "conv", "grouped_conv", "gather", "dynamic", "elementwise"
  view: Optional[MatrixView] = None
  detail: str = ""


_LAYOUT = {"convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint",
           "device_put", "optimization_barrier", "rev", "slice", "pvary", "pcast",
           "all_gather", "reshard", "mesh_cast"}
_SCALAR_OPS = {"mul", "div", "neg", "add", "sub"}  # w * 0.5 is still w for routing


def _reshape(in_shape, out_shape, dims):
  """Leaf axes per output dim of a reshape: merged dims join, split dims share."""
  sliced, src = set(), []
  for s, d in zip(in_shape, dims):
    if s == 1:
      sliced.update(d)
    else:
      src.append((s, d))
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


def _layout(eqn, t: Track) -> Optional[Track]:
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
      if in_shape[k] == out_shape[o]:
        dims[o] = t.dims[k]
      else:  # a size-1 axis stretched: no longer the leaf's
        gone.update(t.dims[k])
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


def _dot_use(eqn, side: int, t: Track, shape) -> Use:
  (contract, batch_dims) = eqn.params["dimension_numbers"]
  c, b = set(contract[side]), set(batch_dims[side])
  fan_in = [a for k in c for a in t.dims[k]]
  batch = [a for k in b for a in t.dims[k]] + list(t.sliced)
  fan_out = [a for k, d in enumerate(t.dims) if k not in c | b for a in d]
  if not fan_in or not fan_out:  # a vector (a looked-up row, an outer product), not a weight
    return Use("dynamic" if t.dynamic else "elementwise", None, "dot_general as a vector")
  view = _matrix_view(batch, fan_in, fan_out, len(shape))
  if view is None:
    return Use("dot", None, "dot_general on part of an axis")
  return Use("dot", view, f"dot_general as {view.describe(shape)}")


def _product_axis(eqn, side: int, t: Track, view: MatrixView) -> Optional[tuple[int, int]]:
  """(result dim, its size) of the major part of the leaf's fan-out in a dot_general's
  result, when the result holds the fan-out in the view's (flattened) order; else None."""
  (contract, batch_dims) = eqn.params["dimension_numbers"]
  taken = set(contract[side]) | set(batch_dims[side])
  lhs = eqn.invars[0].aval
  start = len(batch_dims[0]) + (0 if side == 0 else lhs.ndim - len(contract[0]) - len(batch_dims[0]))
  free = [k for k in range(len(t.dims)) if k not in taken]
  carried = [(pos, k) for pos, k in enumerate(free) if set(t.dims[k]) & set(view.fan_out)]
  flat = [a for _, k in carried for a in t.dims[k]]
  if not carried or flat != sorted(view.fan_out):
    return None
  pos, k = carried[0]
  return start + pos, eqn.outvars[0].aval.shape[start + pos]


def _conv_use(eqn, t: Track, rank: int, shape) -> Use:
  p = eqn.params
  groups = max(p["feature_group_count"], p["batch_group_count"])
  out_dim, in_dim, *spatial = p["dimension_numbers"].rhs_spec
  if groups > 1:
    return Use("grouped_conv", None, f"grouped conv ({groups} groups)")
  fan_in = [a for k in spatial + [in_dim] for a in t.dims[k]]
  view = _matrix_view(list(t.sliced), fan_in, t.dims[out_dim], rank)
  if view is None:
    return Use("dot", None, "conv on part of an axis")
  size = lambda axes: math.prod(shape[a] for a in axes)
  kernel = "×".join(str(size(t.dims[k])) for k in spatial)
  _, fi, fo = view.matrix_shape(shape)
  return Use("conv", view, f"conv {kernel}×{size(t.dims[in_dim])}→{size(t.dims[out_dim])} "
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


class Walker:
  """Records every use of every leaf; `lasts` are the leaves whose dot_general or conv
  result a value carries with no other parameter's dot_general or conv after it, and
  `fed` those whose result reaches some parameter's dot_general or conv (a residual
  branch's projection reaches the output by its skip path too, yet is no head)."""

  def __init__(self, shapes):
    self.shapes = shapes
    self.uses = [dict() for _ in shapes]
    self.fed = set()
    # A leaf's products: how many equal blocks each is cut into, whether one is used
    # otherwise (whole), and the static slices taken of each product value.
    self.cut_into = [set() for _ in shapes]
    self.whole = [False] * len(shapes)
    self.slices: dict[tuple[int, int, int], tuple[int, int, set]] = {}
    self._origins = 0

  def blocks(self, leaf: int) -> int:
    """The equal blocks every product of `leaf` is cut into, and only cut into; else 1."""
    cuts = set(self.cut_into[leaf])
    for owner, size, taken in self.slices.values():
      if owner == leaf:
        parts = sorted(taken)
        k = len(parts)
        tiles = k > 1 and size % k == 0 and parts == [
            (i * size // k, (i + 1) * size // k) for i in range(k)]
        if not tiles:
          return 1
        cuts.add(k)
    return cuts.pop() if len(cuts) == 1 and not self.whole[leaf] else 1

  def _product(self, leaf, axis, size) -> Product:
    self._origins += 1
    return Product(leaf, axis, size, self._origins)

  def product_use(self, eqn, k: int, t: Product) -> Optional[Product]:
    """What `eqn` does with product `t` (its k-th input): a cut into blocks (recorded;
    None), an op that keeps it a product (the output's), or any other use (whole)."""
    name, p = eqn.primitive.name, eqn.params
    in_shape, out_shape = eqn.invars[k].aval.shape, eqn.outvars[0].aval.shape
    if name == "split" and k == 0:
      sizes = p["sizes"]
      if p["axis"] == t.axis and len(set(sizes)) == 1 and len(sizes) > 1:
        self.cut_into[t.leaf].add(len(sizes))
        return None
    elif name == "slice" and k == 0 and not any(s not in (None, 1) for s in p["strides"] or ()):
      start, limit = p["start_indices"], p["limit_indices"]
      if all(start[d] == 0 and limit[d] == in_shape[d] for d in range(len(in_shape))
             if d != t.axis):
        self.slices.setdefault((t.origin, t.axis, t.size), (t.leaf, t.size, set()))[2].add(
            (start[t.axis], limit[t.axis]))
        return None
    elif len(eqn.outvars) == 1 and (name in _LAYOUT or name in _SCALAR_OPS or name == "add_any"):
      if out_shape == in_shape:
        return t
    elif name == "transpose":
      return t._replace(axis=list(p["permutation"]).index(t.axis))
    elif name == "reshape":
      before = math.prod(in_shape[:t.axis])
      for j in range(len(out_shape)):
        if math.prod(out_shape[:j]) == before and t.size % out_shape[j] == 0 and (
            math.prod(out_shape[j:]) == math.prod(in_shape[t.axis:])) and out_shape[j] > 1:
          # The same dim, or its major part after a split: blocks along it stay contiguous.
          return t._replace(axis=j, size=out_shape[j])
    self.whole[t.leaf] = True
    return None

  def use(self, leaf, u: Use):
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
    name = eqn.primitive.name
    products = [(k, t) for k, t in enumerate(ts) if isinstance(t, Product)]
    if products and (name in ("scan", "while", "cond") or _sub_jaxpr(eqn) is None):
      ts = [None if isinstance(t, Product) else t for t in ts]
      kept = [self.product_use(eqn, k, t) for k, t in products]
      out_t, out_l = self._eqn(eqn, ts, ls)
      kept = [t for t in kept if t is not None]
      if kept and out_t[0] is None:
        out_t = [kept[0], *out_t[1:]]
      return out_t, out_l
    return self._eqn(eqn, ts, ls)

  def _eqn(self, eqn, ts, ls):
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    union = frozenset().union(*ls)
    tracked = [(k, t) for k, t in enumerate(ts) if t is not None]
    if not tracked:  # no parameter inside either, so nothing resets what it carries
      return [None] * n_out, [union] * n_out
    if name == "dot_general":
      out, product = [None], None
      for k, t in tracked:
        use = _dot_use(eqn, k, t, self.shapes[t.leaf])
        self.use(t.leaf, use)
        if isinstance(t, Track) and use.view is not None and len(tracked) == 1:
          where = _product_axis(eqn, k, t, use.view)
          product = None if where is None else self._product(t.leaf, *where)
      self.fed |= union
      return [product] if product is not None else out, [frozenset(t.leaf for _, t in tracked)]
    if name == "conv_general_dilated":
      for k, t in tracked:
        shape = self.shapes[t.leaf]
        self.use(t.leaf, _conv_use(eqn, t, len(shape), shape) if k == 1 else Use("elementwise"))
      kernel = frozenset(t.leaf for k, t in tracked if k == 1)
      if kernel:
        self.fed |= union
      return [None], [kernel]
    if name == "gather" and tracked[0][0] == 0:
      self.use(tracked[0][1].leaf, Use("gather", None, "gather"))
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
      self.use(t.leaf, Use("dynamic" if t.dynamic else "elementwise"))
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
