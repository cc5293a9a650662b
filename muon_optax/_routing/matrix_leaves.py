"""The Muon leaves of an updates tree seen through their matrix views, once for every part
that works on them as matrices, and each as a stack of wide matrices for Newton–Schulz."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from muon_optax._routing.matrix_view import MatrixView, ViewFn, matrix_view_of
from muon_optax._util import paths


class WideStack(NamedTuple):
  """One leaf as a stack of wide (rows ≤ cols) matrices, and how to undo that."""

  stack: jax.Array  # (count, rows, cols), rows ≤ cols
  view: MatrixView
  transposed: bool


def to_wide(leaf: jax.Array, view: MatrixView) -> WideStack:
  """`leaf`'s matrices through `view`, each turned wide (transposed if tall)."""
  return wide_stack(view.to_matrices(leaf), view)


def wide_stack(matrices: jax.Array, view: MatrixView) -> WideStack:
  """A (count, fan_in, fan_out) stack of `view`'s matrices, turned wide if tall."""
  tall = matrices.shape[-2] > matrices.shape[-1]
  return WideStack(jnp.swapaxes(matrices, -1, -2) if tall else matrices, view, tall)


def from_wide(stack: jax.Array, wide: WideStack, shape: tuple[int, ...]) -> jax.Array:
  """The inverse of `to_wide`: a result `stack` of `wide`'s shape back as a leaf of `shape`."""
  return wide.view.from_matrices(unwide(stack, wide), shape)


def unwide(stack: jax.Array, wide: WideStack) -> jax.Array:
  """A result `stack` of `wide`'s shape back as (count, fan_in, fan_out) matrices."""
  return jnp.swapaxes(stack, -1, -2) if wide.transposed else stack


@dataclasses.dataclass(frozen=True)
class MatrixLeaves:
  """The leaves of a tree that a part works on as matrices: every leaf that is not an
  `optax.MaskedNode` (another branch's placeholder) has its matrix view, checked here;
  the live ones, those that are not empty, are handed to the part, in tree order. An
  empty matrix has no direction: its update stays as it is (empty)."""

  treedef: Any
  leaves: tuple[Any, ...]  # every leaf of the tree, placeholders included
  live: tuple[int, ...]  # positions of the nonempty matrix leaves
  views: tuple[MatrixView, ...]  # their views, normalized to their ranks
  paths: tuple[str, ...]  # their '/'-joined paths

  @classmethod
  def of(cls, tree: Any, views: ViewFn) -> MatrixLeaves:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=paths.is_masked)
    live, live_views, live_paths = [], [], []
    for i, (path, leaf) in enumerate(flat):
      if paths.is_masked(leaf):
        continue
      view = matrix_view_of(views, paths.path_str(path), leaf).normalize(leaf.ndim)
      if leaf.size:
        live.append(i)
        live_views.append(view)
        live_paths.append(paths.path_str(path))
    return cls(treedef, tuple(x for _, x in flat), tuple(live), tuple(live_views),
               tuple(live_paths))

  def arrays(self) -> list[jax.Array]:
    """The live leaves."""
    return [self.leaves[i] for i in self.live]

  def pick(self, tree: Any) -> list[Any]:
    """The live leaves' counterparts in `tree`, which has this tree's structure (a state
    that mirrors the updates)."""
    leaves = self.treedef.flatten_up_to(tree)
    return [leaves[i] for i in self.live]

  def pick_like(self, tree: Any) -> Optional[list[Any]]:
    """The live leaves' counterparts in `tree` (the params), or None unless it has this
    tree's leaves with their shapes."""
    if tree is None:
      return None
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=paths.is_masked)
    if len(leaves) != len(self.leaves) or any(
        getattr(leaves[i], "shape", None) != self.leaves[i].shape for i in self.live):
      return None
    return [leaves[i] for i in self.live]

  def put(self, results: Sequence[Any], tree: Any = None) -> Any:
    """`tree` (None: this one), of this structure, with its live leaves replaced by
    `results`, in order."""
    out = list(self.leaves if tree is None else self.treedef.flatten_up_to(tree))
    for i, result in zip(self.live, results, strict=True):
      out[i] = result
    return self.treedef.unflatten(out)
