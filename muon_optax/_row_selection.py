"""Dion2's row selection: orthogonalize only the output neurons whose error-feedback
buffer is largest, and let the others accumulate until they are chosen."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from muon_optax._distributed.layouts import divided_axis
from muon_optax._distributed.mesh_layout import MeshLayout, as_mesh_layout
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS
from muon_optax._orthogonalize import _Wide, solver_for
from muon_optax._routing.matrix_view import MatrixView, matrix_view_of
from muon_optax._routing.value import as_routing
from muon_optax._util import paths, validate

SCOPES = ("matrix", "shard")
# The compact (count, fan_in, k) stacks of chosen neurons, seen as plain matrices.
_STACK_VIEW = MatrixView((0,), (1,), (2,))


@dataclasses.dataclass(frozen=True)
class RowSelection:
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
    routing: Any = None,
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
    solver = solver_for(ns, mesh, around=lambda ns_fn: functools.partial(
        _select_and_orthogonalize, select=select, ns_fn=ns_fn))
    groups = None
  else:  # each shard's neurons chosen where they lie: only they reach the exchange
    solver = solver_for(ns, mesh)
    groups = select.devices or (None if layout is None else math.prod(
        layout.mesh.shape[a] for a in layout.data_axis))
    if groups is None:
      raise ValueError("RowSelection(scope='shard', devices=None) takes its groups from a "
                       "mesh: pass mesh=, or devices= the number of shards.")

  def init_fn(params):
    return RowSelectionState(optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=paths.is_masked)
    buffers = [b if paths.is_masked(g) else b + g.astype(b.dtype)
               for (_, g), b in zip(flat, treedef.flatten_up_to(state.buffer))]
    # Empty leaves have no direction: their update is zero (they are empty).
    live = [i for i, (_, g) in enumerate(flat) if not paths.is_masked(g) and g.size]
    leaf_views = {i: matrix_view_of(views, paths.path_str(flat[i][0]), flat[i][1]) for i in live}
    stacks = [leaf_views[i].to_matrices(buffers[i].astype(flat[i][1].dtype)) for i in live]
    if groups is None:
      # (count, fan_in, fan_out) stacks, not turned wide: the selection needs the fan-out.
      likes = None if params is None else jax.tree_util.tree_leaves(params,
                                                                   is_leaf=paths.is_masked)
      likes = [likes[i] for i in live] if likes is not None and len(likes) == len(flat) else None
      results = solver([_Wide(m, leaf_views[i], False) for i, m in zip(live, stacks)],
                       [buffers[i] for i in live], likes)
    else:
      # Groups where the devices split the leading fan-out axis (each holds whole neurons);
      # elsewhere one, whose selection needs only the norms gathered, not the matrix.
      shapes = [flat[i][1].shape for i in live]
      counts = [groups if divided_axis(shape, groups) == leaf_views[i].normalize(len(shape)
                                                                          ).fan_out[0] else 1
                for i, shape in zip(live, shapes)]
      results = _per_shard(stacks, counts, select, solver, layout, groups)
    out, new_buffers = [g for _, g in flat], list(buffers)
    for i, result in zip(live, results):
      view, g = leaf_views[i], flat[i][1]
      out[i] = view.from_matrices(result, g.shape).astype(g.dtype)
      # The selected neurons are those with a nonzero update: their buffer decays.
      chosen = jnp.any(out[i] != 0, axis=view.normalize(g.ndim).fan_in, keepdims=True)
      new_buffers[i] = jnp.where(chosen, ef_decay * buffers[i], buffers[i]).astype(buffers[i].dtype)
    return treedef.unflatten(out), RowSelectionState(treedef.unflatten(new_buffers))

  return optax.GradientTransformation(init_fn, update_fn)


def _select_and_orthogonalize(stack: jax.Array, *, select: RowSelection, ns_fn) -> jax.Array:
  """A (count, fan_in, fan_out) stack orthogonalized on its selected output neurons
  only, zero on the others."""
  index, chosen = _select(stack, select.count(stack.shape[-1]))
  tall = chosen.shape[-2] > chosen.shape[-1]
  wide = jnp.swapaxes(chosen, -1, -2) if tall else chosen
  orthogonal = ns_fn(wide)
  orthogonal = jnp.swapaxes(orthogonal, -1, -2) if tall else orthogonal
  return _scatter(orthogonal.astype(stack.dtype), index, stack.shape[-1])


def _on_shards(fn, layout: Optional[MeshLayout], groups: int, devices: int):
  """`fn` of arrays whose leading axis holds `groups` equal blocks, run where the blocks
  lie: in a shard_map over the data axes when the groups are the devices' shards (an
  Auto mesh), so that the partitioner adds no collective; else as it is."""
  if layout is None or layout.explicit or groups != devices or groups == 1:
    return fn
  spec = P(layout.data_axis)

  def local(*args):
    body = jax.shard_map(fn, mesh=layout.mesh, in_specs=tuple(spec for _ in args),
                         out_specs=spec, check_vma=False)
    with jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh):
      return body(*args)
  return local


def _per_shard(stacks: list[jax.Array], groups: list[int], select: RowSelection,
               solver, layout: Optional[MeshLayout], devices: int) -> list:
  """Each (count, fan_in, fan_out) stack orthogonalized on the top neurons of each of its
  `groups` contiguous groups of its fan-out; only those chosen go to `solver`."""
  compact, picks = [], []
  for m, n in zip(stacks, groups):
    count, fan_in, fan_out = m.shape
    group = fan_out // n
    # Groups first, so that a group axis split over devices stays where it lies.
    grouped = jnp.moveaxis(m.reshape(count, fan_in, n, group), 2, 0).reshape(n * count, fan_in, group)
    index, chosen = _on_shards(lambda x: _select(x, select.count(group)), layout, n,
                               devices)(grouped)
    k = index.shape[-1]
    chosen = jnp.moveaxis(chosen.reshape(n, count, fan_in, k), 0, 2).reshape(count, fan_in, n * k)
    compact.append(chosen)
    picks.append((index, n, group, k))
  wides = [_wide(c) for c in compact]
  results = solver(wides, [w.stack for w in wides], None)
  out = []
  for m, wide, result, (index, n, group, k) in zip(stacks, wides, results, picks):
    count, fan_in, fan_out = m.shape
    o = jnp.swapaxes(result, -1, -2) if wide.transposed else result
    o = jnp.moveaxis(o.reshape(count, fan_in, n, k), 2, 0).reshape(n * count, fan_in, k)
    scatter = _on_shards(lambda o, index: _scatter(o, index, group), layout, n, devices)
    full = scatter(o.astype(m.dtype), index).reshape(n, count, fan_in, group)
    out.append(jnp.moveaxis(full, 0, 2).reshape(count, fan_in, fan_out))
  return out


def _wide(chosen: jax.Array) -> _Wide:
  tall = chosen.shape[-2] > chosen.shape[-1]
  return _Wide(jnp.swapaxes(chosen, -1, -2) if tall else chosen, _STACK_VIEW, tall)
