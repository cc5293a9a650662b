"""Owned stacks: matrices that lie whole on their devices, or will once the devices of a
count block swap shards among themselves, are orthogonalized there: with no exchange,
or with one all-to-all inside each block and one back."""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._placement.shardings import same_spec, shard_mapped, spec_axes
from muon_optax._sharded_ns.factor_mesh import FactorMesh


def _whole(block: jax.Array, rows: tuple[str, ...], cols: tuple[str, ...]) -> jax.Array:
  """A device's (count, rows, cols) block of shards as fewer whole matrices: the count cut
  among the devices that hold the other shards of the same matrices, the shards joined."""
  if rows:
    block = jax.lax.all_to_all(block, rows, 0, 1, tiled=True)
  if cols:
    block = jax.lax.all_to_all(block, cols, 0, 2, tiled=True)
  return block


def _sharded(block: jax.Array, rows: tuple[str, ...], cols: tuple[str, ...]) -> jax.Array:
  """The inverse of `_whole`."""
  if cols:
    block = jax.lax.all_to_all(block, cols, 2, 0, tiled=True)
  if rows:
    block = jax.lax.all_to_all(block, rows, 1, 0, tiled=True)
  return block


def in_place(ns_fn, fmesh: FactorMesh, x, spec: P, out_spec: Optional[P]):
  """An owned stack (`stack_shards.owned`) orthogonalized where it lies; all-gathered if
  it is wanted replicated (`out_spec` None), else laid out as `out_spec`: its shards
  swapped back where that is `spec`, else XLA moves the whole matrices there."""
  spec = fmesh.spec(P(*(list(spec) + [None] * 3)[:3]))
  count, rows, cols = (spec_axes(e) for e in spec)
  owners = count + rows + cols  # after the swap, the count is split over all of them
  owner_spec = P(owners[0] if len(owners) == 1 else owners, None, None)
  solve = lambda b: ns_fn(_whole(b, rows, cols))
  if out_spec is None:
    body = lambda b: jax.lax.all_gather(solve(b), owners, axis=0, tiled=True)
    return shard_mapped(body, fmesh.mesh, (spec,), P())(x)
  out_spec = fmesh.spec(out_spec)
  if same_spec(out_spec, spec, 3):
    return shard_mapped(lambda b: _sharded(solve(b), rows, cols), fmesh.mesh, (spec,), spec)(x)
  y = shard_mapped(solve, fmesh.mesh, (spec,), owner_spec)(x)
  return jax.lax.with_sharding_constraint(y, NamedSharding(fmesh.mesh, out_spec))
