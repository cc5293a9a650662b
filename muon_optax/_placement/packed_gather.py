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
from muon_optax._placement.shardings import explicit_spec, shard_mapped, spec_axes
from muon_optax._util import paths


def _blocks(spec: P, shape: tuple[int, ...], sizes: dict[str, int]):
  """(blocks per dimension, the peer holding each block in row-major block order), for
  an array split as `spec` over the axes of `sizes` (in mesh order; a peer is its linear
  index over them), or None if a dimension is not split evenly."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  grid = [math.prod(sizes[a] for a in spec_axes(e)) for e in entries]
  if any(s % g for s, g in zip(shape, grid)):
    return None
  holder = {}
  for peer in range(math.prod(sizes.values())):
    coords = dict(zip(sizes, np.unravel_index(peer, list(sizes.values()))))
    key = tuple(int(np.ravel_multi_index([coords[a] for a in spec_axes(e)], [sizes[a] for a in spec_axes(e)]))
                if spec_axes(e) else 0 for e in entries)
    holder.setdefault(key, peer)
  return grid, np.asarray([holder[k] for k in np.ndindex(*grid)])


def _gathered_axes(spec: P, out: P, ndim: int) -> Optional[P]:
  """The part of `spec` that `out` drops: a spec over the axes to gather, if `out` keeps
  or drops each dimension's split whole; None if it is no such gather."""
  pad = lambda s: list(s) + [None] * (ndim - len(s))
  entries = []
  for e, o in zip(pad(spec), pad(out)):
    if spec_axes(o) and spec_axes(o) != spec_axes(e):
      return None
    entries.append(None if spec_axes(o) else e)
  return P(*entries)


def _axes(spec: P) -> set[str]:
  return {a for e in spec for a in spec_axes(e)}


def _gather_packed(xs: list[jax.Array], plans: list, axes: tuple[str, ...]) -> list[jax.Array]:
  """The per-device body: every local block in one buffer, one all-gather over `axes`,
  each array reassembled from the blocks of the peers that hold them (`plans`: `_blocks`)."""
  dtype = jnp.result_type(*xs)
  flat = jnp.concatenate([x.reshape(-1).astype(dtype) for x in xs])
  every = from_every_peer(flat, axes)  # (peers, 1, size)
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


def gather_together(xs: list[jax.Array], specs: list[P], mesh: Mesh,
                    outs: Optional[list[P]] = None) -> list[jax.Array]:
  """The arrays, each read in its layout `specs[k]`, in the layouts `outs[k]` (default:
  replicated) where those drop some of its splits whole (a ZeRO-1 update to its
  replicated parameter, or to one split over model axes only): those split evenly are
  gathered in one packed all-gather per set of axes dropped, instead of one each; the
  others are left as they are (already in place, or left to XLA)."""
  outs = [P()] * len(xs) if outs is None else outs
  drops = [_gathered_axes(spec, out, x.ndim) for x, spec, out in zip(xs, specs, outs)]
  axes_of = [tuple(a for a in mesh.axis_names if d is not None and a in _axes(d)) for d in drops]
  # One all-gather over every axis dropped, unless an array keeps one of them (it would
  # then need peers it must not mix): one per set of axes dropped.
  every = tuple(a for a in mesh.axis_names if any(a in axes for axes in axes_of))
  one = not any(set(every) & _axes(out) for out, axes in zip(outs, axes_of) if axes)
  groups: dict[tuple[str, ...], list] = {}
  for k, (x, spec, drop, axes) in enumerate(zip(xs, specs, drops, axes_of)):
    axes = every if one else axes
    plan = _blocks(drop, x.shape, {a: mesh.shape[a] for a in axes}) if axes_of[k] else None
    if plan is not None and _blocks(spec, x.shape, dict(mesh.shape)) is not None:
      groups.setdefault(axes, []).append((k, plan))
  out = list(xs)
  for axes, members in groups.items():
    body = shard_mapped(
        lambda *ys, axes=axes, members=members: tuple(
            _gather_packed(list(ys), [plan for _, plan in members], axes)),
        mesh, tuple(specs[k] for k, _ in members), tuple(outs[k] for k, _ in members))
    for (k, _), y in zip(members, body(*(xs[k] for k, _ in members))):
      out[k] = y
  return out


def _to_gather(updates: list[jax.Array], names: list[str], params: Optional[list[Any]], layout):
  """(index, layout, wanted layout) of each update to gather: those split further than
  their parameter. On an Explicit mesh the types say both, else the update lies as
  `state_shardings` lays the state out beside the params' layout (`MeshLayout.param_spec`)."""
  chosen = []
  for k, (u, name) in enumerate(zip(updates, names)):
    shape = tuple(u.shape)
    if layout.explicit:
      spec = explicit_spec(u)
      if params is not None:
        want = explicit_spec(params[k])
      elif layout.stated:
        want = layout.param_spec(name, shape)
      else:
        continue
    else:
      want = layout.param_spec(name, shape)
      spec = layout.state_spec(shape, want)
    if spec is not None and want is not None and _gathered_axes(spec, want, u.ndim) not in (
        None, P(*[None] * u.ndim)):
      chosen.append((k, spec, want))
  return chosen


def with_packed_gather(inner: optax.GradientTransformation,
                       layout) -> optax.GradientTransformationExtraArgs:
  """`inner` with the updates of its split state that are wanted less split (ZeRO-1:
  replicated params; tensor parallelism: params split over model axes only, as `layout`,
  a `MeshLayout`, says or the types show) gathered in one packed all-gather, not one per
  leaf. The state is `inner`'s, unchanged, so checkpoints and state conversions are
  unaffected.

  Examples:
    >>> import jax, muon_optax as mo
    >>> from muon_optax._placement.packed_gather import with_packed_gather
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> zero1 = mo.MeshLayout(mesh, params="replicated")
    >>> tx = mo.muon(0.02, adam=with_packed_gather(mo.AuxAdam(1e-3).transform(), zero1))
  """
  if not layout.explicit and layout.params == "sharded":
    return inner
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    layout.at_init(params)  # concrete params show their layout (MeshLayout.at_init)
    return inner.init(params)

  def update_fn(updates: Any, state, params=None, **extra_args):
    updates, state = inner.update(updates, state, params, **extra_args)
    leaves, treedef = jax.tree.flatten(updates)
    names = [name for name, _ in paths.leaves_with_path(updates)]
    arrays = [i for i, x in enumerate(leaves) if getattr(x, "ndim", 0) >= 1]
    like = None
    if params is not None:
      param_leaves = jax.tree.leaves(params)
      like = [param_leaves[i] for i in arrays] if len(param_leaves) == len(leaves) else None
    chosen = _to_gather([leaves[i] for i in arrays], [names[i] for i in arrays], like, layout)
    gathered = gather_together([leaves[arrays[k]] for k, _, _ in chosen],
                               [spec for _, spec, _ in chosen], layout.mesh,
                               [want for _, _, want in chosen])
    for (k, _, _), x in zip(chosen, gathered):
      leaves[arrays[k]] = x
    return jax.tree.unflatten(treedef, leaves), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
