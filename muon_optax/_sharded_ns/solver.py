"""Newton–Schulz on a device mesh: one packed exchange in, local work, one out.

The assignment is static, computed from the shapes at trace time (`rounds.plan_rounds`)
and balanced by flops: same-shape matrices are dealt in *rounds* (one matrix per
device), each round of one shape. The few left over in a shape group fill a partial
round of their own, or are split by columns over groups of g devices, g chosen per
round (rounds of different splits fill the devices): NS(X) restricted to some columns
only needs the whole X Xᵀ, summed over the g parts wherever the iteration forms it
(`newton_schulz_column_parts`). Whole matrices need no collective inside the iterations.
Partial rounds lie on devices the others leave free (`rounds.placed`), and rounds on
disjoint devices share one slot of the buffers: a device receives its own round's
pieces there, zeros only where no round has a matrix for it.
The local work runs one round after another (the split rounds of one shape and split
together, as many as fit the memory cap, `MeshLayout.memory`), each waiting on the last
one's results, so that one round's temporaries are live at a time; the rounds travel in
`MeshLayout.exchanges` exchanges, one after another.

The exchange is a `jax.shard_map`, which every backend compiles (TPU included), over
the mesh's devices with each axis cut into its prime factors (`FactorMesh`): a group of
g consecutive devices is then a set of trailing factor axes, which collectives can name.
Its layouts are given, not discovered: the stacks lie as the state does
(`state_shardings`), and the results go where `MeshLayout` says the params are.
- in: each device cuts its block of every matrix into one piece per owner (a
  block replicated over some mesh axes is split between its replicas), packs all
  pieces, transposed, into one flat buffer row per owner, and a single all-to-all
  delivers them; the owner reassembles its matrices from the pieces (a matrix split
  by columns: its transpose's row blocks, one reshape);
- out: if every update is wanted replicated (ZeRO-1 with replicated params), one
  all-gather of the owners' packed results; otherwise one all-to-all sends each
  device its block of every result, in the layout the update is wanted in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz.settings import DEFAULT_NS, NewtonSchulz
from muon_optax._placement.peer_rows import from_every_peer, to_peers
from muon_optax._placement.shardings import shard_mapped, spec_axes
from muon_optax._sharded_ns.column_parts import block_rows, blocks_in, blocks_out
from muon_optax._sharded_ns.exchange_schedule import (
  ExchangePlan,
  Unit,
  chunks,
  out_slice,
  piece,
  slice_width,
  units,
)
from muon_optax._sharded_ns.factor_mesh import FactorMesh, linear_index
from muon_optax._sharded_ns.in_place import in_place
from muon_optax._sharded_ns.rounds import Round, plan_rounds
from muon_optax._sharded_ns.split_cost import FLOPS_PER_BYTE, memory_budget, rows_split
from muon_optax._sharded_ns.stack_shards import Layout, layout_of, owned
from muon_optax._sharded_ns.static_rows import take_rows
from muon_optax._util.order import after


def _switch(index_table: list[int], branches: list[Callable], axes, sizes, *args):
  """`branches[index_table[this device]](*args)`, statically when all agree."""
  if len(set(index_table)) == 1:
    return branches[index_table[0]](*args)
  index = jnp.asarray(index_table, jnp.int32)[linear_index(axes, sizes)]
  return jax.lax.switch(index, branches, *args)


class _Exchange:
  """The per-device body of the exchange: pack, all-to-all, reassemble, Newton–Schulz,
  send back. Built once from the static plan; `run` does one exchange of some rounds."""

  def __init__(self, ns_fn, split_ns, fmesh: FactorMesh, shapes, dtypes, ins: list[Layout],
               outs: list[Layout], gather: bool, units_of: Callable[[list[Round]], list[Unit]]):
    self.ns_fn, self.split_ns, self.fmesh, self.units_of = ns_fn, split_ns, fmesh, units_of
    self.shapes, self.dtypes, self.ins, self.outs, self.gather = shapes, dtypes, ins, outs, gather
    mesh = fmesh.mesh
    self.axes, self.n, self.sizes = tuple(mesh.axis_names), mesh.size, dict(mesh.shape)
    self.dtype = jnp.result_type(*dtypes)
    # Stacks that lie alike (in and out) share one kind: its number, by stack.
    kinds = {}
    self.kind = [kinds.setdefault(pair, len(kinds)) for pair in zip(ins, outs)]

  def variants(self, r: Round):
    """One stack of each layout (in and out) among a round's members, and each device's
    index into them: stacks that lie alike are assembled and sent back alike, so a
    round of one layout needs no switch over its devices, however many leaves it
    holds. A device with no matrix in the round takes the first member's: its
    result is never read, any works."""
    first = {}
    for item in r.slots:
      if item is not None:
        first.setdefault(self.kind[item[0]], item[0])
    kinds = list(first)
    return ([first[k] for k in kinds],
            [kinds.index(self.kind[item[0]]) if item is not None else 0 for item in r.slots])

  def shares(self, stacks, plan: ExchangePlan) -> dict:
    """Each device's share of every matrix: its block (column part p of g), transposed
    and split between the block's replicas: shares[(i, g)] has shape (count, g, piece).
    Transposed, the pieces of a column-sharded matrix stack up as its transpose's row
    blocks, so that its owner assembles it with a reshape, not a relayout of the whole
    matrix (a TPU's tiled layouts make that a copy, or three)."""
    shares = {}
    sliced = [t for t in range(len(plan.rounds)) if t not in plan.blockwise]
    for i, g in {(item[0], plan.rounds[t].split) for t in sliced for item in plan.rounds[t].slots
                 if item is not None}:
      lay, x = self.ins[i], stacks[i].astype(self.dtype)
      q, bh, sw = piece(lay, g), lay.block[0], slice_width(lay, g)
      x = jnp.pad(x, ((0, 0), (0, 0), (0, g * sw - lay.block[1])))
      x = x.reshape(-1, bh, g, sw).transpose(0, 2, 3, 1).reshape(x.shape[0], g, -1)
      if lay.replicas > 1:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, q * lay.replicas - x.shape[2])))
        rest = tuple(a for a in self.axes
                     if a not in spec_axes(lay.spec[1]) + spec_axes(lay.spec[2]))
        x = jax.lax.dynamic_slice_in_dim(x, linear_index(rest, self.sizes) * q, q, axis=2)
      shares[(i, g)] = x
    return shares

  def send(self, stacks, plan: ExchangePlan):
    """The exchange in: (what each device received, row s from device s; the block-wise
    rounds' parts)."""
    shares = self.shares(stacks, plan)
    sliced = [k for k, members in enumerate(plan.slots) if members[0] not in plan.blockwise]
    blocks = []  # the buffer's rows, a segment of devices at a time (`segments`)
    for _, count, where in plan.segments(sliced):
      block = []
      for k, (span, offset) in zip(sliced, where):
        w = plan.slot_width[k]
        if span.round is None:
          block.append(jnp.zeros((count, w), self.dtype))
          continue
        g = plan.rounds[span.round].split
        j0, j1 = offset // g, -(-(offset + count) // g)  # the matrices the devices hold
        x = shares[(span.stack, g)][span.first + j0:span.first + j1]
        x = x.reshape((j1 - j0) * g, -1)[offset - j0 * g:offset - j0 * g + count]
        block.append(jnp.pad(x, ((0, 0), (0, w - x.shape[1]))))
      blocks.append(jnp.concatenate(block, axis=1))
    recv = to_peers(blocks, self.axes) if blocks else None
    by_block = blocks_in({t: plan.rounds[t] for t in plan.blockwise}, stacks, self.fmesh,
                          self.dtype)
    return recv, by_block

  def assembler(self, i, r: Round, width: int):
    """Matrix i of round r (column part, zero-padded to `width`) from its received pieces."""
    lay, rows_ = self.ins[i], self.shapes[i][1]
    q, bh, sw = piece(lay, r.split), lay.block[0], slice_width(lay, r.split)
    order = sorted(range(self.n), key=lambda s: lay.where[s])

    def fn(seg):
      x = take_rows(seg, order)[:, :q].reshape(*lay.grid, lay.replicas * q)[..., :bh * sw]
      xt = x.reshape(*lay.grid, sw, bh).transpose(1, 2, 0, 3).reshape(-1, rows_)
      return jnp.pad(xt, ((0, width - xt.shape[0]), (0, 0))).T  # zero columns: exact
    return fn

  def matrix(self, t: int, recv, by_block, plan: ExchangePlan):
    """This device's matrix (or column part) of round t. A device with none in it gets
    whatever its slot holds: its result is never read."""
    if t in plan.blockwise:
      return by_block[t]()
    r, start = plan.rounds[t], plan.start[t]
    keys, table = self.variants(r)
    return _switch(table, [self.assembler(i, r, plan.round_width[t]) for i in keys], self.axes,
                   self.sizes, recv[:, 0, start:start + plan.width[t]])

  def solve(self, recv, by_block, plan: ExchangePlan, keep: Callable) -> list:
    """Each round's matrix assembled, orthogonalized and passed to `keep(t, result)`, one
    unit after another (`exchange_schedule.units`): the next unit's assembly waits for what
    the last one kept (`after`), so that its matrices and Newton–Schulz temporaries are
    not live at the same time as theirs; a unit's m×m products are formed in as many
    blocks as it says. The other rounds of a slot are assembled with its first, before
    its Newton–Schulz, so that the buffer they arrived in is not kept live for them.
    Returns what `keep` returned, by round."""
    kept, last, early = {}, None, {}
    for unit, product_blocks in self.units_of(plan.rounds):
      batch = jnp.stack([early.pop(t) if t in early else self.matrix(t, recv, by_block, plan)
                         for t in unit])
      mates = {u for t in unit for u in plan.slots[plan.slot[t]]} - set(unit) - set(kept)
      early.update((u, self.matrix(u, recv, by_block, plan)) for u in mates - set(early))
      # The last unit was one batch: one value of it suffices. The slot's other rounds
      # are assembled before this Newton–Schulz: left free, the TPU compiler assembles
      # them late and keeps the buffer they arrived in live all along.
      batch = after(batch, ([] if last is None else [last]) + [early[u] for u in sorted(mates)])
      g = plan.rounds[unit[0]].split
      batch = self.ns_fn(batch) if g == 1 else self.split_ns(batch, g, product_blocks)
      kept.update((t, keep(t, batch[k])) for k, t in enumerate(unit))
      last = kept[unit[0]]
    return [kept[t] for t in range(len(plan.rounds))]

  def shared(self, plan: ExchangePlan, k: int, xs: list, width: int):
    """Slot k of a buffer: on each device, what `xs` (one per round of the slot) holds
    for the round it has a matrix in, its last axis zero-padded to `width`. Selected,
    not switched: a select fuses into the buffer it fills, where a branch's result
    would be a buffer of its own."""
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    table = plan.table(k)
    if len(set(table)) == 1:
      return pad(xs[table[0]])
    index = jnp.asarray(table, jnp.int32)[linear_index(self.axes, self.sizes)]
    out = pad(xs[0])
    for m in range(1, len(xs)):
      out = jnp.where(index == m, pad(xs[m]), out)
    return out

  def gathered(self, results, plan: ExchangePlan) -> tuple[dict, list]:
    """Every device gets every result: one all-gather of the owners' packed results.
    Returns the results and the collective's output."""
    n, ins, shapes = self.n, self.ins, self.shapes
    sizes = [max(results[t].size for t in members) for members in plan.slots]
    sent = from_every_peer(
        jnp.concatenate([self.shared(plan, k, [results[t].reshape(-1) for t in members], size)
                         for k, (members, size) in enumerate(zip(plan.slots, sizes))]),
        self.axes)
    offsets = np.cumsum([0] + sizes)

    def result(i, j):
      (t, d), r = plan.where[(i, j)], plan.rounds[plan.where[(i, j)][0]]
      (rows_, cols), ak, sw = shapes[i][1:], ins[i].grid[1], slice_width(ins[i], r.split)
      start = offsets[plan.slot[t]]
      parts = sent[d:d + r.split, 0, start:start + results[t].size]
      parts = parts.reshape(r.split, *results[t].shape)
      if t in plan.blockwise:  # part p: blocks q·g + p, q = 0, 1, …
        x = parts.reshape(r.split, rows_, n // r.split, ins[i].block[1])
        return x.transpose(1, 2, 0, 3).reshape(rows_, cols)
      x = parts[:, :, :ak * sw].reshape(r.split, rows_, ak, sw)
      x = x.transpose(1, 2, 0, 3).reshape(rows_, ak, r.split * sw)
      return x[:, :, :ins[i].block[1]].reshape(rows_, cols)
    return {item: result(*item) for item in plan.where if item is not None}, [sent]

  def blocks_of(self, i, r: Round, w):
    """Every device's block of result i, in the wanted layout, one row per device."""
    lay, rows_ = self.outs[i], self.shapes[i][1]
    bh, sw = lay.block[0], out_slice(self.ins[i], self.outs[i], r.split)
    pick = [lay.where[s][0] * lay.grid[1] + lay.where[s][1] for s in range(self.n)]

    def fn(x):
      b = x[:rows_, :lay.grid[1] * sw].T.reshape(lay.grid[1], sw, lay.grid[0], bh)
      b = take_rows(b.transpose(2, 0, 1, 3).reshape(-1, bh * sw), pick)
      return jnp.pad(b, ((0, 0), (0, w - bh * sw)))
    return fn

  def to_send(self, t: int, x, plan: ExchangePlan):
    """What goes back of round t's result x: every device's block of it, one row per
    device (all of it when gathered; a block-wise round's, by its residue class:
    `block_rows`)."""
    if self.gather:
      return x
    if t in plan.blockwise:
      return block_rows(x, self.n // plan.rounds[t].split)
    r = plan.rounds[t]
    keys, table = self.variants(r)
    return _switch(table, [self.blocks_of(i, r, plan.back_width[t]) for i in keys], self.axes,
                   self.sizes, x)

  def scattered(self, sent, plan: ExchangePlan) -> tuple[dict, list]:
    """Every device gets its block of every result, in the wanted layout: one all-to-all
    of what `to_send` made of them. Returns the results and the collectives' outputs."""
    outs = self.outs
    parts = [self.shared(plan, k, [sent[t] for t in members], plan.back_slot_width[k])
             for k, members in enumerate(plan.slots) if members[0] not in plan.blockwise]
    back = to_peers([jnp.concatenate(parts, axis=1)], self.axes) if parts else None
    by_block, received = blocks_out({t: plan.rounds[t] for t in plan.blockwise}, sent,
                                     self.fmesh, self.dtype)

    def result(i, j):
      (t, d), r = plan.where[(i, j)], plan.rounds[plan.where[(i, j)][0]]
      if t in plan.blockwise:  # matrix q of the round, from the owner of this device's block
        return by_block[t][d // r.split]
      bh, sw = outs[i].block[0], out_slice(self.ins[i], self.outs[i], r.split)
      start = plan.back_start[t]
      x = back[d:d + r.split, 0, start:start + bh * sw].reshape(r.split, sw, bh)
      x = x.transpose(2, 0, 1).reshape(bh, r.split * sw)
      return x[:, :outs[i].block[1]]
    results = {item: result(*item) for item in plan.where if item is not None}
    return results, [x for x in [back, *received] if x is not None]

  def run(self, stacks, rounds: list[Round], wait=()) -> tuple[dict, list]:
    """One exchange of the matrices of `rounds`, sent once the arrays in `wait` are
    computed: ({item: its result, in the wanted layout}, the arrays that are computed
    once it is done)."""
    plan = ExchangePlan.of(rounds, self.ins, self.outs, self.gather, self.n)
    recv, by_block = self.send(after(stacks, wait), plan)
    sent = self.solve(recv, by_block, plan, lambda t, x: self.to_send(t, x, plan))
    return self.gathered(sent, plan) if self.gather else self.scattered(sent, plan)


def _exchange(ns_fn, split_ns, fmesh: FactorMesh, shapes, dtypes, ins: list[Layout],
              outs: list[Layout], gather: bool, cost: NewtonSchulz, chunks_of: int = 1,
              flops_per_byte: float = FLOPS_PER_BYTE, memory: Optional[float] = None):
  """The per-device body over all rounds, in `chunks_of` exchanges one after another, so
  that only one's buffers are live at once; `memory` caps one unit's working set, as
  a multiple of these stacks' shard (`MeshLayout.memory`; None: the default cap)."""
  def split_ok(item, g):
    i = item[0]
    return split_ns is not None and (gather or outs[i].grid == ins[i].grid)

  n = fmesh.mesh.size
  budget = memory_budget(shapes, n, memory)
  rounds = plan_rounds(shapes, n, cost, split_ok, fmesh.groups(), [lay.grid[1] for lay in ins],
                       flops_per_byte, budget)
  exchange = _Exchange(ns_fn, split_ns, fmesh, shapes, dtypes, ins, outs, gather,
                       lambda rounds: units(rounds, budget, cost))
  parts = chunks(rounds, chunks_of)

  def lower(stacks):
    done, finished = {}, []
    for chunk in parts:  # one after another, each sent once the last one's results are in
      results, finished = exchange.run(stacks, chunk, wait=finished)
      done.update(results)
    return [jnp.stack([done[i, j] for j in range(shape[0])]).astype(dt)
            for i, (shape, dt) in enumerate(zip(shapes, dtypes))]

  return lower


def _exchanged(ns_fn, split_fn, layout, cost, stacks, specs, out_specs):
  """The exchange of `stacks` (lying in `specs`, over the layout's mesh) as a shard_map
  over the factor mesh, its results laid out in `out_specs` (or replicated). Owned stacks
  stay where they are."""
  fmesh = FactorMesh.of(layout.mesh)
  mine = [owned(spec, tuple(x.shape), layout.mesh) for x, spec in zip(stacks, specs)]
  if any(mine):
    wanted = out_specs or [None] * len(stacks)
    rest = [k for k, m in enumerate(mine) if not m]
    moved = iter(_exchanged(ns_fn, split_fn, layout, cost, [stacks[k] for k in rest],
                            [specs[k] for k in rest],
                            None if out_specs is None else [out_specs[k] for k in rest])
                 if rest else [])
    return [in_place(ns_fn, fmesh, x, spec, out) if m else next(moved)
            for x, spec, out, m in zip(stacks, specs, wanted, mine)]
  shapes = [tuple(s.shape) for s in stacks]
  ins = [layout_of(NamedSharding(fmesh.mesh, fmesh.spec(spec)), shape, fmesh.mesh)
         for spec, shape in zip(specs, shapes)]
  gather = out_specs is None
  outs = ([layout_of(NamedSharding(fmesh.mesh, P()), shape, fmesh.mesh) for shape in shapes]
          if gather else
          [layout_of(NamedSharding(fmesh.mesh, fmesh.spec(spec)), shape, fmesh.mesh)
           for spec, shape in zip(out_specs, shapes)])
  def split_ns(x, g, product_blocks):
    rows = fmesh.row_blocks(g, product_blocks) if rows_split(x.shape[-2], g) else None
    return split_fn(x, g, lambda v, op: fmesh.group_reduce(v, op, g), rows=rows)
  lower = _exchange(ns_fn, None if split_fn is None else split_ns, fmesh, shapes,
                    [s.dtype for s in stacks], ins, outs, gather, cost, layout.exchanges,
                    layout.flops_per_byte, layout.memory)
  body = shard_mapped(lambda *xs: tuple(lower(list(xs))), fmesh.mesh,
                      tuple(lay.spec for lay in ins), tuple(lay.spec for lay in outs))
  return list(body(*stacks))


def sharded_solver(ns_fn: Callable[[jax.Array], jax.Array], layout, *,
                   split_fn: Optional[Callable] = None, cost: NewtonSchulz = DEFAULT_NS):
  """A solver for `orthogonalize_leaves` that runs `ns_fn` on whole matrices dealt
  over the mesh of `layout` (a `MeshLayout`), with one packed exchange in and one out
  (see the module doc). `split_fn(x, parts, reduce)` (`newton_schulz_column_parts` with
  `ns_fn`'s settings) runs matrices split by columns over several devices; without it
  every matrix is orthogonalized whole. `cost` (the settings `ns_fn` runs) sizes the flop
  estimates that balance the work.

  The solver takes the stacks, the PartitionSpec (over the mesh) each lies in, and the
  specs its results are wanted in, or None for replicated results.
  """
  def solve(stacks, specs, out_specs=None):
    if not stacks:
      return []
    if layout.mesh.size == 1:
      return [ns_fn(x) for x in stacks]
    run = lambda xs: _exchanged(ns_fn, split_fn, layout, cost, list(xs), specs, out_specs)
    if not layout.explicit:
      return run(stacks)
    # Explicit axes: exchange in Auto mode, hand the results back typed as wanted.
    wanted = out_specs if out_specs is not None else [P()] * len(stacks)
    stacks = [jax.sharding.reshard(x, NamedSharding(layout.mesh, spec))
              for x, spec in zip(stacks, specs)]
    return jax.sharding.auto_axes(run, out_sharding=[NamedSharding(layout.mesh, spec)
                                                     for spec in wanted])(stacks)

  return solve
