"""The exchange out: if every update is wanted replicated (ZeRO-1 with replicated params),
one all-gather of the owners' packed results (`gathered`); otherwise one all-to-all sends
each device its shard of every result, in the layout the update is wanted in
(`to_send`, then `scattered`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from muon_optax._placement.peer_rows import from_every_peer, to_peers
from muon_optax._sharded_ns.column_parts import whole_shard_rows, whole_shards_out
from muon_optax._sharded_ns.exchange_schedule import ExchangePlan, out_slice, slice_width
from muon_optax._sharded_ns.exchange_stacks import ExchangeStacks
from muon_optax._sharded_ns.rounds import Round
from muon_optax._sharded_ns.static_rows import take_rows


def _slot_of(stacks: ExchangeStacks, plan: ExchangePlan, k: int, xs: list, width: int):
  """Slot k of a buffer: on each device, what `xs` (one per round of the slot) holds
  for the round it has a matrix in, its last axis zero-padded to `width`. Selected,
  not switched: a select fuses into the buffer it fills, where a branch's result
  would be a buffer of its own."""
  pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
  table = plan.table(k)
  if len(set(table)) == 1:
    return pad(xs[table[0]])
  index = jnp.asarray(table, jnp.int32)[stacks.device_index()]
  out = pad(xs[0])
  for m in range(1, len(xs)):
    out = jnp.where(index == m, pad(xs[m]), out)
  return out


def gathered(stacks: ExchangeStacks, results, plan: ExchangePlan) -> tuple[dict, list]:
  """Every device gets every result: one all-gather of the owners' packed results.
  Returns the results, by item, and the collective's output."""
  sizes = [max(results[t].size for t in members) for members in plan.slots]
  sent = from_every_peer(
      jnp.concatenate([_slot_of(stacks, plan, k, [results[t].reshape(-1) for t in members], size)
                       for k, (members, size) in enumerate(zip(plan.slots, sizes))]),
      stacks.axes)
  offsets = np.cumsum([0] + sizes)

  def result(i, j):
    (t, first_device), r = plan.where[(i, j)], plan.rounds[plan.where[(i, j)][0]]
    layout, (rows, cols) = stacks.ins[i], stacks.shapes[i][1:]
    start = offsets[plan.slot[t]]
    parts = sent[first_device:first_device + r.split, 0, start:start + results[t].size]
    parts = parts.reshape(r.split, *results[t].shape)
    if t in plan.whole_shards:  # part p: shards q·g + p, q = 0, 1, …
      x = parts.reshape(r.split, rows, stacks.devices // r.split, layout.shard[1])
      return x.transpose(1, 2, 0, 3).reshape(rows, cols)
    shard_cols, slice_cols = layout.grid[1], slice_width(layout, r.split)
    x = parts[:, :, :shard_cols * slice_cols].reshape(r.split, rows, shard_cols, slice_cols)
    x = x.transpose(1, 2, 0, 3).reshape(rows, shard_cols, r.split * slice_cols)
    return x[:, :, :layout.shard[1]].reshape(rows, cols)
  return {item: result(*item) for item in plan.where if item is not None}, [sent]


def _shards_of(stacks: ExchangeStacks, i: int, r: Round, width: int):
  """Every device's shard of result i, in the wanted layout, one row per device."""
  layout, rows = stacks.outs[i], stacks.shapes[i][1]
  shard_rows, slice_cols = layout.shard[0], out_slice(stacks.ins[i], layout, r.split)
  pick = [layout.where[s][0] * layout.grid[1] + layout.where[s][1] for s in range(stacks.devices)]

  def cut(x):
    b = x[:rows, :layout.grid[1] * slice_cols].T.reshape(layout.grid[1], slice_cols,
                                                         layout.grid[0], shard_rows)
    b = take_rows(b.transpose(2, 0, 1, 3).reshape(-1, shard_rows * slice_cols), pick)
    return jnp.pad(b, ((0, 0), (0, width - shard_rows * slice_cols)))
  return cut


def to_send(stacks: ExchangeStacks, t: int, x, plan: ExchangePlan):
  """What goes back of round t's result x: every device's shard of it, one row per
  device (all of it when gathered; a whole-shard round's, by its residue class:
  `whole_shard_rows`)."""
  if stacks.gather:
    return x
  if t in plan.whole_shards:
    return whole_shard_rows(x, stacks.devices // plan.rounds[t].split)
  r = plan.rounds[t]
  keys, table = stacks.variants(r)
  return stacks.switch(table, [_shards_of(stacks, i, r, plan.back_width[t]) for i in keys], x)


def scattered(stacks: ExchangeStacks, sent, plan: ExchangePlan) -> tuple[dict, list]:
  """Every device gets its shard of every result, in the wanted layout: one all-to-all
  of what `to_send` made of them. Returns the results, by item, and the collectives'
  outputs."""
  parts = [_slot_of(stacks, plan, k, [sent[t] for t in members], plan.back_slot_width[k])
           for k, members in enumerate(plan.slots) if members[0] not in plan.whole_shards]
  back = to_peers([jnp.concatenate(parts, axis=1)], stacks.axes) if parts else None
  by_shards, received = whole_shards_out({t: plan.rounds[t] for t in plan.whole_shards}, sent,
                                  stacks.fmesh, stacks.result_dtype)

  def result(i, j):
    (t, first_device), r = plan.where[(i, j)], plan.rounds[plan.where[(i, j)][0]]
    if t in plan.whole_shards:  # matrix q of the round, from the owner of this device's shard
      return by_shards[t][first_device // r.split]
    layout = stacks.outs[i]
    shard_rows, slice_cols = layout.shard[0], out_slice(stacks.ins[i], layout, r.split)
    start = plan.back_start[t]
    x = back[first_device:first_device + r.split, 0, start:start + shard_rows * slice_cols]
    x = x.reshape(r.split, slice_cols, shard_rows).transpose(2, 0, 1)
    return x.reshape(shard_rows, r.split * slice_cols)[:, :layout.shard[1]]
  results = {item: result(*item) for item in plan.where if item is not None}
  return results, [x for x in [back, *received] if x is not None]
