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
from jax.typing import ArrayLike

from muon_optax._distributed.mesh_layout import MeshLayout
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS
from muon_optax._orthogonalize import _Wide, solver_for
from muon_optax._routing.matrix_view import matrix_view_of
from muon_optax._routing.value import as_routing
from muon_optax._util import paths, validate


@dataclasses.dataclass(frozen=True)
class RowSelection:
  """Dion2's selection as one value, as `scale_by_muon(select=...)` takes it: the
  fraction of each matrix's output neurons orthogonalized per step, in (0, 1].

  Examples:
    >>> import muon_optax as mo
    >>> tx = mo.scale_by_muon(select=mo.RowSelection(0.25))
  """

  fraction: float = 0.25

  def __post_init__(self):
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
  count, fan_in, _ = chosen.shape
  out = jnp.zeros((count, fan_in, fan_out), chosen.dtype)
  return out.at[jnp.arange(count)[:, None, None], jnp.arange(fan_in)[None, :, None],
                index[:, None, :]].set(chosen)


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
  # The selection runs where the whole matrix is: on the device Newton–Schulz gives it
  # to, inside the exchange, so a mesh moves what Muon's would and nothing more.
  solver = solver_for(ns, mesh, around=lambda ns_fn: functools.partial(
      _select_and_orthogonalize, select=select, ns_fn=ns_fn))

  def init_fn(params):
    return RowSelectionState(optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=paths.is_masked)
    buffers = [b if paths.is_masked(g) else b + g.astype(b.dtype)
               for (_, g), b in zip(flat, treedef.flatten_up_to(state.buffer))]
    # Empty leaves have no direction: their update is zero (they are empty).
    live = [i for i, (_, g) in enumerate(flat) if not paths.is_masked(g) and g.size]
    leaf_views = {i: matrix_view_of(views, paths.path_str(flat[i][0]), flat[i][1]) for i in live}
    # (count, fan_in, fan_out) stacks, not turned wide: the selection needs the fan-out.
    stacks = [_Wide(leaf_views[i].to_matrices(buffers[i].astype(flat[i][1].dtype)),
                    leaf_views[i], False) for i in live]
    likes = None if params is None else jax.tree_util.tree_leaves(params, is_leaf=paths.is_masked)
    likes = [likes[i] for i in live] if likes is not None and len(likes) == len(flat) else None
    results = solver(stacks, [buffers[i] for i in live], likes)
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
