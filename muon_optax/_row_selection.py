"""Dion2's row selection: orthogonalize only the output neurons whose error-feedback
buffer is largest, and let the others accumulate until they are chosen."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from muon_optax._direction import Chain, Component, Shared
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS
from muon_optax._orthogonalize import solver_for
from muon_optax._placement.mesh_layout import MeshLayout, as_mesh_layout
from muon_optax._placement.shardings import (
  divided_axis,
  explicit_spec,
  reshard_to,
  shard_mapped,
  spec_axes,
  stack_spec,
)
from muon_optax._routing.matrix_leaves import MatrixLeaves, WideStack, unwide, wide_stack
from muon_optax._routing.matrix_view import MatrixView
from muon_optax._routing.value import RoutingLike, as_routing
from muon_optax._util import paths, validate

SCOPES = ("matrix", "shard")
# The compact (count, fan_in, k) stacks of chosen neurons, seen as plain matrices.
_STACK_VIEW = MatrixView((0,), (1,), (2,))


@dataclasses.dataclass(frozen=True)
class RowSelection(Component):
  """Dion2's selection as one value, as `scale_by_muon(select=...)` takes it.

  Attributes:
    fraction: of each matrix's output neurons, those orthogonalized per step, in (0, 1].
    scope: "matrix": the top of the whole matrix, chosen where the matrix is
      orthogonalized (the results do not depend on the mesh). "shard": chosen where the
      neurons lie, so that only the chosen ones travel: where the devices split a leaf's
      leading fan-out axis (its state's layout, as `state_shardings` makes it), the top
      of each device's shard of neurons; elsewhere the top of the whole matrix, chosen
      before the exchange (its norms are all that is gathered). The results depend on
      the device count, not on the mesh otherwise.
    devices: with scope="shard", that device count; None on a mesh: its data axes'.

  Examples:
    >>> import muon_optax as mo
    >>> tx = mo.scale_by_muon(select=mo.RowSelection(0.25))
  """

  fraction: float = 0.25
  scope: str = "matrix"
  devices: Optional[int] = None
  # An error-feedback buffer (decay: the direction's beta) in place of the momentum,
  # and its selected neurons orthogonalized.
  stage: ClassVar[str] = "orthogonal"

  @property
  def gathers(self) -> bool:
    return self.scope == "shard"  # chosen per shard, the updates come back as the state lies

  def check(self, chosen: Mapping[str, Component], shared: Shared) -> None:
    if shared.nesterov:
      raise ValueError("row selection (select=) keeps an error-feedback buffer, not a "
                       "momentum: it has no Nesterov look-ahead and no adaptive scale; pass "
                       "nesterov=False and a shape scale.")

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    return (*chain, select_rows(self, ef_decay=shared.beta, ns=shared.ns,
                                mu_dtype=shared.mu_dtype, routing=shared.routing,
                                mesh=shared.mesh))

  def __post_init__(self):
    if self.scope not in SCOPES:
      raise ValueError(f"RowSelection(scope={self.scope!r}): choose one of {list(SCOPES)}.")
    if self.devices is not None and (isinstance(self.devices, bool) or not isinstance(
        self.devices, int) or self.devices < 1):
      raise ValueError(f"RowSelection(devices={self.devices!r}) must be a positive integer.")
    if isinstance(self.fraction, (jax.Array, np.ndarray)):
      raise ValueError(
          f"fraction must be a Python number, got an array ({self.fraction!r}): it decides "
          "how many neurons are selected, a shape. Under optax.inject_hyperparams, pass "
          "static_args=('fraction',).")
    if isinstance(self.fraction, bool) or not (
        isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
      raise ValueError(f"fraction must be a number in (0, 1], got {self.fraction!r}.")

  def count(self, neurons: int) -> int:
    """How many of `neurons` output neurons are selected: ⌈fraction·neurons⌉, at least 1."""
    return max(1, math.ceil(self.fraction * neurons))


class RowSelectionState(NamedTuple):
  buffer: optax.Updates  # the error-feedback buffer, params' shapes (dtype mu_dtype or theirs)


def _select(b: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k output neurons (last axis) of largest L1 norm of each matrix of the
  (count, fan_in, fan_out) stack `b`: their (count, k) indices and the (count, fan_in, k)
  submatrices."""
  norms = jnp.sum(jnp.abs(b.astype(jnp.promote_types(b.dtype, jnp.float32))), axis=1)
  _, index = jax.lax.top_k(norms, k)
  return index, jnp.take_along_axis(b, index[:, None, :], axis=2)


def _scatter(chosen: jax.Array, index: jax.Array, fan_out: int) -> jax.Array:
  """(count, fan_in, k) values at neurons `index` of a zero (count, fan_in, fan_out) stack."""
  # A row's scatter, batched over rows and matrices: batch dims the partitioner keeps
  # where they lie, not index arrays it would gather.
  row = lambda values, where: jnp.zeros(fan_out, chosen.dtype).at[where].set(values)
  return jax.vmap(jax.vmap(row, in_axes=(0, None)))(chosen, index)


def select_rows(
    select: RowSelection = RowSelection(),
    *,
    ef_decay: ArrayLike = 0.95,
    ns: NS = DEFAULT_NS,
    mu_dtype: Optional[Any] = None,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformation:
  """Dion2's direction: an error-feedback buffer, and the orthogonalization of its
  selected output neurons only. For each matrix of a leaf's view:

      B ← B + G
      S = the ⌈α·fan_out⌉ output neurons of largest ‖B[:, j]‖₁ (α = select.fraction)
      O[:, S] = NS(B[:, S]),  O[:, not S] = 0
      B[:, S] ← ef_decay · B[:, S]            (error feedback: the rest keep accumulating)

  An output neuron is a fan-out index of the matrix view: a column of a JAX (in, out)
  kernel, a row of a PyTorch (out, in) weight (the paper's "rows"), so each selected
  neuron's update is a whole column, and NorMuon's per-neuron normalization applies.
  Newton–Schulz sees only the fan_in × k submatrices, so its flops shrink with α (for a
  wide matrix about as α², for a tall one as α). The selection is made on the whole
  matrix, on the device that orthogonalizes it: results do not depend on the mesh, and
  a mesh moves Muon's bytes. At α = 1 the direction is Muon's without Nesterov (B is
  then a heavy-ball momentum).

  Args:
    select: the `RowSelection` (the fraction α).
    ef_decay: the decay of the selected neurons' buffer, in [0, 1) (the paper's μ).
    ns: Newton–Schulz settings (see `orthogonalize`).
    mu_dtype: the buffer's floating dtype; None keeps the params'.
    routing: gives the matrix views (None: `default_view`).
    mesh: orthogonalize the submatrices dealt over the mesh (see `orthogonalize`).

  Returns:
    An `optax.GradientTransformation` with a `RowSelectionState`.

  Examples:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.select_rows(mo.RowSelection(0.25))
    >>> g = {"w": jax.random.normal(jax.random.key(0), (16, 32))}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> int(jnp.sum(jnp.any(u["w"] != 0, axis=0)))  # 8 of 32 output neurons
    8

  References:
    Ahn, Amsel, Langford 2025, "Dion2: A simple method to shrink matrix in Muon",
    arXiv 2512.16928.
  """
  validate.decay_rate("ef_decay", ef_decay)
  mu_dtype = validate.floating_dtype("mu_dtype", mu_dtype)
  views = as_routing(routing).view
  layout = as_mesh_layout(mesh)
  if select.scope == "matrix":
    # The selection runs where the whole matrix is: on the device Newton–Schulz gives it
    # to, inside the exchange, so a mesh moves what Muon's would and nothing more.
    solver = solver_for(ns, layout, around=lambda ns_fn: functools.partial(
        _select_and_orthogonalize, select=select, ns_fn=ns_fn))
    groups = None
  else:  # each shard's neurons chosen where they lie: only they reach the exchange
    solver = solver_for(ns, layout)
    shards = None if layout is None else math.prod(layout.mesh.shape[a] for a in layout.data_axis)
    groups = select.devices or shards
    if groups is None:
      raise ValueError("RowSelection(scope='shard', devices=None) takes its groups from a "
                       "mesh: pass mesh=, or devices= the number of shards.")
    # The choice runs where the groups lie when they are the mesh's data shards.
    choice_layout = layout if groups == shards and shards > 1 else None

  def init_fn(params):
    if layout is not None:  # concrete params show their layout (MeshLayout.at_init)
      layout.at_init(params)
    return RowSelectionState(optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    buffer = jax.tree.map(lambda b, g: b if paths.is_masked(g) else b + g.astype(b.dtype),
                          state.buffer, updates, is_leaf=paths.is_masked)
    leaves = MatrixLeaves.of(updates, views)
    grads, buffers, likes = leaves.arrays(), leaves.pick(buffer), leaves.pick_like(params)
    leaf_views = [solver.view_of(b, view, like, path) for b, view, like, path
                  in zip(buffers, leaves.views, likes or [None] * len(buffers), leaves.paths)]
    stacks = [view.to_matrices(b.astype(g.dtype))
              for b, g, view in zip(buffers, grads, leaf_views)]
    if groups is None:
      # (count, fan_in, fan_out) stacks, not turned wide: the selection needs the fan-out.
      results = solver.solve([WideStack(m, view, False) for m, view in zip(stacks, leaf_views)],
                             buffers, likes, paths=leaves.paths)
    else:
      # Groups where the devices split the leading fan-out axis (each holds whole neurons);
      # elsewhere one, whose selection needs only the norms gathered, not the matrix.
      kinds = [_groups_of(b, view, path, groups, choice_layout)
               for b, view, path in zip(buffers, leaf_views, leaves.paths)]
      results = _per_shard(stacks, kinds, select, solver.solve, choice_layout)
    out, new_buffers = [], []
    for result, g, b, view, path in zip(results, grads, buffers, leaf_views, leaves.paths):
      out.append(view.from_matrices(result, g.shape).astype(g.dtype))
      # The selected neurons are those with a nonzero update: their buffer decays.
      chosen = jnp.any(out[-1] != 0, axis=view.fan_in, keepdims=True)
      new_buffers.append(_as_state(jnp.where(chosen, ef_decay * b, b).astype(b.dtype), b,
                                   path, layout))
    return leaves.put(out), RowSelectionState(leaves.put(new_buffers, buffer))

  return optax.GradientTransformation(init_fn, update_fn)


def _as_state(new: jax.Array, old: jax.Array, path: str,
              layout: Optional[MeshLayout]) -> jax.Array:
  """The new buffer laid out as the state leaf `old` it replaces: its type's on an Explicit
  mesh, else as `state_shardings` lays it out beside the parameter at `path`. It is
  computed from the exchange's results, which come back on the engine's own mesh: a
  jitted step would otherwise return the state in another layout than it took, and
  compile again for the next."""
  if layout is None:
    return new
  if explicit_spec(old) is not None:
    return reshard_to(new, explicit_spec(old))
  return jax.lax.with_sharding_constraint(new, NamedSharding(layout.mesh, layout.lies(old, path)))


def _select_and_orthogonalize(stack: jax.Array, *, select: RowSelection, ns_fn) -> jax.Array:
  """A (count, fan_in, fan_out) stack orthogonalized on its selected output neurons
  only, zero on the others."""
  index, chosen = _select(stack, select.count(stack.shape[-1]))
  tall = chosen.shape[-2] > chosen.shape[-1]
  wide = jnp.swapaxes(chosen, -1, -2) if tall else chosen
  orthogonal = ns_fn(wide)
  orthogonal = jnp.swapaxes(orthogonal, -1, -2) if tall else orthogonal
  return _scatter(orthogonal.astype(stack.dtype), index, stack.shape[-1])


class _Groups(NamedTuple):
  """How one (count, fan_in, fan_out) stack is chosen from: in `n` contiguous groups of its
  fan-out (n = 1: the whole fan-out), laid out on the mesh as `spec` (three entries; all
  None without a mesh):
  with n > 1 the fan-out split over the data axes, one group per device; with n = 1 at
  most the count and the fan-in split, whose partial neuron norms are summed."""

  n: int
  spec: P


def _groups_of(x, view: MatrixView, path: str, groups: int,
               layout: Optional[MeshLayout]) -> _Groups:
  """The `_Groups` of the stack of state leaf `x` (beside the parameter at `path`):
  `groups` where the devices split its leading fan-out axis (each holds whole neurons:
  the data axes go there, see `state_shardings`), else 1. Its layout: where the leaf
  lies (`MeshLayout.lies`)."""
  shape, view = tuple(x.shape), view.normalize(x.ndim)
  n = groups if divided_axis(shape, groups) == view.fan_out[0] else 1
  if layout is None:  # nothing is laid out
    return _Groups(n, P(None, None, None))
  if n > 1:
    data = layout.data_axis
    return _Groups(n, P(None, None, data[0] if len(data) == 1 else data))
  spec = stack_spec(layout.lies(x, path), (view.batch, view.fan_in, view.fan_out), False)
  return _Groups(1, P(*(list(spec) + [None] * 3)[:2], None))


def _on_mesh(fn, layout: Optional[MeshLayout], in_specs, out_specs):
  """`fn` run on each device's blocks (`shard_mapped` over the mesh in these layouts), or
  on the whole arrays without a mesh."""
  return fn if layout is None else shard_mapped(fn, layout.mesh, in_specs, out_specs)


def _grouped(m: jax.Array, n: int) -> jax.Array:
  """(count, fan_in, n·g) -> (n·count, fan_in, g): the fan-out's groups as matrices."""
  count, fan_in, fan_out = m.shape
  return jnp.moveaxis(m.reshape(count, fan_in, n, fan_out // n), 2, 0).reshape(
      n * count, fan_in, fan_out // n)


def _ungrouped(x: jax.Array, n: int) -> jax.Array:
  """The inverse of `_grouped`."""
  count, fan_in, g = x.shape[0] // n, x.shape[1], x.shape[2]
  return jnp.moveaxis(x.reshape(n, count, fan_in, g), 0, 2).reshape(count, fan_in, n * g)


def _choose(blocks: list, groups: list[_Groups], counts: list[int], on_mesh: bool):
  """Each stack's chosen neurons: (indices, chosen submatrices) from its block (the whole
  stack without a mesh). The partial norms of every stack whose fan-in is split are summed
  in one all-reduce per set of axes, not one per stack."""
  norms = {}
  for i, (b, grp) in enumerate(zip(blocks, groups)):
    if grp.n == 1:
      norms[i] = jnp.sum(jnp.abs(b.astype(jnp.promote_types(b.dtype, jnp.float32))), axis=1)
  by_axes: dict[tuple, list[int]] = {}
  for i in norms:
    axes = spec_axes(groups[i].spec[1])
    if axes:
      by_axes.setdefault(axes, []).append(i)
  for axes, members in by_axes.items():
    packed = jax.lax.psum(jnp.concatenate([norms[i].reshape(-1) for i in members]), axes)
    offsets = np.cumsum([0] + [norms[i].size for i in members])
    for i, a, b in zip(members, offsets[:-1], offsets[1:]):
      norms[i] = packed[a:b].reshape(norms[i].shape)
  out = []
  for i, (b, grp, k) in enumerate(zip(blocks, groups, counts)):
    if grp.n == 1:
      _, index = jax.lax.top_k(norms[i], k)
      out.append((index, jnp.take_along_axis(b, index[:, None, :], axis=2)))
    elif on_mesh:  # this device's block is its group
      out.append(_select(b, k))
    else:
      index, chosen = _select(_grouped(b, grp.n), k)
      out.append((index, _ungrouped(chosen, grp.n)))
  return out


def _per_shard(stacks: list[jax.Array], groups: list[_Groups], select: RowSelection,
               solver, layout: Optional[MeshLayout]) -> list:
  """Each (count, fan_in, fan_out) stack orthogonalized on the top neurons of each of its
  groups; only those chosen go to `solver`. On a mesh the choice is made where the
  neurons lie, all stacks in one shard_map, and the chosen stay in those layouts."""
  counts = [select.count(m.shape[2] // grp.n) for m, grp in zip(stacks, groups)]
  specs = [grp.spec for grp in groups]
  index_specs = [P(s[0], s[2]) for s in specs]
  choose = _on_mesh(lambda *blocks: tuple(zip(*_choose(list(blocks), groups, counts,
                                                       layout is not None))),
                    layout, tuple(specs), (tuple(index_specs), tuple(specs)))
  indices, compact = choose(*stacks)
  wides = [wide_stack(c, _STACK_VIEW) for c in compact]
  wide_specs = [P(s[0], s[2], s[1]) if w.transposed else s for w, s in zip(wides, specs)]
  results = solver(wides, [w.stack for w in wides], None,
                   specs=wide_specs if layout is not None else None)
  results = [unwide(r, w) for w, r in zip(wides, results)]

  def scatter(*args):
    chosen, index = args[:len(stacks)], args[len(stacks):]
    out = []
    for o, where, m, grp in zip(chosen, index, stacks, groups):
      fan_out = m.shape[2] // grp.n
      if grp.n > 1 and layout is None:
        out.append(_ungrouped(_scatter(_grouped(o, grp.n), where, fan_out), grp.n))
      else:
        out.append(_scatter(o, where, fan_out))
    return tuple(out)
  full = _on_mesh(scatter, layout, (*specs, *index_specs), tuple(specs))(
      *[r.astype(m.dtype) for r, m in zip(results, stacks)], *indices)
  return list(full)
