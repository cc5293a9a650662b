"""Dion2's row selection: orthogonalize only the output neurons whose error-feedback
buffer is largest, and let the others accumulate until they are chosen."""

from __future__ import annotations

import dataclasses
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
from muon_optax._routing.matrix_view import MatrixView, matrix_view_of
from muon_optax._routing.value import as_routing
from muon_optax._util import paths, validate

# The compact (count, fan_in, k) stacks of selected neurons, seen as plain matrices.
_STACK_VIEW = MatrixView((0,), (1,), (2,))


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
  wide matrix about as α², for a tall one as α). The selection is on the whole matrix
  wherever it lies, so results do not depend on the mesh. At α = 1 the direction is
  Muon's without Nesterov (B is then a heavy-ball momentum).

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
  solver = solver_for(ns, mesh)

  def init_fn(params):
    return RowSelectionState(optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    del params
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=paths.is_masked)
    buffers = treedef.flatten_up_to(state.buffer)
    # leaf number -> (view, buffer stack, indices, chosen submatrices); empty leaves have
    # no direction, so their update is zero (they are empty) and their buffer stays.
    picked = {}
    for i, ((path, g), b) in enumerate(zip(flat, buffers)):
      if paths.is_masked(g) or not g.size:
        continue
      view = matrix_view_of(views, paths.path_str(path), g)
      stack = view.to_matrices(b + g.astype(b.dtype))
      index, chosen = _select(stack, select.count(stack.shape[-1]))
      picked[i] = (view, stack, index, chosen)
    wides = [_wide(chosen.astype(flat[i][1].dtype)) for i, (*_, chosen) in picked.items()]
    results = solver(wides, [w.stack for w in wides], None)
    out, new_buffers = [g for _, g in flat], list(buffers)
    for (i, (view, stack, index, chosen)), wide, result in zip(picked.items(), wides, results):
      shape, dtype = flat[i][1].shape, flat[i][1].dtype
      orthogonal = jnp.swapaxes(result, -1, -2) if wide.transposed else result
      out[i] = view.from_matrices(_scatter(orthogonal.astype(dtype), index, stack.shape[-1]),
                                  shape)
      decayed = _scatter((1 - ef_decay) * chosen, index, stack.shape[-1])
      new_buffers[i] = view.from_matrices(stack - decayed.astype(stack.dtype), shape)
    return treedef.unflatten(out), RowSelectionState(treedef.unflatten(new_buffers))

  return optax.GradientTransformation(init_fn, update_fn)


def _wide(chosen: jax.Array) -> _Wide:
  tall = chosen.shape[-2] > chosen.shape[-1]
  return _Wide(jnp.swapaxes(chosen, -1, -2) if tall else chosen, _STACK_VIEW, tall)
