"""Newton–Schulz on a device mesh: one packed exchange in, whole matrices, one out.

Every matrix is orthogonalized whole on one *owner* device; no collective runs inside
the iterations. The assignment is static, computed from the shapes at trace time and
balanced by flops: same-shape matrices are dealt in *rounds* (one matrix per device);
the few left over in each shape group (fewer than the device count) share rounds,
largest first, zero-padded to the round's largest shape. Zero-padding is exact for
Newton–Schulz (X Xᵀ keeps its block structure, ‖X‖_F is unchanged) and an empty slot
is an all-zero matrix, whose result is 0.

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
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz import newton_schulz_flops
from muon_optax._state_sharding import check_data_axis

Item = tuple[int, int]  # (stack index, matrix index in that stack)


class Round(NamedTuple):
  rows: int
  cols: int
  slots: tuple[Optional[Item], ...]  # one per device; None is an all-zero matrix


def plan_rounds(shapes: list[tuple[int, int, int]], devices: int) -> list[Round]:
  """Deals the matrices of stacks with shapes (count, rows, cols) over `devices`.

  Each shape group fills as many full rounds as it can; the leftovers of all groups
  are packed largest first into shared rounds of their largest member's shape.
  """
  groups: dict[tuple[int, int], list[Item]] = {}
  for i, (count, rows, cols) in enumerate(shapes):
    groups.setdefault((rows, cols), []).extend((i, j) for j in range(count))
  rounds, leftovers = [], []
  for (rows, cols), items in groups.items():
    full = len(items) - len(items) % devices
    rounds += [Round(rows, cols, tuple(items[s:s + devices])) for s in range(0, full, devices)]
    leftovers += [((rows, cols), item) for item in items[full:]]
  # Largest first, so each shared round pads its members as little as possible.
  leftovers.sort(key=lambda e: -newton_schulz_flops(*e[0], 1))
  for start in range(0, len(leftovers), devices):
    chunk = leftovers[start:start + devices]
    rows = max(shape[0] for shape, _ in chunk)
    cols = max(shape[1] for shape, _ in chunk)
    slots = tuple(item for _, item in chunk) + (None,) * (devices - len(chunk))
    rounds.append(Round(rows, cols, slots))
  return rounds


def per_device_flops(shapes: list[tuple[int, int, int]], devices: int, steps: int) -> int:
  """Newton–Schulz flops each device runs under `plan_rounds`."""
  return sum(newton_schulz_flops(r.rows, r.cols, steps) for r in plan_rounds(shapes, devices))


class Layout(NamedTuple):
  """How a (count, rows, cols) stack lies on the mesh: every device holds the same
  (bh, bw) block of each matrix; `where[s]` = (block row, block col, replica) of
  device s (row-major over the mesh axes) and `grid` = (block rows, block cols)."""

  spec: P
  grid: tuple[int, int]
  block: tuple[int, int]
  replicas: int
  where: tuple[tuple[int, int, int], ...]


def _axes(entry) -> tuple[str, ...]:
  return entry if isinstance(entry, tuple) else () if entry is None else (entry,)


def layout_of(sharding, shape: tuple[int, int, int], mesh: Mesh) -> Layout:
  """The supported layout closest to `sharding`: the count axis unsplit and the
  matrix axes split evenly; axes it drops make the block replicated over them."""
  spec = list(getattr(sharding, "spec", P())) + [None] * 3
  sizes = dict(mesh.shape)
  keep = [()]
  for dim in (1, 2):
    axes = _axes(spec[dim])
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


def _exchange(ns_fn, mesh: Mesh, shapes, dtypes, ins: list[Layout], outs: list[Layout],
              gather: bool):
  """The per-device body: pack, all-to-all, reassemble, Newton–Schulz, send back."""
  axes, n, sizes = tuple(mesh.axis_names), mesh.size, dict(mesh.shape)
  rounds = plan_rounds(shapes, n)
  dtype = jnp.result_type(*dtypes)
  piece = [math.ceil(lay.block[0] * lay.block[1] / lay.replicas) for lay in ins]

  def variants(r: Round, key):
    """Distinct keys of a round's members, and each device's index into them (an
    empty slot takes the first member's: its pieces are zeros, any reassembly works)."""
    keys = list(dict.fromkeys(key(item) for item in r.slots if item is not None))
    return keys, [keys.index(key(item)) if item is not None else 0 for item in r.slots]

  def lower(stacks):
    # Each device's share of every matrix: its block, split between the block's replicas.
    shares = []
    for x, lay, q in zip(stacks, ins, piece):
      flat = x.astype(dtype).reshape(x.shape[0], -1)
      if lay.replicas > 1:
        flat = jnp.pad(flat, ((0, 0), (0, q * lay.replicas - flat.shape[1])))
        rest = tuple(a for a in axes if a not in set(_axes(lay.spec[1]) + _axes(lay.spec[2])))
        flat = jax.lax.dynamic_slice_in_dim(flat, _linear_index(rest, sizes) * q, q, axis=1)
      shares.append(flat)
    width = [max(piece[item[0]] for item in r.slots if item is not None) for r in rounds]
    rows = []
    for d in range(n):  # the buffer row for owner d: its slot of every round
      rows.append(jnp.concatenate([
          jnp.pad(shares[item[0]][item[1]], (0, w - piece[item[0]])) if item is not None
          else jnp.zeros((w,), dtype) for r, w in zip(rounds, width) for item in (r.slots[d],)]))
    recv = jax.lax.all_to_all(jnp.stack(rows), axes, 0, 0, tiled=True)  # row s: from device s

    def assemble(i, r: Round):
      lay, q, (rows_, cols) = ins[i], piece[i], shapes[i][1:]
      order = sorted(range(n), key=lambda s: lay.where[s])
      def fn(seg):
        x = seg[np.asarray(order), :q].reshape(*lay.grid, lay.replicas * q)
        x = x[..., :lay.block[0] * lay.block[1]].reshape(*lay.grid, *lay.block)
        x = x.transpose(0, 2, 1, 3).reshape(rows_, cols)
        return jnp.pad(x, ((0, r.rows - rows_), (0, r.cols - cols)))
      return fn

    mats, start = [], 0
    for r, w in zip(rounds, width):
      keys, table = variants(r, lambda item: item[0])
      mats.append(_switch(table, [assemble(i, r) for i in keys], axes, sizes,
                          recv[:, start:start + w]))
      start += w
    results = list(mats)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for t, r in enumerate(rounds):
      by_shape.setdefault((r.rows, r.cols), []).append(t)
    for members in by_shape.values():  # local Newton–Schulz, one batch per shape
      batch = ns_fn(jnp.stack([mats[t] for t in members]))
      for k, t in enumerate(members):
        results[t] = batch[k]

    if gather:  # every device gets every result
      sent = jax.lax.all_gather(jnp.concatenate([x.reshape(-1) for x in results]), axes,
                                tiled=False)
      offsets = np.cumsum([0] + [r.rows * r.cols for r in rounds])
      where = {item: (d, t) for t, r in enumerate(rounds) for d, item in enumerate(r.slots)}
      def result(i, j):
        d, t = where[(i, j)]
        x = sent[d, offsets[t]:offsets[t + 1]].reshape(rounds[t].rows, rounds[t].cols)
        return x[:shapes[i][1], :shapes[i][2]]
    else:  # every device gets its block of every result, in the wanted layout
      def blocks(i, r: Round):
        lay, (rows_, cols) = outs[i], shapes[i][1:]
        bh, bw = lay.block
        pick = np.asarray([lay.where[s][0] * lay.grid[1] + lay.where[s][1] for s in range(n)])
        def fn(x):
          b = x[:rows_, :cols].reshape(lay.grid[0], bh, lay.grid[1], bw).transpose(0, 2, 1, 3)
          b = b.reshape(-1, bh * bw)[pick]
          return jnp.pad(b, ((0, 0), (0, w_out[id(r)] - bh * bw)))
        return fn
      w_out = {id(r): max(math.prod(outs[item[0]].block) for item in r.slots if item is not None)
               for r in rounds}
      parts = []
      for r, x in zip(rounds, results):
        keys, table = variants(r, lambda item: item[0])
        parts.append(_switch(table, [blocks(i, r) for i in keys], axes, sizes, x))
      back = jax.lax.all_to_all(jnp.concatenate(parts, axis=1), axes, 0, 0, tiled=True)
      offsets = np.cumsum([0] + [w_out[id(r)] for r in rounds])
      where = {item: (d, t) for t, r in enumerate(rounds) for d, item in enumerate(r.slots)}
      def result(i, j):
        d, t = where[(i, j)]
        size = math.prod(outs[i].block)
        return back[d, offsets[t]:offsets[t] + size].reshape(outs[i].block)
    return [jnp.stack([result(i, j) for j in range(shape[0])]).astype(dt)
            for i, (shape, dt) in enumerate(zip(shapes, dtypes))]

  return lower


def mesh_axes(mesh: Mesh, data_axis: str) -> tuple[str, ...]:
  """All mesh axes, data axis first: the matrices are dealt over every device."""
  check_data_axis(mesh, data_axis)
  return (data_axis,) + tuple(a for a in mesh.axis_names if a != data_axis)


def is_explicit(mesh: Mesh) -> bool:
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def sharded_solver(ns_fn: Callable[[jax.Array], jax.Array], mesh: Mesh, data_axis: str):
  """A solver for `orthogonalize_leaves` that runs `ns_fn` on whole matrices dealt
  over the mesh, with one packed exchange in and one out (see the module doc)."""
  mesh_axes(mesh, data_axis)

  def partition(mesh_, arg_shapes, result_shape):
    (args,) = arg_shapes
    shapes = [tuple(a.shape) for a in args]
    ins = [layout_of(a.sharding, s, mesh_) for a, s in zip(args, shapes)]
    outs = [layout_of(r.sharding, s, mesh_) for r, s in zip(result_shape, shapes)]
    gather = all(lay.grid == (1, 1) for lay in outs)
    lower = _exchange(ns_fn, mesh_, shapes, [a.dtype for a in args], ins, outs, gather)
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

  def solve(stacks):
    if not stacks:
      return []
    if not is_explicit(mesh):
      return solve_auto(stacks)
    # Explicit axes: exchange in Auto mode, hand results back with the inputs' shardings.
    out = [jax.typeof(s).sharding for s in stacks]
    return jax.sharding.auto_axes(solve_auto, out_sharding=out)(list(stacks))

  return solve
