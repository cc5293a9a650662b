"""MuonBP's block-periodic orthogonalization: most steps orthogonalize each device's own
block of every matrix, with no communication; every P-th step the whole matrix."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from muon_optax._direction import Chain, Component, Shared, momentum_of
from muon_optax._newton_schulz.iteration import newton_schulz
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS, as_newton_schulz
from muon_optax._orthogonalize import grouped_solver, orthogonalize
from muon_optax._placement.mesh_layout import EXCHANGES, MeshLayout, as_mesh_layout
from muon_optax._placement.shardings import (
  divided_axis,
  explicit_spec,
  reshard_to,
  shard_mapped,
)
from muon_optax._routing.matrix_leaves import MatrixLeaves, from_wide, to_wide
from muon_optax._routing.matrix_view import MatrixView
from muon_optax._routing.value import RoutingLike, as_routing


@dataclasses.dataclass(frozen=True)
class BlockPeriodic(Component):
  """MuonBP's schedule as one value, as `scale_by_muon(blocks=...)` takes it.

  Attributes:
    period: every `period`-th step (the first included) orthogonalizes whole matrices;
      the others each block alone. 1 is Muon.
    devices: on one device, the blocks are those a mesh of this many devices gives
      (see `orthogonalize_blocks`). On a mesh, None (or their number): its data axes'
      devices; another count is refused.
    block_scale: the block steps' rate relative to the full steps' (block steps are
      also brought to the full steps' update RMS).

  Examples:
    >>> import muon_optax as mo
    >>> tx = mo.scale_by_muon(blocks=mo.BlockPeriodic(period=4, devices=8))
  """

  period: int = 4
  devices: Optional[int] = None
  block_scale: float = 1.0
  stage: ClassVar[str] = "orthogonal"  # Muon's momentum, orthogonalized by blocks

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    return (*chain, momentum_of(shared),
            orthogonalize_blocks(self, shared.ns, routing=shared.routing, mesh=shared.mesh))

  def __post_init__(self):
    for name in ("period", "devices"):
      value = getattr(self, name)
      if not (value is None and name == "devices") and (
          isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"BlockPeriodic({name}={value!r}) must be a positive integer.")
    if not (isinstance(self.block_scale, (int, float)) and self.block_scale > 0):
      raise ValueError(f"BlockPeriodic(block_scale={self.block_scale!r}) must be a number > 0.")


DEFAULT_BLOCKS = BlockPeriodic()


class BlockPeriodicState(NamedTuple):
  count: jax.Array  # int32 scalar: steps taken; a multiple of the period is a full step.


def _block_factor(view: MatrixView, block: tuple[int, ...], whole: tuple[int, ...]) -> float:
  """√max(block dims) / √max(matrix dims): a semi-orthogonal a×b matrix has RMS
  1/√max(a, b), so this gives each orthogonalized block the RMS the whole matrix's
  orthogonalization has (the paper's RMS matching; 1 for a square matrix split by rows)."""
  _, bi, bo = view.matrix_shape(block)
  _, fi, fo = view.matrix_shape(whole)
  return math.sqrt(max(bi, bo) / max(fi, fo))


def _orthogonalize_each(xs: list[jax.Array], views: list[MatrixView], solve) -> list[jax.Array]:
  """Each array orthogonalized through its view, same shapes batched together."""
  wides = [to_wide(x, view) for x, view in zip(xs, views)]
  results = solve(wides, [x for x in xs], None)
  return [from_wide(r, w, x.shape) for r, w, x in zip(results, wides, xs)]


def _split(x: jax.Array, axis: Optional[int], n: int) -> jax.Array:
  """(n, block...) contiguous blocks of `x` along `axis` (one block: (1, x...))."""
  if axis is None:
    return x[None]
  shape = x.shape
  blocks = x.reshape(*shape[:axis], n, shape[axis] // n, *shape[axis + 1:])
  return jnp.moveaxis(blocks, axis, 0)


def _join(blocks: jax.Array, axis: Optional[int], shape: tuple[int, ...]) -> jax.Array:
  if axis is None:
    return blocks[0]
  return jnp.moveaxis(blocks, 0, axis).reshape(shape)


def _blocks_here(xs, leaf_views, blocks: BlockPeriodic, solve) -> list:
  """One device: each leaf cut into the blocks `blocks.devices` devices would hold, each
  block orthogonalized through the leaf's view, RMS-matched and scaled."""
  n = blocks.devices
  axes = [divided_axis(x.shape, n) for x in xs]
  stacked = [_split(x, a, n) for x, a in zip(xs, axes)]
  # Every block of a leaf is one more matrix of its view's batch: vmap the view.
  mats, back = [], []
  for s, view in zip(stacked, leaf_views):
    block_shape = s.shape[1:]
    m = jax.vmap(view.to_matrices)(s)
    mats.append(m.reshape(-1, *m.shape[2:]))
    back.append((m.shape, block_shape))
  ortho = _orthogonalize_each(mats, [MatrixView((0,), (1,), (2,))] * len(mats), solve)
  out = []
  for o, (mshape, block_shape), view, a, x in zip(ortho, back, leaf_views, axes, xs):
    b = jax.vmap(lambda m, v=view, s=block_shape: v.from_matrices(m, s))(o.reshape(mshape))
    factor = blocks.block_scale * _block_factor(view, block_shape, x.shape)
    out.append((_join(b, a, x.shape) * factor).astype(x.dtype))
  return out


def _blocks_on_mesh(xs, leaf_views, paths, blocks: BlockPeriodic, solve,
                    layout: MeshLayout) -> list:
  """A mesh: each device orthogonalizes its own block of each leaf in a shard_map (no
  collective), RMS-matched and scaled; results lie as the state does (`MeshLayout.lies`:
  on an Auto mesh, beside the params' stated layout)."""
  specs = [layout.lies(x, path) for x, path in zip(xs, paths)]

  def local(*ys):
    ortho = _orthogonalize_each(list(ys), leaf_views, solve)
    return tuple((o * (blocks.block_scale * _block_factor(v, y.shape, x.shape))
                  ).astype(x.dtype) for o, v, y, x in zip(ortho, leaf_views, ys, xs))

  return list(shard_mapped(local, layout.mesh, tuple(specs), tuple(specs))(*xs))


def orthogonalize_blocks(
    blocks: BlockPeriodic = DEFAULT_BLOCKS,
    ns: NS = DEFAULT_NS,
    *,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformation:
  """MuonBP's orthogonalization: every `blocks.period`-th step (the first included) as
  `orthogonalize`; every other step each block of each leaf alone, through the leaf's
  matrix view, scaled to the update RMS the whole matrix's orthogonalization has (the
  paper's RMS matching: √max(block dims) / √max(matrix dims)) and by
  `blocks.block_scale`.

  A leaf's blocks are its shards along the axis the data axes split: the one
  `state_shardings` lays its state out on (its largest axis they divide, the last of
  equals), read from the types on an Explicit mesh. On a mesh each device
  orthogonalizes its own block in a `shard_map` with no collective; on one device
  `blocks.devices` gives the count, and the results equal those of a mesh of that many
  devices. A leaf no axis of which they divide is one block. The step kind is chosen
  by `lax.cond` on the state's count, so one executable serves both.

  Args:
    blocks: the `BlockPeriodic` schedule.
    ns: Newton–Schulz settings (see `orthogonalize`).
    routing: gives the matrix views (None: `default_view`).
    mesh: the mesh the state lies on, or None.

  Returns:
    An `optax.GradientTransformation` with a `BlockPeriodicState`.

  Examples:
    >>> import jax, muon_optax as mo
    >>> tx = mo.orthogonalize_blocks(mo.BlockPeriodic(period=4, devices=2))
    >>> g = {"w": jax.random.normal(jax.random.key(0), (16, 32))}
    >>> u, state = tx.update(g, tx.init(g))  # step 0: the whole matrix
    >>> u, state = tx.update(g, state)  # step 1: its two (8, 32) halves, each alone

  References:
    Khaled et al. 2025, "MuonBP: Faster Muon via block-periodic orthogonalization",
    arXiv 2510.16981.
  """
  ns = as_newton_schulz(ns)
  views = as_routing(routing).view
  layout = as_mesh_layout(mesh)
  if layout is None and blocks.devices is None:
    raise ValueError("BlockPeriodic(devices=None) takes its blocks from a mesh: pass mesh=, "
                     "or devices= the number of devices whose blocks to use.")
  if layout is not None and blocks.devices is not None:
    shards = math.prod(layout.mesh.shape[a] for a in layout.data_axis)
    if blocks.devices != shards:
      raise ValueError(
          f"BlockPeriodic(devices={blocks.devices}) on a mesh whose data axes hold {shards} "
          "devices: on a mesh the blocks are its devices' own shards. Pass devices=None (or "
          f"{shards}) to use them, or mesh=None for the blocks of {blocks.devices} devices "
          "on one.")
  full = orthogonalize(ns, routing=routing, mesh=mesh)
  # On a mesh each device's blocks run in as many parts as the full step's exchanges at
  # most, one after another, to bound their memory alike.
  solve = grouped_solver(ns.fn or functools.partial(newton_schulz, ns=ns),
                         parts=1 if layout is None else layout.exchanges or EXCHANGES)
  period = blocks.period

  def block_step(updates, params):
    leaves = MatrixLeaves.of(updates, views)
    xs, leaf_views = leaves.arrays(), list(leaves.views)
    if layout is None:
      return leaves.put(_blocks_here(xs, leaf_views, blocks, solve))
    # Results go where the full step puts them: laid out like the params on an Explicit
    # mesh (the two branches of the cond must agree), else as the state lies.
    likes = leaves.pick_like(params) or xs
    results = _blocks_on_mesh(xs, leaf_views, leaves.paths, blocks, solve, layout)
    return leaves.put([reshard_to(r, explicit_spec(like)) for r, like in zip(results, likes)])

  def update_fn(updates, state, params=None):
    whole = lambda u: full.update(u, optax.EmptyState(), params)[0]
    blockwise = lambda u: block_step(u, params)
    if isinstance(state.count, jax.core.Tracer):
      out = jax.lax.cond(state.count % period == 0, whole, blockwise, updates)
    else:  # a known step (not traced): only its kind is built
      out = (whole if int(state.count) % period == 0 else blockwise)(updates)
    return out, BlockPeriodicState(optax.safe_increment(state.count))

  def init_fn(params):
    if layout is not None:  # concrete params show their layout (MeshLayout.at_init)
      layout.at_init(params)
    return BlockPeriodicState(jnp.zeros([], jnp.int32))

  return optax.GradientTransformation(init_fn, update_fn)

