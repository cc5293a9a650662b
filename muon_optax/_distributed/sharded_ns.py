"""Newton–Schulz on a device mesh: one packed exchange in, local work, one out.

The assignment is static, computed from the shapes at trace time and balanced by
flops: same-shape matrices are dealt in *rounds* (one matrix per device); the few
left over in each shape group share rounds, largest first, zero-padded to the
round's largest shape. Zero-padding is exact for Newton–Schulz (X Xᵀ keeps its block
structure, ‖X‖_F is unchanged); an empty slot is an all-zero matrix, whose result is 0.
Whole matrices need no collective inside the iterations. A round with fewer
matrices than devices splits each matrix's columns over g devices instead of
idling them: NS(X) restricted to some columns only needs the whole X Xᵀ, summed
over the g parts wherever the iteration forms it (`newton_schulz_column_parts`).

The exchange is a `custom_partitioning` op, so it sees the layouts XLA chose:
- in: each device cuts its block of every matrix into one piece per owner (a
  block replicated over some mesh axes is split between its replicas), packs all
  pieces into one flat buffer row per owner, and a single all-to-all delivers them;
  the owner reassembles its matrices from the pieces;
- out: if every update is wanted replicated (ZeRO-1 with replicated params), one
  all-gather of the owners' packed results; otherwise one all-to-all sends each
  device its block of every result, in the layout the update is wanted in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._distributed.layouts import is_explicit, spec_axes
from muon_optax._newton_schulz.plan import newton_schulz_plan
from muon_optax._newton_schulz.settings import DEFAULT_NS, NewtonSchulz

Item = tuple[int, int]  # (stack index, matrix index in that stack)
SplitOk = Callable[[Item, int], bool]


class Round(NamedTuple):
  """One matrix per device, all (rows, cols) after zero-padding; with split = g > 1,
  g consecutive devices share a matrix, device d holding columns part d % g."""

  rows: int
  cols: int
  slots: tuple[Optional[Item], ...]  # one per device; None is an all-zero matrix
  split: int = 1


def split_flops(rows: int, cols: int, split: int, ns: NewtonSchulz) -> int:
  """Per-device flops of `newton_schulz_column_parts` on a rows×cols (rows ≤ cols) matrix
  split over `split` devices: products with X are split, the rows×rows work is not."""
  plan = newton_schulz_plan((rows, cols), ns)
  return plan.flops - plan.x_flops + plan.x_flops // split


def _flops(rows: int, cols: int, ns: NewtonSchulz) -> int:
  return newton_schulz_plan((rows, cols), ns).flops


def _split_of(members, rows, cols, devices, ns, split_ok) -> int:
  """The largest split that fits a round of `members` matrices and saves flops."""
  best, g = 1, 2
  while len(members) * g <= devices and devices % g == 0:
    if cols % g == 0 and all(split_ok(item, g) for item in members):
      if split_flops(rows, cols, g, ns) < _flops(rows, cols, ns):
        best = g
    g *= 2
  return best


def plan_rounds(shapes: list[tuple[int, int, int]], devices: int, ns: NewtonSchulz = DEFAULT_NS,
                split_ok: Optional[SplitOk] = None) -> list[Round]:
  """Deals the matrices of stacks with shapes (count, rows, cols) over `devices`.

  Each shape group fills as many full rounds as it can; the leftovers of all groups
  are packed largest first into shared rounds of their largest member's shape. A
  round with fewer members than devices splits each member's columns over the
  idle devices when that lowers the per-device flops and `split_ok(item, g)` allows.
  """
  split_ok = split_ok or (lambda item, g: shapes[item[0]][2] % g == 0)
  groups: dict[tuple[int, int], list[Item]] = {}
  for i, (count, rows, cols) in enumerate(shapes):
    groups.setdefault((rows, cols), []).extend((i, j) for j in range(count))
  rounds, leftovers = [], []
  for (rows, cols), items in groups.items():
    full = len(items) - len(items) % devices
    rounds += [Round(rows, cols, tuple(items[s:s + devices])) for s in range(0, full, devices)]
    leftovers += [((rows, cols), item) for item in items[full:]]
  # Largest first, so each shared round pads its members as little as possible.
  leftovers.sort(key=lambda e: -_flops(*e[0], ns))
  for start in range(0, len(leftovers), devices):
    chunk = leftovers[start:start + devices]
    rows = max(shape[0] for shape, _ in chunk)
    cols = max(shape[1] for shape, _ in chunk)
    members = [item for _, item in chunk]
    g = _split_of(members, rows, cols, devices, ns, split_ok)
    slots = tuple(item for item in members for _ in range(g))
    rounds.append(Round(rows, cols, slots + (None,) * (devices - len(slots)), g))
  return rounds


def per_device_flops(shapes: list[tuple[int, int, int]], devices: int,
                     ns: NewtonSchulz = DEFAULT_NS) -> int:
  """Newton–Schulz flops each device runs under `plan_rounds`."""
  return sum(_flops(r.rows, r.cols, ns) if r.split == 1
             else split_flops(r.rows, r.cols, r.split, ns)
             for r in plan_rounds(shapes, devices, ns))


class Layout(NamedTuple):
  """How a (count, rows, cols) stack lies on the mesh: every device holds the same
  (bh, bw) block of each matrix; `where[s]` = (block row, block col, replica) of
  device s (row-major over the mesh axes) and `grid` = (block rows, block cols)."""

  spec: P
  grid: tuple[int, int]
  block: tuple[int, int]
  replicas: int
  where: tuple[tuple[int, int, int], ...]


def layout_of(sharding, shape: tuple[int, int, int], mesh: Mesh) -> Layout:
  """The supported layout closest to `sharding`: the count axis unsplit and the
  matrix axes split evenly; axes it drops make the block replicated over them."""
  spec = list(getattr(sharding, "spec", P())) + [None] * 3
  sizes = dict(mesh.shape)
  keep = [()]
  for dim in (1, 2):
    axes = spec_axes(spec[dim])
    ok = all(a in sizes for a in axes) and shape[dim] % math.prod(sizes[a] for a in axes) == 0
    keep.append(axes if ok else ())
  used = set(keep[1] + keep[2])
  rest = tuple(a for a in mesh.axis_names if a not in used)
  radix = lambda coords, axes: int(np.ravel_multi_index(
      [coords[a] for a in axes], [sizes[a] for a in axes])) if axes else 0
  where = []
  for s in range(mesh.size):
    coords = dict(zip(mesh.axis_names, np.unravel_index(s, [sizes[a] for a in mesh.axis_names])))
    where.append((radix(coords, keep[1]), radix(coords, keep[2]), radix(coords, rest)))
  grid = tuple(math.prod(sizes[a] for a in keep[d]) for d in (1, 2))
  entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
  return Layout(P(None, entry(keep[1]), entry(keep[2])), grid,
                (shape[1] // grid[0], shape[2] // grid[1]),
                math.prod(sizes[a] for a in rest), tuple(where))


def _linear_index(axes: tuple[str, ...], sizes: dict) -> jax.Array:
  index = jnp.int32(0)
  for a in axes:
    index = index * sizes[a] + jax.lax.axis_index(a)
  return index


def _switch(index_table: list[int], branches: list[Callable], axes, sizes, *args):
  """`branches[index_table[this device]](*args)`, statically when all agree."""
  if len(set(index_table)) == 1:
    return branches[index_table[0]](*args)
  index = jnp.asarray(index_table, jnp.int32)[_linear_index(axes, sizes)]
  return jax.lax.switch(index, branches, *args)


def _group_reduce(x, op, g: int, axes, n: int):
  """`op`-reduction over the g consecutive devices that share a matrix: a butterfly
  of collective-permutes, whose result is bitwise the same on every member."""
  bit = 1
  while bit < g:
    x = op(x, jax.lax.ppermute(x, axes, [(s, s ^ bit) for s in range(n)]))
    bit *= 2
  return x


def _exchange(ns_fn, split_ns, mesh: Mesh, shapes, dtypes, ins: list[Layout],
              outs: list[Layout], gather: bool, cost: NewtonSchulz):
  """The per-device body: pack, all-to-all, reassemble, Newton–Schulz, send back."""
  axes, n, sizes = tuple(mesh.axis_names), mesh.size, dict(mesh.shape)

  def split_ok(item, g):
    i = item[0]
    return (split_ns is not None and ins[i].block[1] % g == 0
            and (gather or outs[i].grid[1] == ins[i].grid[1]))

  rounds = plan_rounds(shapes, n, cost, split_ok)
  dtype = jnp.result_type(*dtypes)
  piece = lambda i, g: math.ceil(math.prod(ins[i].block) // g / ins[i].replicas)
  where = {}  # item -> (round, its first device)
  for t, r in enumerate(rounds):
    for d, item in enumerate(r.slots):
      where.setdefault(item, (t, d))

  def variants(r: Round):
    """The stacks of a round's members, and each device's index into them (an empty
    slot takes the first member's: its pieces are zeros, any reassembly works)."""
    keys = list(dict.fromkeys(item[0] for item in r.slots if item is not None))
    return keys, [keys.index(item[0]) if item is not None else 0 for item in r.slots]

  def lower(stacks):
    # Each device's share of every matrix: its block (column part p of g), split
    # between the block's replicas: shares[(i, g)] has shape (count, g, piece).
    shares = {}
    for i, g in {(item[0], r.split) for r in rounds for item in r.slots if item is not None}:
      lay, q, x = ins[i], piece(i, g), stacks[i].astype(dtype)
      bh, bw = lay.block
      x = x.reshape(-1, bh, g, bw // g).transpose(0, 2, 1, 3).reshape(x.shape[0], g, -1)
      if lay.replicas > 1:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, q * lay.replicas - x.shape[2])))
        rest = tuple(a for a in axes if a not in spec_axes(lay.spec[1]) + spec_axes(lay.spec[2]))
        x = jax.lax.dynamic_slice_in_dim(x, _linear_index(rest, sizes) * q, q, axis=2)
      shares[(i, g)] = x
    width = [max(piece(item[0], r.split) for item in r.slots if item is not None) for r in rounds]
    rows = []
    for d in range(n):  # the buffer row for owner d: its slot of every round
      row = []
      for r, w in zip(rounds, width):
        item = r.slots[d]
        if item is None:
          row.append(jnp.zeros((w,), dtype))
        else:
          share = shares[(item[0], r.split)][item[1], d % r.split]
          row.append(jnp.pad(share, (0, w - share.shape[0])))
      rows.append(jnp.concatenate(row))
    recv = jax.lax.all_to_all(jnp.stack(rows), axes, 0, 0, tiled=True)  # row s: from device s

    def assemble(i, r: Round):
      lay, q, (rows_, cols) = ins[i], piece(i, r.split), shapes[i][1:]
      bh, bw = lay.block[0], lay.block[1] // r.split
      order = np.asarray(sorted(range(n), key=lambda s: lay.where[s]))
      def fn(seg):
        x = seg[order, :q].reshape(*lay.grid, lay.replicas * q)[..., :bh * bw]
        x = x.reshape(*lay.grid, bh, bw).transpose(0, 2, 1, 3).reshape(rows_, cols // r.split)
        return jnp.pad(x, ((0, r.rows - rows_), (0, (r.cols - cols) // r.split)))
      return fn

    mats, start = [], 0
    for r, w in zip(rounds, width):
      keys, table = variants(r)
      mats.append(_switch(table, [assemble(i, r) for i in keys], axes, sizes,
                          recv[:, start:start + w]))
      start += w
    results = list(mats)
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for t, (r, x) in enumerate(zip(rounds, mats)):
      by_shape.setdefault((*x.shape, r.split), []).append(t)
    for (_, _, g), members in by_shape.items():  # local Newton–Schulz, one batch per shape
      batch = jnp.stack([mats[t] for t in members])
      batch = ns_fn(batch) if g == 1 else split_ns(batch, g, axes, n)
      for k, t in enumerate(members):
        results[t] = batch[k]

    if gather:  # every device gets every result
      sent = jax.lax.all_gather(jnp.concatenate([x.reshape(-1) for x in results]), axes,
                                tiled=False)
      offsets = np.cumsum([0] + [x.size for x in results])
      def result(i, j):
        (t, d), r = where[(i, j)], rounds[where[(i, j)][0]]
        ak, bw = ins[i].grid[1], ins[i].block[1] // r.split
        parts = [sent[d + p, offsets[t]:offsets[t + 1]].reshape(results[t].shape)
                 for p in range(r.split)]
        x = jnp.stack([x[:shapes[i][1], :shapes[i][2] // r.split] for x in parts])
        return x.reshape(r.split, -1, ak, bw).transpose(1, 2, 0, 3).reshape(shapes[i][1:])
    else:  # every device gets its block of every result, in the wanted layout
      w_out = [max(math.prod(outs[item[0]].block) // r.split for item in r.slots if item)
               for r in rounds]
      def blocks(i, r: Round, w):
        lay, (rows_, cols) = outs[i], shapes[i][1:]
        bh, bw = lay.block[0], lay.block[1] // r.split
        pick = np.asarray([lay.where[s][0] * lay.grid[1] + lay.where[s][1] for s in range(n)])
        def fn(x):
          b = x[:rows_, :cols // r.split].reshape(lay.grid[0], bh, lay.grid[1], bw)
          b = b.transpose(0, 2, 1, 3).reshape(-1, bh * bw)[pick]
          return jnp.pad(b, ((0, 0), (0, w - bh * bw)))
        return fn
      parts = []
      for r, x, w in zip(rounds, results, w_out):
        keys, table = variants(r)
        parts.append(_switch(table, [blocks(i, r, w) for i in keys], axes, sizes, x))
      back = jax.lax.all_to_all(jnp.concatenate(parts, axis=1), axes, 0, 0, tiled=True)
      offsets = np.cumsum([0] + w_out)
      def result(i, j):
        (t, d), r = where[(i, j)], rounds[where[(i, j)][0]]
        bh, bw = outs[i].block[0], outs[i].block[1] // r.split
        return jnp.concatenate([back[d + p, offsets[t]:offsets[t] + bh * bw].reshape(bh, bw)
                                for p in range(r.split)], axis=1)
    return [jnp.stack([result(i, j) for j in range(shape[0])]).astype(dt)
            for i, (shape, dt) in enumerate(zip(shapes, dtypes))]

  return lower


def sharded_solver(ns_fn: Callable[[jax.Array], jax.Array], mesh: Mesh, *,
                   split_fn: Optional[Callable] = None, cost: NewtonSchulz = DEFAULT_NS):
  """A solver for `orthogonalize_leaves` that runs `ns_fn` on whole matrices dealt
  over the mesh, with one packed exchange in and one out (see the module doc).
  `split_fn(x, parts, reduce)` (`newton_schulz_column_parts` with `ns_fn`'s settings)
  runs matrices split by columns over several devices; without it every matrix is
  orthogonalized whole. `cost` (the settings `ns_fn` runs) sizes the flop estimates
  that balance the work. Matrices are dealt over every device of the mesh."""
  split_ns = None if split_fn is None else (
      lambda x, g, axes, n: split_fn(x, g, lambda v, op: _group_reduce(v, op, g, axes, n)))

  def partition(mesh_, arg_shapes, result_shape):
    (args,) = arg_shapes
    shapes = [tuple(a.shape) for a in args]
    ins = [layout_of(a.sharding, s, mesh_) for a, s in zip(args, shapes)]
    outs = [layout_of(r.sharding, s, mesh_) for r, s in zip(result_shape, shapes)]
    gather = all(lay.grid == (1, 1) for lay in outs)
    lower = _exchange(ns_fn, split_ns, mesh_, shapes, [a.dtype for a in args], ins, outs,
                      gather, cost)
    named = lambda layouts: [NamedSharding(mesh_, lay.spec) for lay in layouts]
    return mesh_, lower, named(outs), (named(ins),)

  def infer(mesh_, arg_shapes, result_shape):  # GSPMD only: results like the arguments
    return [NamedSharding(mesh_, layout_of(a.sharding, tuple(a.shape), mesh_).spec)
            for a in arg_shapes[0]]

  def solve_auto(stacks):
    @custom_partitioning
    def solve_all(xs):  # unpartitioned meaning: each stack orthogonalized in place
      return [ns_fn(x) for x in xs]
    # Shardy rule: the results share no factor with the arguments, so each side keeps
    # the layout its neighbours give it and `partition` sees both.
    dims = lambda k: " ".join(f"{c}{k}" for c in "abc")
    count = len(stacks)
    rule = (", ".join(dims(k) for k in range(count)) + " -> "
            + ", ".join(dims(k + count) for k in range(count)))
    solve_all.def_partition(partition=partition, infer_sharding_from_operands=infer,
                            sharding_rule=rule)
    return solve_all(list(stacks))

  def solve(stacks, like=None):
    """`like`: arrays (the params as stacks) whose layout the results should take;
    on Auto axes XLA finds that layout itself."""
    if not stacks:
      return []
    if not is_explicit(mesh):
      return solve_auto(stacks)
    # Explicit axes: exchange in Auto mode, hand results back in `like`'s layout.
    out = [jax.typeof(s).sharding for s in (stacks if like is None else like)]
    return jax.sharding.auto_axes(solve_auto, out_sharding=out)(list(stacks))

  return solve
