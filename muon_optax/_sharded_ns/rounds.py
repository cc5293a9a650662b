"""The static plan of distributed Newton–Schulz, computed from the shapes at trace time:
which device runs which matrix (or which part of it) in which round, weighed by what a
split costs (`split_cost`). No jax here: `solver` runs the plan on a mesh."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

from muon_optax._newton_schulz.settings import DEFAULT_NS, NewtonSchulz
from muon_optax._newton_schulz.variant import newton_schulz_plan
from muon_optax._sharded_ns.split_cost import (
  COLLECTIVE_BYTES,
  FLOPS_PER_BYTE,
  matmul_passes,
  memory_budget,
  split_bytes,
  split_collectives,
  split_flops,
  working_set,
)

Item = tuple[int, int]  # (stack index, matrix index in that stack)
SplitOk = Callable[[Item, int], bool]


class Round(NamedTuple):
  """One matrix of shape (rows, cols) per device; with split = g > 1, g consecutive
  devices share a matrix, device d holding columns part d % g."""

  rows: int
  cols: int
  slots: tuple[Optional[Item], ...]  # one per device; None: no matrix of this round
  split: int = 1


def power_of_two_groups(devices: int) -> tuple[int, ...]:
  """Group sizes 2, 4, … that divide `devices`."""
  return tuple(2**k for k in range(1, devices.bit_length()) if devices % 2**k == 0)


def padded_cols(cols: int, shards: int, split: int) -> int:
  """Columns of a matrix cut into `split` column parts when it lies in `shards` column
  shards. Where the split divides the shard width, each shard is cut into `split`
  slices; else, where it divides the number of shards, each part takes whole shards
  (`takes_whole_shards`); else the slices are zero-padded to a multiple of `split` (zero columns
  are exact for Newton–Schulz: X Xᵀ is unchanged, and their result is zero)."""
  if (cols // shards) % split == 0 or shards % split == 0:
    return cols
  return shards * math.ceil(cols // shards / split) * split


def _splits(items: list[Item], devices: int, split_ok: SplitOk, groups: tuple[int, ...],
            least: int = 1) -> list[int]:
  """The splits, at least `least`, that every item of a shape group allows."""
  fits = [g for g in groups if g <= devices and all(split_ok(item, g) for item in items)]
  return [g for g in [1, *fits] if g >= least]


def _round_cost(rows: int, cols: int, g: int, ns: NewtonSchulz, shards: int,
                flops_per_byte: float) -> float:
  """What one device's part of a round of rows×cols matrices split over g costs: its
  flops plus its split traffic at `flops_per_byte`."""
  return (split_flops(rows, padded_cols(cols, shards, g), g, ns)
          + flops_per_byte * split_bytes(rows, g, ns))


def _ladder(count: int, rows: int, cols: int, devices: int, ns: NewtonSchulz,
            splits: list[int], shards: int, flops_per_byte: float) -> tuple[int, ...]:
  """The splits, one per round, of the rounds that run `count` matrices of one shape at
  the least flops and traffic (`_round_cost` summed over the rounds): a round at split g
  runs devices // g of them. Rounds of different splits fill the devices where one
  split cannot: 96 matrices on 256 devices run as 64 over groups of 4, then 32 over
  groups of 8, not as 96 over pairs with 64 devices idle. Whether the fixed cost of
  their collectives is worth paying is `plan_rounds`'s call. Smaller splits win ties."""
  cost = {g: _round_cost(rows, cols, g, ns, shards, flops_per_byte) for g in splits}
  best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]  # (cost, splits) by count
  for c in range(1, count + 1):
    options = []
    for g in splits:  # a round at split g, then the best for what it leaves
      rest_cost, rest = best[max(0, c - devices // g)]
      options.append((rest_cost + cost[g], tuple(sorted((g, *rest)))))
    best.append(min(options))
  return best[count][1]


def _ladder_cost(ladder: tuple[int, ...], rows: int, cols: int, ns: NewtonSchulz, shards: int,
                 flops_per_byte: float) -> float:
  """What one device's part of a ladder's rounds costs: their flops and traffic
  (`_round_cost`), and the fixed cost of each kind of split's collectives."""
  return (sum(_round_cost(rows, cols, g, ns, shards, flops_per_byte) for g in ladder)
          + flops_per_byte * COLLECTIVE_BYTES
          * sum(split_collectives(rows, cols, g, ns) for g in set(ladder)))


def _least_split(items: list[Item], rows: int, cols: int, devices: int, split_ok: SplitOk,
                 groups: tuple[int, ...], budget: Optional[float]) -> int:
  """The smallest split whose `working_set` fits `budget` elements (None: 1); the
  largest allowed split if none does."""
  if budget is None:
    return 1
  splits = _splits(items, devices, split_ok, groups)
  return next((g for g in splits if working_set(rows, cols, g) <= budget), splits[-1])


# A plan within this factor of the ideal per-device flops splits no further matrix: each
# split adds collectives inside the iterations (the Gram sums and the row-shard gathers).
SPLIT_TOLERANCE = 1.05


def plan_rounds(shapes: list[tuple[int, int, int]], devices: int, ns: NewtonSchulz = DEFAULT_NS,
                split_ok: Optional[SplitOk] = None, groups: Optional[tuple[int, ...]] = None,
                col_shards: Optional[list[int]] = None,
                flops_per_byte: float = FLOPS_PER_BYTE,
                budget: Optional[float] = None, base: float = 0.0) -> list[Round]:
  """Deals the matrices of stacks with shapes (count, rows, cols) over `devices`.

  Each shape group runs in rounds of its own shape (no padding to another shape): whole
  matrices, one per device, as long as they fill rounds. The rest of a group fills a
  partial round, or is split by columns (and rows, see `rows_split`) over groups of
  devices, in rounds whose splits fill the devices at the least cost (`_ladder`).
  Rests are split largest saving first (the flops a split saves less what its traffic
  and its collectives' fixed cost, `COLLECTIVE_BYTES` each, cost at `flops_per_byte`, in
  16-bit matmul flops: see `matmul_passes`), while that saving is positive and until
  the plan is within `SPLIT_TOLERANCE` of the ideal (total flops / devices). Splits need
  `split_ok(item, g)`; `groups` are the group sizes the mesh can reduce over (default:
  powers of two); `col_shards[i]` is the number of column shards stack i lies in
  (default 1), which pads its column parts (`padded_cols`). With a `budget` (float32
  elements), every matrix of a shape whose `working_set` whole exceeds it is split,
  over the fewest devices that fit it (at least), whatever its flops. `base`: the flops
  every device runs besides these matrices (stacks orthogonalized where they lie), which
  the plan's time and its ideal both include: splits pay only against the whole.
  """
  flops_per_byte /= matmul_passes(ns)
  split_ok = split_ok or (lambda item, g: True)
  groups = power_of_two_groups(devices) if groups is None else groups
  col_shards = col_shards or [1] * len(shapes)
  by_shape = _by_shape(shapes)
  # Largest shapes first: their rounds come first in the exchange buffers.
  order = sorted(by_shape, key=lambda shape: -whole_flops(*shape, ns))
  least = {shape: _least_split(items, *shape, devices, split_ok, groups, budget)
           for shape, items in by_shape.items()}
  # A shape that must be split is all rest: none of its matrices runs whole.
  rests = {shape: by_shape[shape][0 if least[shape] > 1 else
                                  len(by_shape[shape]) // devices * devices:] for shape in order}
  shards = {shape: max(col_shards[i] for i, _ in items) for shape, items in by_shape.items()}
  ladder = {shape: _ladder(len(rest), *shape, devices, ns,
                          _splits(rest, devices, split_ok, groups, least[shape]), shards[shape],
                          flops_per_byte)
            for shape, rest in rests.items() if rest}
  flops = lambda shape, splits: sum(split_flops(shape[0], padded_cols(shape[1], shards[shape], g),
                                                g, ns) for g in splits)
  # What a shape's ladder saves in flops against one round of whole matrices, less what
  # its traffic and its collectives' fixed cost cost.
  saving = {shape: whole_flops(*shape, ns) - _ladder_cost(ladder[shape], *shape, ns, shards[shape],
                                                     flops_per_byte) for shape in ladder}
  forced = {shape for shape in ladder if least[shape] > 1}
  splits = {shape: ladder[shape] if shape in forced else (1,) for shape in ladder}
  ideal = base + sum(len(items) * whole_flops(*shape, ns)
                     for shape, items in by_shape.items()) / devices
  total = base + sum(len(by_shape[shape]) // devices * whole_flops(*shape, ns) for shape in order
              if shape not in forced)
  total += sum(flops(shape, splits[shape]) for shape in ladder)
  for shape in sorted(set(ladder) - forced, key=saving.get, reverse=True):
    if total <= SPLIT_TOLERANCE * ideal or saving[shape] <= 0:
      break
    total += flops(shape, ladder[shape]) - flops(shape, (1,))
    splits[shape] = ladder[shape]
  rounds = [r for shape in order
            for r in _shape_rounds(shape, by_shape[shape], rests[shape], splits.get(shape, ()),
                                   devices)]
  return placed(rounds, devices)


def _by_shape(shapes: list[tuple[int, int, int]]) -> dict[tuple[int, int], list[Item]]:
  """The items of stacks of shapes (count, rows, cols), grouped by matrix shape."""
  by_shape: dict[tuple[int, int], list[Item]] = {}
  for i, (count, rows, cols) in enumerate(shapes):
    by_shape.setdefault((rows, cols), []).extend((i, j) for j in range(count))
  return by_shape


def _shape_rounds(shape: tuple[int, int], items: list[Item], rest: list[Item],
                  splits: tuple[int, ...], devices: int) -> list[Round]:
  """The rounds of one shape: its items but the `rest` whole, one per device, then the
  rest in rounds of these `splits`."""
  full = len(items) - len(rest)
  rounds = [Round(*shape, tuple(items[s:s + devices])) for s in range(0, full, devices)]
  left = iter(rest)
  for g in splits:
    slots = tuple(item for _, item in zip(range(devices // g), left) for _ in range(g))
    rounds.append(Round(*shape, slots + (None,) * (devices - len(slots)), g))
  return rounds


def placed(rounds: list[Round], devices: int) -> list[Round]:
  """`rounds` with each partial round (its matrices on its first devices) moved onto
  devices the partial rounds before it leave free, where it fits: rounds that occupy
  disjoint devices share one slot of the exchange buffers (`exchange_schedule`), so that a
  device receives no zeros for a slot another round can fill. First fit, fullest
  first; a round of split g moves by a multiple of g, its groups staying whole."""
  used = lambda r: sum(item is not None for item in r.slots)
  free, out = [], list(rounds)  # free: the first free device of each slot
  for t in sorted(range(len(rounds)), key=lambda t: -used(rounds[t])):
    r, k = rounds[t], used(rounds[t])
    if k == devices:
      continue
    starts = [-(-f // r.split) * r.split for f in free]
    slot = next((b for b, start in enumerate(starts) if start + k <= devices), None)
    if slot is None:
      free.append(k)
      continue
    free[slot] = starts[slot] + k
    out[t] = r._replace(slots=(None,) * starts[slot] + r.slots[:k]
                        + (None,) * (devices - starts[slot] - k))
  return out


def whole_flops(rows: int, cols: int, ns: NewtonSchulz) -> int:
  """A whole matrix's flops as `split_flops` counts them: with whole products."""
  return newton_schulz_plan((rows, cols), ns, symmetric=False).flops


def per_device_flops(shapes: list[tuple[int, int, int]], devices: int,
                     ns: NewtonSchulz = DEFAULT_NS, groups: Optional[tuple[int, ...]] = None,
                     split_ok: Optional[SplitOk] = None,
                     col_shards: Optional[list[int]] = None,
                     flops_per_byte: float = FLOPS_PER_BYTE,
                     budget: Optional[float] = None) -> int:
  """Newton–Schulz flops each device runs under `plan_rounds`."""
  col_shards = col_shards or [1] * len(shapes)
  return sum(_round_flops(r, col_shards, ns)
             for r in plan_rounds(shapes, devices, ns, split_ok, groups, col_shards,
                                  flops_per_byte, budget))


def _round_flops(r: Round, col_shards: list[int], ns: NewtonSchulz) -> int:
  """The Newton–Schulz flops a device runs in round r."""
  if r.split == 1:
    return whole_flops(r.rows, r.cols, ns)
  shards = max(col_shards[item[0]] for item in r.slots if item is not None)
  return split_flops(r.rows, padded_cols(r.cols, shards, r.split), r.split, ns)


class MeshPlan(NamedTuple):
  """How the Newton–Schulz work of some matrix stacks is dealt over a mesh's devices."""

  rounds: tuple[tuple[int, int, int], ...]  # (rows, cols, split) of each round, in order
  flops_per_device: int  # the Newton–Schulz flops each device runs
  ideal_flops_per_device: float  # every matrix's flops over the devices


def device_plan(shapes: list[tuple[int, int, int]], devices: int, ns: NewtonSchulz,
                col_shards: list[int], flops_per_byte: float, memory: Optional[float]
                ) -> MeshPlan:
  """`plan_rounds` of stacks of wide matrices (count, rows, cols), lying in `col_shards`
  column shards, on a 1-D mesh of `devices` devices under the memory cap `memory`
  (`MeshLayout.memory`)."""
  groups = group_sizes(prime_factors(devices))
  budget = memory_budget(shapes, devices, memory)
  rounds = plan_rounds(shapes, devices, ns, None, groups, col_shards, flops_per_byte, budget)
  flops = sum(_round_flops(r, col_shards, ns) for r in rounds)
  ideal = sum(count * whole_flops(rows, cols, ns) for count, rows, cols in shapes) / devices
  return MeshPlan(tuple((r.rows, r.cols, r.split) for r in rounds), flops, ideal)


def prime_factors(n: int) -> list[int]:
  """n's prime factors, largest first (so that a mesh axis cut into them ends in 2s)."""
  primes, rest, p = [], n, 2
  while rest > 1:
    while rest % p == 0:
      primes.append(p)
      rest //= p
    p += 1
  return sorted(primes, reverse=True)


def group_sizes(factors: list[int]) -> tuple[int, ...]:
  """The sizes (> 1) of the groups of consecutive devices on a mesh of these factor
  axes: the products of its trailing factors."""
  return tuple(sorted({math.prod(factors[k:]) for k in range(len(factors))} - {1}))
