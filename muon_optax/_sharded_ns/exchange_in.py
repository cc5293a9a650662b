"""The exchange in: each device cuts its shard of every matrix into one piece per owner (a
shard replicated over some mesh axes is split between its replicas), packs all pieces,
transposed, into one flat buffer row per owner, and a single all-to-all delivers them;
the owner reassembles its matrices from the pieces (a matrix split by columns: its
transpose's row blocks, one reshape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from muon_optax._placement.peer_rows import to_peers
from muon_optax._placement.shardings import spec_axes
from muon_optax._sharded_ns.column_parts import whole_shards_in
from muon_optax._sharded_ns.exchange_schedule import ExchangePlan, piece, slice_width
from muon_optax._sharded_ns.exchange_stacks import ExchangeStacks
from muon_optax._sharded_ns.factor_mesh import linear_index
from muon_optax._sharded_ns.rounds import Round
from muon_optax._sharded_ns.static_rows import take_rows


class Received(NamedTuple):
  """What a device received: `rows` (row s from device s; None where every round goes
  by whole shards) and, for each whole-shard round, a function giving its column part."""

  rows: Optional[jax.Array]
  by_shards: dict[int, Callable[[], jax.Array]]


def _shares(stacks: ExchangeStacks, arrays, plan: ExchangePlan) -> dict:
  """Each device's share of every matrix: its shard (column part p of g), transposed
  and split between the shard's replicas: shares[(i, g)] has shape (count, g, piece).
  Transposed, the pieces of a column-sharded matrix stack up as its transpose's row
  shards, so that its owner assembles it with a reshape, not a relayout of the whole
  matrix (a TPU's tiled layouts make that a copy, or three)."""
  shares = {}
  sliced = [t for t in range(len(plan.rounds)) if t not in plan.whole_shards]
  for i, g in {(item[0], plan.rounds[t].split) for t in sliced for item in plan.rounds[t].slots
               if item is not None}:
    layout, x = stacks.ins[i], arrays[i].astype(stacks.dtype)
    share, shard_rows, width = piece(layout, g), layout.shard[0], slice_width(layout, g)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, g * width - layout.shard[1])))
    x = x.reshape(-1, shard_rows, g, width).transpose(0, 2, 3, 1).reshape(x.shape[0], g, -1)
    if layout.replicas > 1:
      x = jnp.pad(x, ((0, 0), (0, 0), (0, share * layout.replicas - x.shape[2])))
      rest = tuple(a for a in stacks.axes
                   if a not in spec_axes(layout.spec[1]) + spec_axes(layout.spec[2]))
      x = jax.lax.dynamic_slice_in_dim(x, linear_index(rest, stacks.sizes) * share, share,
                                       axis=2)
    shares[(i, g)] = x
  return shares


def send(stacks: ExchangeStacks, arrays, plan: ExchangePlan) -> Received:
  """The exchange in of `arrays` (the stacks' local shards) by `plan`."""
  shares = _shares(stacks, arrays, plan)
  sliced = [k for k, members in enumerate(plan.slots) if members[0] not in plan.whole_shards]
  rows = []  # the buffer's rows, a segment of devices at a time (`segments`)
  for _, count, where in plan.segments(sliced):
    segment = []
    for k, (span, offset) in zip(sliced, where):
      width = plan.slot_width[k]
      if span.round is None:
        segment.append(jnp.zeros((count, width), stacks.dtype))
        continue
      g = plan.rounds[span.round].split
      # The matrices the devices of the segment hold parts of.
      first, stop = offset // g, -(-(offset + count) // g)
      x = shares[(span.stack, g)][span.first + first:span.first + stop]
      x = x.reshape((stop - first) * g, -1)[offset - first * g:offset - first * g + count]
      segment.append(jnp.pad(x, ((0, 0), (0, width - x.shape[1]))))
    rows.append(jnp.concatenate(segment, axis=1))
  received = to_peers(rows, stacks.axes) if rows else None
  by_shards = whole_shards_in({t: plan.rounds[t] for t in plan.whole_shards}, arrays, stacks.fmesh,
                       stacks.dtype)
  return Received(received, by_shards)


def _assembler(stacks: ExchangeStacks, i: int, r: Round, width: int):
  """Matrix i of round r (column part, zero-padded to `width`) from its received pieces."""
  layout, rows = stacks.ins[i], stacks.shapes[i][1]
  share, shard_rows = piece(layout, r.split), layout.shard[0]
  slice_cols = slice_width(layout, r.split)
  order = sorted(range(stacks.devices), key=lambda s: layout.where[s])

  def assemble(received):
    x = take_rows(received, order)[:, :share].reshape(*layout.grid, layout.replicas * share)
    x = x[..., :shard_rows * slice_cols]
    xt = x.reshape(*layout.grid, slice_cols, shard_rows).transpose(1, 2, 0, 3).reshape(-1, rows)
    return jnp.pad(xt, ((0, width - xt.shape[0]), (0, 0))).T  # zero columns: exact
  return assemble


def matrix(stacks: ExchangeStacks, t: int, received: Received, plan: ExchangePlan):
  """This device's matrix (or column part) of round t. A device with none in it gets
  whatever its slot holds: its result is never read."""
  if t in plan.whole_shards:
    return received.by_shards[t]()
  r, start = plan.rounds[t], plan.start[t]
  keys, table = stacks.variants(r)
  return stacks.switch(table, [_assembler(stacks, i, r, plan.round_width[t]) for i in keys],
                       received.rows[:, 0, start:start + plan.width[t]])
