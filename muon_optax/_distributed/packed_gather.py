"""One all-gather for every update that leaves a sharded state but is wanted replicated.

Under ZeRO-1 (replicated params, sharded optimizer state) XLA computes each AdamW
update on its shard and gathers it leaf by leaf: a GPT-2 block's biases and norms
alone make 8 all-gathers per layer. `packed_gather` is an identity whose
`custom_partitioning` sees which leaves XLA wants replicated, packs their shards
into one flat buffer per device and gathers them in one collective.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._distributed.layouts import explicit_spec, spec_axes


def _blocks(spec: P, shape: tuple[int, ...], mesh: Mesh):
  """(blocks per dimension, a device holding each block in row-major block order),
  or None if a dimension is not split evenly."""
  sizes = dict(mesh.shape)
  entries = list(spec) + [None] * (len(shape) - len(spec))
  grid = [math.prod(sizes[a] for a in spec_axes(e)) for e in entries]
  if any(s % g for s, g in zip(shape, grid)):
    return None
  holder = {}
  for device in range(mesh.size):
    coords = dict(zip(mesh.axis_names, np.unravel_index(device, list(mesh.shape.values()))))
    key = tuple(int(np.ravel_multi_index([coords[a] for a in spec_axes(e)], [sizes[a] for a in spec_axes(e)]))
                if spec_axes(e) else 0 for e in entries)
    holder.setdefault(key, device)
  return grid, np.asarray([holder[k] for k in np.ndindex(*grid)])


def _partition(mesh, arg_shapes, result_shape):
  (args,) = arg_shapes
  split = lambda s: any(spec_axes(e) for e in s.spec)
  plans = [_blocks(a.sharding.spec, a.shape, mesh)
           if split(a.sharding) and not split(r.sharding) else None
           for a, r in zip(args, result_shape)]
  gathered = [k for k, plan in enumerate(plans) if plan is not None]

  def lower(xs):
    out = list(xs)
    if not gathered:
      return out
    dtype = jnp.result_type(*(xs[k] for k in gathered))
    flat = jnp.concatenate([xs[k].reshape(-1).astype(dtype) for k in gathered])
    every = jax.lax.all_gather(flat, tuple(mesh.axis_names), tiled=False)  # (devices, size)
    start = 0
    for k in gathered:
      (grid, holders), shape = plans[k], args[k].shape
      block = [s // g for s, g in zip(shape, grid)]
      size = math.prod(block)
      x = every[holders, start:start + size].reshape(*grid, *block)
      rank = len(shape)  # interleave (blocks, block) back into the logical axes
      x = x.transpose([i for d in range(rank) for i in (d, d + rank)]).reshape(shape)
      out[k] = x.astype(xs[k].dtype)
      start += size
    return out

  results = [NamedSharding(mesh, P()) if plan is not None else a.sharding
             for a, plan in zip(args, plans)]
  return mesh, lower, results, ([a.sharding for a in args],)


def gather_together(xs: list[jax.Array]) -> list[jax.Array]:
  """The arrays unchanged; those XLA wants replicated from a split layout are
  gathered in one packed all-gather instead of one each. Arrays of rank ≥ 1 only."""
  if not xs or any(explicit_spec(x) is not None for x in xs):  # Explicit axes: the types fix the layouts
    return list(xs)

  @custom_partitioning
  def identity(arrays):
    return list(arrays)

  # Shardy rule: every result dimension is its own factor, so each side keeps the
  # layout its neighbours give it and `_partition` sees both.
  dims = lambda k, x: " ".join(f"f{k}_{d}" for d in range(x.ndim))
  rule = (", ".join(dims(k, x) for k, x in enumerate(xs)) + " -> "
          + ", ".join(dims(k + len(xs), x) for k, x in enumerate(xs)))
  identity.def_partition(partition=_partition, sharding_rule=rule)
  return identity(list(xs))


def with_packed_gather(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner` with its updates passed through `gather_together`: under ZeRO-1 the
  updates of its split state reach the replicated params in one all-gather. The
  state is `inner`'s, unchanged, so checkpoints and state conversions are unaffected.

  Example:
    >>> import muon_optax as mo
    >>> from muon_optax._distributed.packed_gather import with_packed_gather
    >>> tx = mo.muon(0.02, adam=with_packed_gather(mo.AuxAdam(1e-3).transform()))
  """
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates: Any, state, params=None, **extra_args):
    updates, state = inner.update(updates, state, params, **extra_args)
    leaves, treedef = jax.tree.flatten(updates)
    arrays = [i for i, x in enumerate(leaves) if getattr(x, "ndim", 0) >= 1]
    for i, x in zip(arrays, gather_together([leaves[i] for i in arrays])):
      leaves[i] = x
    return jax.tree.unflatten(treedef, leaves), state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
