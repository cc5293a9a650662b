"""Whole-shard parts of split matrices: where a split divides a matrix's shards, each part
is whole shards, which travel among the devices of a residue class, one all-to-all per
split, with no slicing or padding (`stack_shards.takes_whole_shards`)."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from muon_optax._placement.peer_rows import to_peers
from muon_optax._sharded_ns.exchange_schedule import segments, spans_of
from muon_optax._sharded_ns.factor_mesh import FactorMesh


def _class_axes(fmesh: FactorMesh, g: int) -> tuple[str, ...]:
  """The mesh axes that run over a residue class mod g: all but a group's trailing ones."""
  names = fmesh.mesh.axis_names
  return names[:len(names) - len(fmesh.group_axes(g))]


def whole_shards_in(rounds, stacks, fmesh: FactorMesh, dtype):
  """The whole-shard rounds' exchange in, one all-to-all per split among the devices of a
  residue: {round index: a function giving this device's column part (rows, cols / g)},
  assembled when its unit runs, so that the parts of units yet to run are not live
  beside its Newton–Schulz temporaries. In such a round
  the g devices q·g + p own part p of the round's matrix q, and device s sends its shard
  of matrix q to device q·g + s mod g."""
  parts = {}
  for g in sorted({rounds[t].split for t in rounds}):
    members = [t for t in rounds if rounds[t].split == g]
    classes = fmesh.mesh.size // g
    lead = _class_axes(fmesh, g)
    first = lambda r: next(x for x in r.slots if x is not None)
    shard_of = {t: stacks[first(rounds[t])[0]].shape[1:] for t in members}  # one per round
    # Row q goes to the peer of residue class position q: its matrices, filled a
    # segment of classes at a time, one slice of a stack per run of its matrices.
    spans = [spans_of([None if rounds[t].slots[q * g] is None else (t, 1, rounds[t].slots[q * g])
                       for q in range(classes)]) for t in members]
    rows = []
    for _, count, where in segments(spans):
      segment = []
      for t, (span, offset) in zip(members, where):
        size = math.prod(shard_of[t])
        if span.round is None:
          segment.append(jnp.zeros((count, size), dtype))
        else:
          x = stacks[span.stack][span.first + offset:span.first + offset + count]
          segment.append(jnp.swapaxes(x.astype(dtype), 1, 2).reshape(count, size))  # (shard cols, shard rows)
      rows.append(jnp.concatenate(segment, axis=1))
    received = to_peers(rows, lead)  # row q: from q·g + p
    start = 0
    for t in members:
      parts[t] = functools.partial(_part, received, start, *shard_of[t])
      start += math.prod(shard_of[t])
  return parts


def _part(received, start: int, shard_rows: int, shard_cols: int):
  """A column part from the transposed shards at `start` of each row of `received` (one row
  a class): they stack up as the part's transpose, one reshape and a 2-D transpose,
  which a compiler folds into the products that read it."""
  size = shard_rows * shard_cols
  return received[:, 0, start:start + size].reshape(received.shape[0] * shard_cols, shard_rows).T


def whole_shard_rows(result, classes: int):
  """A whole-shard round's result (its column part) as its owner sends it back: row q
  holds the shard of the device at position q of its residue class, transposed (its
  transpose's row block: a reshape, where a shard's own rows would be a relayout, and
  a narrow shard's last axis is padded to a TPU's 128-lane tiles). Made as soon as the
  result is, so that the result itself need not be kept for the way back."""
  return result.T.reshape(classes, -1)


def whole_shards_out(rounds, sent, fmesh: FactorMesh, dtype):
  """The whole-shard rounds' way back: each owner sends every device of its residue class
  that device's shard of its part (`sent`: the rounds' `whole_shard_rows`): ({round index:
  this device's shard of matrix q, by q}, the collectives' outputs)."""
  back, outputs = {}, []
  for g in sorted({rounds[t].split for t in rounds}):
    members = [t for t in rounds if rounds[t].split == g]
    received = to_peers([jnp.concatenate([sent[t].astype(dtype) for t in members], axis=1)],
                        _class_axes(fmesh, g))
    outputs.append(received)
    start = 0
    for t in members:
      size, matrix_rows = sent[t].shape[1], rounds[t].rows
      shards = received[:, 0, start:start + size].reshape(received.shape[0], size // matrix_rows,
                                                          matrix_rows)
      back[t] = [shard.T for shard in shards]  # each transposed where it is read
      start += size
  return back, outputs
