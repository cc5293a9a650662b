"""How a (count, rows, cols) matrix stack lies on a mesh: the shard of every matrix each
device holds, and what that allows (whole shards as column parts, matrices already owned
whole)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._placement.shardings import spec_axes


class StackShards(NamedTuple):
  """How a (count, rows, cols) stack lies on the mesh: every device holds a `shard`
  (rows, cols) of each matrix; `where[s]` = (shard row, shard col, replica) of device s
  (row-major over the mesh axes) and `grid` = (shard rows, shard cols)."""

  spec: P
  grid: tuple[int, int]
  shard: tuple[int, int]
  replicas: int
  where: tuple[tuple[int, int, int], ...]


def shards_of(sharding, shape: tuple[int, int, int], mesh: Mesh) -> StackShards:
  """The supported layout closest to `sharding`: the count axis unsplit and the
  matrix axes split evenly; axes it drops make the shard replicated over them."""
  spec = list(getattr(sharding, "spec", P())) + [None] * 3
  sizes = dict(mesh.shape)
  keep = [()]
  for dim in (1, 2):
    axes = spec_axes(spec[dim])
    ok = all(a in sizes for a in axes) and shape[dim] % math.prod(sizes[a] for a in axes) == 0
    keep.append(axes if ok else ())
  used = set(keep[1] + keep[2])
  rest = tuple(a for a in mesh.axis_names if a not in used)
  # Every device's coordinates at once (row-major over the mesh axes): a mesh of 1024
  # devices cut into its prime factors has ten axes, and this runs for every stack.
  coords = dict(zip(mesh.axis_names, np.indices([sizes[a] for a in mesh.axis_names])
                    .reshape(len(sizes), -1)))
  radix = lambda axes: (np.ravel_multi_index([coords[a] for a in axes], [sizes[a] for a in axes])
                        if axes else np.zeros(mesh.size, int)).tolist()
  where = tuple(zip(radix(keep[1]), radix(keep[2]), radix(rest)))
  grid = tuple(math.prod(sizes[a] for a in keep[d]) for d in (1, 2))
  entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
  return StackShards(P(None, entry(keep[1]), entry(keep[2])), grid,
                (shape[1] // grid[0], shape[2] // grid[1]),
                math.prod(sizes[a] for a in rest), where)


def takes_whole_shards(shards: StackShards, split: int, devices: int) -> bool:
  """Whether a stack's column parts take whole shards: its columns lie in one shard per
  device (device s holds shard s, no replicas) and `split` divides the shard count.
  Part p of a matrix is then shards p, p + g, p + 2g, …, which devices send to its
  owner in an all-to-all among the devices of one residue mod g: each device sends a
  shard to one owner, in a collective over n/g devices, where slicing every shard
  into g pieces would send to g owners, in one over all n."""
  return (split > 1 and shards.grid == (1, devices) and shards.replicas == 1
          and all(w[1] == s for s, w in enumerate(shards.where)) and devices % split == 0)


def owned(spec: P, shape: tuple[int, ...], mesh: Mesh) -> bool:
  """Whether each device holds whole matrices of a (count, rows, cols) stack, or will once
  the devices of each count block swap shards: its count axis split over mesh axes (a
  scanned stack or MoE experts sharded on their stack axis), its matrix axes whole or
  split over other axes (FSDP beside experts) into as many shards as each block of the
  count has matrices, or a divisor of that."""
  entries = list(spec) + [None] * 3
  count, rows, cols = (spec_axes(e) for e in entries[:3])
  axes = count + rows + cols
  if not count or len(set(axes)) != len(axes) or not all(a in mesh.shape for a in axes):
    return False
  size = lambda group: math.prod(mesh.shape[a] for a in group)
  per_block = shape[0] // size(count)
  return (shape[0] % size(count) == 0 and per_block % (size(rows) * size(cols)) == 0
          and shape[1] % size(rows) == 0 and shape[2] % size(cols) == 0)


def owned_share(spec: P, shape: tuple[int, ...], mesh: Mesh) -> int:
  """How many matrices of an `owned` stack each device orthogonalizes."""
  entries = list(spec) + [None] * 3
  axes = [a for e in entries[:3] for a in spec_axes(e)]
  return shape[0] // math.prod(mesh.shape[a] for a in axes)
