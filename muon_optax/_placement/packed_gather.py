"""One all-gather for every update that leaves a sharded state but is wanted replicated.

Under ZeRO-1 (replicated params, sharded optimizer state) XLA computes each AdamW
update on its shard and gathers it leaf by leaf: a GPT-2 block's biases and norms
alone make 8 all-gathers per layer. `gather_together` is a `jax.shard_map` that takes
the updates as the state lies (`state_shardings`), packs their shards into one flat
buffer per device and gathers them in one collective.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._placement.peer_rows import from_every_peer
from muon_optax._placement.shardings import data_spec, explicit_spec, shard_mapped, spec_axes


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


def _gather_packed(xs: list[jax.Array], plans: list, mesh: Mesh) -> list[jax.Array]:
  """The per-device body: every local block in one buffer, one all-gather, each array
  reassembled from the blocks of the devices that hold them (`plans`: `_blocks`)."""
  dtype = jnp.result_type(*xs)
  flat = jnp.concatenate([x.reshape(-1).astype(dtype) for x in xs])
  every = from_every_peer(flat, tuple(mesh.axis_names))  # (devices, 1, size)
  out, start = [], 0
  for x, (grid, holders) in zip(xs, plans):
    size = x.size
    shape = tuple(b * g for b, g in zip(x.shape, grid))
    y = every[holders, 0, start:start + size].reshape(*grid, *x.shape)
    rank = len(shape)  # interleave (blocks, block) back into the logical axes
    y = y.transpose([i for d in range(rank) for i in (d, d + rank)]).reshape(shape)
    out.append(y.astype(x.dtype))
    start += size
  return out


def gather_together(xs: list[jax.Array], specs: list[P], mesh: Mesh) -> list[jax.Array]:
  """The arrays, replicated, each read in its layout `specs[k]`: those split evenly are
  gathered in one packed all-gather instead of one each; the others are left as they
  are (already replicated, or left to XLA)."""
  plans = [_blocks(spec, x.shape, mesh) if any(spec_axes(e) for e in spec) else None
           for x, spec in zip(xs, specs)]
  split = [k for k, plan in enumerate(plans) if plan is not None]
  if not split:
    return list(xs)
  body = shard_mapped(
      lambda *ys: tuple(_gather_packed(list(ys), [plans[k] for k in split], mesh)),
      mesh, tuple(specs[k] for k in split), tuple(P() for _ in split))
  gathered = body(*(xs[k] for k in split))
  out = list(xs)
  for k, y in zip(split, gathered):
    out[k] = y
  return out


def _to_gather(updates: list[jax.Array], params: Optional[list[Any]], layout):
  """(index, layout) of each update to gather: on an Explicit mesh, those the types say
  are split while their parameter is replicated; otherwise, when `layout` says the
  params are replicated, every update split as `state_shardings` lays the state out."""
  if layout.explicit:
    if params is None:
      return []
    specs = [(k, explicit_spec(u)) for k, (u, p) in enumerate(zip(updates, params))
             if not any(spec_axes(e) for e in (explicit_spec(p) or ()))]
    return [(k, spec) for k, spec in specs if spec is not None]
  if not layout.gathers():
    return []
  return [(k, data_spec(tuple(u.shape), layout.mesh, layout.data_axis))
          for k, u in enumerate(updates)]


def with_packed_gather(inner: optax.GradientTransformation,
                       layout) -> optax.GradientTransformationExtraArgs:
  """`inner` with the updates of its split state that are wanted replicated (ZeRO-1:
  replicated params, as `layout`, a `MeshLayout`, says or the types show) gathered in
  one packed all-gather, not one per leaf. The state is `inner`'s, unchanged, so
  checkpoints and state conversions are unaffected.

  Examples:
    >>> import jax, muon_optax as mo
    >>> from muon_optax._placement.packed_gather import with_packed_gather
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> zero1 = mo.MeshLayout(mesh, params="replicated")
    >>> tx = mo.muon(0.02, adam=with_packed_gather(mo.AuxAdam(1e-3).transform(), zero1))
  """
  if not (layout.explicit or layout.gathers()):
    return inner
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates: Any, state, params=None, **extra_args):
    updates, state = inner.update(updates, state, params, **extra_args)
    leaves, treedef = jax.tree.flatten(updates)
    arrays = [i for i, x in enumerate(leaves) if getattr(x, "ndim", 0) >= 1]
    like = None
    if params is not None:
      param_leaves = jax.tree.leaves(params)
      like = [param_leaves[i] for i in arrays] if len(param_leaves) == len(leaves) else None
    chosen = _to_gather([leaves[i] for i in arrays], like, layout)
    gathered = gather_together([leaves[arrays[k]] for k, _ in chosen],
                               [spec for _, spec in chosen], layout.mesh)
    for (k, _), x in zip(chosen, gathered):
      leaves[arrays[k]] = x
    return jax.tree.unflatten(treedef, leaves), state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
