"""Matrix views: how a Muon leaf of any rank is seen as a batch of (fan_in, fan_out) matrices."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp


class MatrixView(NamedTuple):
  """Axis roles of one leaf: `batch` axes index independent matrices of shape
  (prod(fan_in axes), prod(fan_out axes)). With `blocks` > 1 the fan-out is that many
  equal contiguous blocks, each a matrix of its own: a fused projection (q, k and v in
  one (d, 3d) kernel) that the model splits after its product."""

  batch: tuple[int, ...]
  fan_in: tuple[int, ...]
  fan_out: tuple[int, ...]
  blocks: int = 1

  def normalize(self, rank: int) -> MatrixView:
    """The same view with every axis in [0, rank); a ValueError unless the axes
    are a permutation of the leaf's axes."""
    fix = lambda axes: tuple(int(a) % rank if -rank <= a < rank else a for a in axes)
    view = MatrixView(fix(self.batch), fix(self.fan_in), fix(self.fan_out), self.blocks)
    if sorted(view.batch + view.fan_in + view.fan_out) != list(range(rank)):
      raise ValueError(
          f"matrix view {self} must name every axis of a rank-{rank} leaf exactly once "
          "(batch, fan_in and fan_out; negative axes count from the end).")
    return view

  def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int, int]:
    """(number of matrices, fan_in, fan_out) for a leaf of logical `shape`."""
    view = self.normalize(len(shape))
    size = lambda axes: math.prod(shape[a] for a in axes)
    fan_out = size(view.fan_out)
    if fan_out % view.blocks:
      raise ValueError(f"matrix view {self} cuts a fan-out of {fan_out} into {view.blocks} "
                       "blocks, which do not divide it.")
    return size(view.batch) * view.blocks, size(view.fan_in), fan_out // view.blocks

  def describe(self, shape: Sequence[int]) -> str:
    count, fan_in, fan_out = self.matrix_shape(shape)
    if self.blocks > 1:
      return f"split into {count} × {fan_in}×{fan_out}"
    return f"{count}×({fan_in}×{fan_out})" if self.batch else f"{fan_in}×{fan_out}"

  def to_matrices(self, x: jax.Array) -> jax.Array:
    """Leaf -> (count, fan_in, fan_out)."""
    view = self.normalize(x.ndim)
    order = view.batch + view.fan_in + view.fan_out
    count, fan_in, fan_out = view.matrix_shape(x.shape)
    m = jnp.transpose(x, order)
    if view.blocks == 1:  # one reshape: a split leading axis keeps its layout, typed too
      return m.reshape(count, fan_in, fan_out)
    m = m.reshape(count // view.blocks, fan_in, view.blocks, fan_out)
    return jnp.swapaxes(m, 1, 2).reshape(count, fan_in, fan_out)

  def from_matrices(self, m: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """(count, fan_in, fan_out) -> leaf of `shape`; the inverse of `to_matrices`."""
    view = self.normalize(len(shape))
    order = view.batch + view.fan_in + view.fan_out
    count, fan_in, fan_out = m.shape
    if view.blocks > 1:
      m = jnp.swapaxes(m.reshape(count // view.blocks, view.blocks, fan_in, fan_out), 1, 2)
    permuted = m.reshape(tuple(shape[a] for a in order))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return jnp.transpose(permuted, inverse)

  def matrix_sums(self, x: jax.Array) -> jax.Array:
    """The sum of each matrix's entries, broadcastable against `x` (a leaf of this
    view): a Frobenius norm's square is `matrix_sums(x * x)`."""
    view = self.normalize(x.ndim)
    if view.blocks == 1:
      return jnp.sum(x, axis=view.fan_in + view.fan_out, keepdims=True)
    m = view.to_matrices(x)
    sums = jnp.broadcast_to(jnp.sum(m, axis=(1, 2), keepdims=True), m.shape)
    return view.from_matrices(sums, x.shape)


ViewFn = Callable[[str, tuple[int, ...]], Optional[MatrixView]]

_CONV = re.compile(r"(?i)conv")
_QKV = re.compile(r"(?:^|/)(query|key|value|q_proj|k_proj|v_proj)/kernel$")
# Output projections by their common names (nnx.MultiHeadAttention's `out`, `o_proj`,
# `out_proj`, nanodo's `attn_out_proj`, `attn_output`, `wo`): a rank ≥ 3 one is
# (..., heads, head_dim, d_model) wherever the module sits.
_ATTN_OUT = re.compile(r"(?:^|/)(out|wo|\w*o_proj|\w*out_proj|\w*attn_out\w*)/kernel$")


def default_view(path: str, shape: tuple[int, ...], *, per_head: bool = False) -> Optional[MatrixView]:
  """Matrix view of a leaf from its '/'-joined path and logical shape, or None.

  - rank 2: (fan_in, fan_out), the Flax Dense/Linear layout;
  - a path containing "conv", and any rank-4 leaf (a 2-D conv kernel (kh, kw, in, out)
    whatever its name): fan_in = prod of all but the last axis;
  - attention q/k/v kernels (..., d_model, heads, head_dim) and output projections
    (out, wo, *o_proj, *out_proj, *attn_out*) (..., heads, head_dim, d_model): whole
    projection, or one matrix per head;
  - anything else of rank > 2: leading axes are stacked layers or experts (batch),
    the last two are (fan_in, fan_out).
  Leading axes before the layouts above are always batch axes (scan / vmap stacks).
  """
  rank = len(shape)
  if rank < 2:
    return None
  lead = lambda k: tuple(range(rank - k))
  if rank >= 3 and _QKV.search(path):
    b = lead(3)
    if per_head:
      return MatrixView(b + (rank - 2,), (rank - 3,), (rank - 1,))
    return MatrixView(b, (rank - 3,), (rank - 2, rank - 1))
  if rank >= 3 and _ATTN_OUT.search(path):
    b = lead(3)
    if per_head:
      return MatrixView(b + (rank - 3,), (rank - 2,), (rank - 1,))
    return MatrixView(b, (rank - 3, rank - 2), (rank - 1,))
  if rank == 4 or (rank >= 3 and _CONV.search(path)):
    return MatrixView((), tuple(range(rank - 1)), (rank - 1,))
  return MatrixView(lead(2), (rank - 2,), (rank - 1,))


def view_fn(views: Optional[ViewFn], per_head: bool) -> ViewFn:
  """The user's view function, or the default one with `per_head`."""
  return views or (lambda path, shape: default_view(path, shape, per_head=per_head))


def matrix_view_of(views: ViewFn, path: str, leaf: Any) -> MatrixView:
  view = views(path, tuple(leaf.shape))
  if view is None:
    raise ValueError(
        f"parameter {path!r} of shape {tuple(leaf.shape)} reached Muon but has no matrix "
        "view; route it to 'adam' or pass views= to say how it is a matrix.")
  if not jnp.issubdtype(leaf.dtype, jnp.floating):
    raise ValueError(
        f"parameter {path!r} reached Muon with dtype {leaf.dtype}; Muon needs real "
        "floating updates. Route it to 'adam' or 'frozen'.")
  return view
