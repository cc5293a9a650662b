"""Block-wise parts of split matrices: where a split divides a matrix's blocks, each part
is whole blocks, which travel among the devices of a residue class, one all-to-all per
split, with no slicing or padding (`stack_layout.by_blocks`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from muon_optax._distributed.exchange_plan import segments, spans_of
from muon_optax._distributed.factor_mesh import FactorMesh


def blocks_in(rounds, stacks, fmesh: FactorMesh, dtype):
  """The block-mode rounds' exchange in, one all-to-all per split among the devices of a
  residue: {round index: this device's column part (rows, cols / g)}. In such a round
  the g devices q·g + p own part p of the round's matrix q, and device s sends its block
  of matrix q to device q·g + s mod g."""
  parts = {}
  for g in sorted({rounds[t].split for t in rounds}):
    members = [t for t in rounds if rounds[t].split == g]
    classes = fmesh.mesh.size // g
    lead = fmesh.mesh.axis_names[:len(fmesh.mesh.axis_names) - len(fmesh.group_axes(g))]
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
          block.append(x.astype(dtype).reshape(count, size))
      rows.append(jnp.concatenate(block, axis=1))
    recv = jax.lax.all_to_all(jnp.concatenate(rows), lead, 0, 0, tiled=True)  # row q: from q·g + p
    start = 0
    for t in members:
      bh, bw = block_of[t]
      x = recv[:, start:start + bh * bw].reshape(classes, bh, bw)
      parts[t] = x.transpose(1, 0, 2).reshape(bh, classes * bw)
      start += bh * bw
  return parts


def blocks_out(rounds, results, fmesh: FactorMesh, dtype):
  """The block-mode rounds' way back: each owner sends every device of its residue class
  that device's block of its part: ({round index: this device's block of matrix q, by q},
  the collectives' outputs)."""
  back, received = {}, []
  for g in sorted({rounds[t].split for t in rounds}):
    members = [t for t in rounds if rounds[t].split == g]
    classes = fmesh.mesh.size // g
    lead = fmesh.mesh.axis_names[:len(fmesh.mesh.axis_names) - len(fmesh.group_axes(g))]
    chunks = [results[t].reshape(results[t].shape[0], classes, -1).transpose(1, 0, 2)
              .reshape(classes, -1).astype(dtype) for t in members]
    recv = jax.lax.all_to_all(jnp.concatenate(chunks, axis=1), lead, 0, 0, tiled=True)
    received.append(recv)
    start = 0
    for t, chunk in zip(members, chunks):
      rows_, bw = results[t].shape[0], results[t].shape[1] // classes
      back[t] = recv[:, start:start + chunk.shape[1]].reshape(classes, rows_, bw)
      start += chunk.shape[1]
  return back, received
