"""How the rounds travel, computed at trace time (no jax): in which exchange
(`split_into_exchanges`), which rounds share a slot of its buffers (`shared_slots`), which run their
local work together and how they form their m×m products (`units`), how a buffer is
filled (`spans_of`, `segments`: a slice per run of devices, not one per device), and the
static plan of one exchange from the stacks' layouts: how wide each round's pieces are
and where each slot starts. `solver` packs and unpacks by it."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Collection
from typing import NamedTuple, Optional

import numpy as np

from muon_optax._newton_schulz.settings import DEFAULT_NS, NewtonSchulz
from muon_optax._placement.mesh_layout import EXCHANGES
from muon_optax._sharded_ns.rounds import Round
from muon_optax._sharded_ns.split_cost import (
  WHOLE_PRODUCTS_SHARE,
  most_product_chunks,
  split_collectives,
  working_set,
)
from muon_optax._sharded_ns.stack_shards import StackShards, takes_whole_shards


def shared_slots(rounds: list[Round], apart: Collection[int] = ()) -> list[list[int]]:
  """The rounds (by index) grouped into the slots of an exchange's buffers, first fit:
  a round joins the first slot whose rounds occupy none of its devices (`rounds.placed`);
  those in `apart` stay alone."""
  slots, taken = [], []
  for t, r in enumerate(rounds):
    mine = {d for d, item in enumerate(r.slots) if item is not None}
    k = next((k for k, devices in enumerate(taken)
              if t not in apart and slots[k][0] not in apart and not devices & mine), None)
    if k is None:
      slots.append([t])
      taken.append(mine)
    else:
      slots[k].append(t)
      taken[k] |= mine
  return slots


def split_into_exchanges(rounds: list[Round], count: int) -> list[list[Round]]:
  """`rounds` in at most `count` runs of consecutive slots (`shared_slots`: the rounds
  of one slot travel together) with about equal bytes."""
  slots = shared_slots(rounds)
  weight = [max(rounds[t].rows * rounds[t].cols / rounds[t].split for t in ts) for ts in slots]
  total, exchanges, acc = sum(weight), [[]], 0.0
  for ts, w in zip(slots, weight):
    if exchanges[-1] and acc + w / 2 > total * len(exchanges) / count and len(exchanges) < count:
      exchanges.append([])
    exchanges[-1] += [rounds[t] for t in ts]
    acc += w
  return exchanges


class Unit(NamedTuple):
  """Rounds (by index) whose local work runs together, their m×m products formed in
  `product_chunks` chunks (`FactorMesh.row_blocks`; 1: whole)."""

  rounds: list[int]
  product_chunks: int = 1


def unit_size(rows: int, cols: int, split: int, count: int, budget: Optional[float],
              ns: NewtonSchulz) -> tuple[int, int]:
  """(rounds a unit holds, chunks its products are formed in) for `count` split rounds
  of one kind: the fewest collectives a step launches for all of them
  (`split_collectives` per unit), each unit's `working_set` within `budget` (float32
  elements; None: no cap), and within `WHOLE_PRODUCTS_SHARE` of it with its products
  whole (where they can be formed in chunks at all, `most_product_chunks`); ties to the
  chunks. Where nothing fits: one round a unit, in the most chunks."""
  most, options = most_product_chunks(rows), []
  whole = None if budget is None else WHOLE_PRODUCTS_SHARE * budget
  for chunks, cap in [(most, budget)] + [(1, whole)] * (most > 1):
    size = count if cap is None else min(count, int(cap // working_set(rows, cols, split,
                                                                       chunks)))
    if size:
      launches = -(-count // size) * split_collectives(rows, cols, split, ns, chunks)
      options.append((launches, -chunks, size))
  if not options:
    return 1, most
  _, chunks, size = min(options)
  return size, -chunks


def units(rounds: list[Round], budget: Optional[float], ns: NewtonSchulz = DEFAULT_NS
          ) -> list[Unit]:
  """The rounds in the order their local work runs: a round of whole matrices alone (it
  has no collective inside, and one matrix's Newton–Schulz temporaries are live at a
  time); the split rounds of one (shape, split) together, as many as fit `budget`
  (float32 elements; None: all), so that each of their collectives (the Gram sums, the
  row-block gathers) serves all of them, with their products whole where that fits and
  launches fewer collectives (`unit_size`)."""
  count = Counter((r.rows, r.cols, r.split) for r in rounds if r.split > 1)
  sizes = {kind: unit_size(*kind, n, budget, ns) for kind, n in count.items()}
  units, open_units = [], {}  # open_units: the last unit of each kind of split round
  for t, r in enumerate(rounds):
    kind = (r.rows, r.cols, r.split)
    unit = open_units.get(kind)
    if unit is not None and len(unit.rounds) < sizes[kind][0]:
      unit.rounds.append(t)
      continue
    units.append(Unit([t], sizes[kind][1] if r.split > 1 else 1))
    if r.split > 1:
      open_units[kind] = units[-1]
  return units


def slice_width(shards: StackShards, split: int) -> int:
  """The width of column part p of a shard: its slice p of ⌈shard width / split⌉,
  zero-padded (`plan.padded_cols`)."""
  return math.ceil(shards.shard[1] / split)


def piece(shards: StackShards, split: int) -> int:
  """What one device sends of a matrix's column part: its slice of its shard, split
  between the shard's replicas."""
  return math.ceil(shards.shard[0] * slice_width(shards, split) / shards.replicas)


def out_slice(shards_in: StackShards, shards_out: StackShards, split: int) -> int:
  """The width of a result's slice in a shard of the wanted layout: a split result's
  parts have the input's grid (the exchange splits only such stacks), hence its
  slices."""
  return slice_width(shards_in, split) if split > 1 else shards_out.shard[1]


class Span(NamedTuple):
  """A run of consecutive devices in one slot of a buffer: with `round` None, devices
  with no matrix there; else devices holding the parts (`split` each) of matrices
  `first`, `first` + 1, … of stack `stack`, in order."""

  devices: int
  round: Optional[int] = None
  stack: int = 0
  first: int = 0


def spans_of(cells: list) -> list[Span]:
  """Devices in order, each None (no matrix) or (round, split, (stack, index)), as the
  fewest `Span`s: a split round's g devices share one matrix, its group starting at a
  multiple of g."""
  out, d = [], 0
  while d < len(cells):
    last = out[-1] if out else None
    if cells[d] is None:
      if last is not None and last.round is None:
        out[-1] = last._replace(devices=last.devices + 1)
      else:
        out.append(Span(1))
      d += 1
      continue
    t, g, (i, j) = cells[d]
    assert d % g == 0, "a split round's groups start at multiples of its split"
    if (last is not None and (last.round, last.stack) == (t, i)
        and last.first + last.devices // g == j):
      out[-1] = last._replace(devices=last.devices + g)
    else:
      out.append(Span(g, t, i, j))
    d += g
  return out


def segments(rows: list[list[Span]]) -> list[tuple[int, int, list[tuple[Span, int]]]]:
  """The devices cut wherever a span of one of `rows` (the spans of some slots) starts:
  (first device, device count, and for each slot the span they lie in and their offset
  into it). A buffer is filled segment by segment, each a block of whole rows, as a
  compiler fuses it into the collective that reads it; with one device per segment
  that is one row per device."""
  starts = [np.cumsum([0] + [s.devices for s in row]).tolist() for row in rows]
  cuts = sorted({c for row in starts for c in row})
  out = []
  for a, b in zip(cuts, cuts[1:]):
    where = []
    for row, first in zip(rows, starts):
      k = bisect.bisect_right(first, a) - 1
      where.append((row[k], a - first[k]))
    out.append((a, b - a, where))
  return out


class ExchangePlan(NamedTuple):
  """One exchange's rounds, and what the packing reads from them. Rounds on disjoint
  devices (`rounds.placed`) share a slot of the buffers: a device's slot holds the pieces
  of the one round it has a matrix in."""

  rounds: list[Round]
  whole_shards: set[int]  # rounds whose column parts are whole shards (`takes_whole_shards`)
  where: dict  # item -> (its round, its first device)
  width: list[int]  # each round's pieces in a device's buffer row (0: whole shards)
  round_width: list[int]  # each round's padded matrix width
  back_width: list[int]  # each round's pieces in a row of the way back (0: whole shards)
  slots: list[list[int]]  # the rounds that share each slot, whole-shard ones alone
  slot: list[int]  # each round's slot
  slot_width: list[int]  # each slot's width in a buffer row: its widest round's
  back_slot_width: list[int]  # ... and in a row of the way back
  start: list[int]  # where each round's slot starts in a buffer row
  back_start: list[int]  # ... and in a row of the way back

  @classmethod
  def of(cls, rounds: list[Round], ins: list[StackShards], outs: list[StackShards], gather: bool,
         devices: int) -> ExchangePlan:
    """The plan of an exchange of `rounds` of stacks lying in `ins`, their results
    wanted in `outs` (or on every device: `gather`)."""
    members = lambda r: [item[0] for item in r.slots if item is not None]
    round_width = [max(ins[i].grid[1] * slice_width(ins[i], r.split) for i in members(r))
                   for r in rounds]
    # Whole shards where a shard cannot be sliced into the split's parts unpadded; and
    # where every round can go so, as then no all-to-all over all the devices is needed.
    can = {t for t, r in enumerate(rounds)
           if all(takes_whole_shards(ins[i], r.split, devices) and (gather or outs[i] == ins[i])
                  for i in members(r))}
    narrow = {t for t in can if any(ins[i].shard[1] % rounds[t].split for i in members(rounds[t]))}
    whole_shards = can if len(can) == len(rounds) else narrow
    where = {}
    for t, r in enumerate(rounds):
      for d, item in enumerate(r.slots):
        where.setdefault(item, (t, d))
    width = [0 if t in whole_shards else max(piece(ins[i], r.split) for i in members(r))
             for t, r in enumerate(rounds)]
    back_width = [0 if t in whole_shards else
                  max(outs[i].shard[0] * out_slice(ins[i], outs[i], r.split) for i in members(r))
                  for t, r in enumerate(rounds)]
    slots = shared_slots(rounds, apart=whole_shards)
    slot = [next(k for k, ts in enumerate(slots) if t in ts) for t in range(len(rounds))]
    slot_width = [max(width[t] for t in ts) for ts in slots]
    back_slot_width = [max(back_width[t] for t in ts) for ts in slots]
    start, back_start = (np.cumsum([0] + w).tolist() for w in (slot_width, back_slot_width))
    return cls(rounds, whole_shards, where, width, round_width, back_width, slots, slot,
               slot_width, back_slot_width, [start[k] for k in slot],
               [back_start[k] for k in slot])

  def owner(self, slot: int, device: int) -> Optional[int]:
    """The round of `slot` that device has a matrix in, if any."""
    return next((t for t in self.slots[slot] if self.rounds[t].slots[device] is not None), None)

  def spans(self, slot: int) -> list[Span]:
    """Slot `slot`'s devices, in order, as the fewest `Span`s (`spans_of`)."""
    owners = [self.owner(slot, d) for d in range(len(self.rounds[0].slots))]
    return spans_of([None if t is None else (t, self.rounds[t].split, self.rounds[t].slots[d])
                     for d, t in enumerate(owners)])

  def segments(self, slots: list[int]) -> list[tuple[int, int, list[tuple[Span, int]]]]:
    """`segments` of these slots' spans."""
    return segments([self.spans(k) for k in slots])

  def table(self, slot: int) -> list[int]:
    """For each device, the index in `slots[slot]` of the round it has a matrix in (0
    if none)."""
    members = self.slots[slot]
    return [members.index(t) if t is not None else 0
            for t in (self.owner(slot, d) for d in range(len(self.rounds[0].slots)))]


def buffer_elements(plan: ExchangePlan, gather: bool) -> float:
  """About the elements a device holds in one exchange's buffers: what it receives, a
  row from every device, and what it sends back (all of every result when `gather`);
  a whole-shard round's part both ways."""
  devices = len(plan.rounds[0].slots)
  into = devices * sum(plan.slot_width)
  if gather:
    back = devices * sum(max(plan.rounds[t].rows * plan.round_width[t] for t in members)
                         for members in plan.slots)
  else:
    back = devices * sum(plan.back_slot_width)
  parts = sum(2 * plan.rounds[t].rows * plan.rounds[t].cols / plan.rounds[t].split
              for t in plan.whole_shards)
  return into + back + parts


def unit_work(rounds: list[Round], unit: Unit) -> float:
  """The float32 elements a unit of local work holds live (`working_set`)."""
  r = rounds[unit.rounds[0]]
  return len(unit.rounds) * working_set(r.rows, r.cols, r.split, unit.product_chunks)


def exchanges_by_need(rounds: list[Round], ins: list[StackShards], outs: list[StackShards],
                      gather: bool, budget: Optional[float], ns: NewtonSchulz = DEFAULT_NS
                      ) -> int:
  """How many exchanges memory needs (`MeshLayout.exchanges` None): the fewest, up to
  `EXCHANGES`, whose largest exchange's buffers (`buffer_elements`) fit `budget` (float32
  elements; None: no cap) beside the largest unit of local work (`units`); where none
  does, as many as `split_into_exchanges` cuts for `EXCHANGES` (rounds that share
  devices travel together), the count that bounds the pod-scale figures
  (benchmarks/results/scale.jsonl). Each exchange costs two collectives."""
  if budget is None or not rounds:
    return 1
  devices = len(rounds[0].slots)
  work = max(unit_work(rounds, unit) for unit in units(rounds, budget, ns))
  for count in range(1, EXCHANGES):
    parts = split_into_exchanges(rounds, count)
    largest = max(buffer_elements(ExchangePlan.of(part, ins, outs, gather, devices), gather)
                  for part in parts)
    if largest + work <= budget:
      return len(parts)
  return len(split_into_exchanges(rounds, EXCHANGES))
