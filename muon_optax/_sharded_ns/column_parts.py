"""Block-wise parts of split matrices: where a split divides a matrix's blocks, each part
is whole blocks, which travel among the devices of a residue class, one all-to-all per
split, with no slicing or padding (`stack_shards.by_blocks`)."""

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


def blocks_in(rounds, stacks, fmesh: FactorMesh, dtype):
  """The block-mode rounds' exchange in, one all-to-all per split among the devices of a
  residue: {round index: a function giving this device's column part (rows, cols / g)},
  assembled when its unit runs, so that the parts of units yet to run are not live
  beside its Newton–Schulz temporaries. In such a round
  the g devices q·g + p own part p of the round's matrix q, and device s sends its block
  of matrix q to device q·g + s mod g."""
  parts = {}
  for g in sorted({rounds[t].split for t in rounds}):
    members = [t for t in rounds if rounds[t].split == g]
    classes = fmesh.mesh.size // g
    lead = _class_axes(fmesh, g)
    first = lambda r: next(x for x in r.slots if x is not None)
    block_of = {t: stacks[first(rounds[t])[0]].shape[1:] for t in members}  # one per round
    # Row q goes to the peer of residue class position q: its matrices, filled a
    # segment of classes at a time, one slice of a stack per run of its matrices.
    spans = [spans_of([None if rounds[t].slots[q * g] is None else (t, 1, rounds[t].slots[q * g])
                       for q in range(classes)]) for t in members]
    rows = []
    for _, count, where in segments(spans):
      block = []
      for t, (span, offset) in zip(members, where):
        size = math.prod(block_of[t])
        if span.round is None:
          block.append(jnp.zeros((count, size), dtype))
        else:
          x = stacks[span.stack][span.first + offset:span.first + offset + count]
          block.append(jnp.swapaxes(x.astype(dtype), 1, 2).reshape(count, size))  # (bw, bh)
      rows.append(jnp.concatenate(block, axis=1))
    recv = to_peers(rows, lead)  # row q: from q·g + p
    start = 0
    for t in members:
      parts[t] = functools.partial(_part, recv, start, *block_of[t])
      start += math.prod(block_of[t])
  return parts


def _part(recv, start: int, bh: int, bw: int):
  """A column part from the transposed blocks at `start` of each row of `recv` (one row
  a class): they stack up as the part's transpose, one reshape and a 2-D transpose,
  which a compiler folds into the products that read it."""
  return recv[:, 0, start:start + bh * bw].reshape(recv.shape[0] * bw, bh).T


def block_rows(result, classes: int):
  """A block-wise round's result (its column part) as its owner sends it back: row q
  holds the block of the device at position q of its residue class, transposed (its
  transpose's row block: a reshape, where a block's own rows would be a relayout, and
  a narrow block's last axis is padded to a TPU's 128-lane tiles). Made as soon as the
  result is, so that the result itself need not be kept for the way back."""
  return result.T.reshape(classes, -1)


def blocks_out(rounds, sent, fmesh: FactorMesh, dtype):
  """The block-mode rounds' way back: each owner sends every device of its residue class
  that device's block of its part (`sent`: the rounds' `block_rows`): ({round index:
  this device's block of matrix q, by q}, the collectives' outputs)."""
  back, received = {}, []
  for g in sorted({rounds[t].split for t in rounds}):
    members = [t for t in rounds if rounds[t].split == g]
    recv = to_peers([jnp.concatenate([sent[t].astype(dtype) for t in members], axis=1)],
                    _class_axes(fmesh, g))
    received.append(recv)
    start = 0
    for t in members:
      size, rows_ = sent[t].shape[1], rounds[t].rows
      blocks = recv[:, 0, start:start + size].reshape(recv.shape[0], size // rows_, rows_)
      back[t] = [block.T for block in blocks]  # each transposed where it is read
      start += size
  return back, received
