"""How the m×m matrices of the iteration are held: whole on every part (`whole_rows`), or
split by rows over the devices that split X by columns (`RowBlocks`, built by a mesh)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from muon_optax._newton_schulz.operands import Matmul, Reduce, whole
from muon_optax._newton_schulz.symmetric import symmetric_gram, symmetric_product


class RowBlocks(NamedTuple):
  """How the m×m matrices of the iteration are held when X is split by columns over
  some devices: each keeps one block of their rows, and gathers a whole matrix only
  where a product needs it, so that the m×m work is split too and no m×m state is
  whole on a device between products.

  Attributes:
    sum_rows: the column parts' X_j X_jᵀ (m×m partials) -> this part's rows of their sum.
    gather: this part's rows of a matrix (rows on axis -2) -> the whole matrix.
    rows: a whole matrix (rows on axis -2) -> this part's rows.
    transposed: this part's rows of a matrix -> this part's rows of its transpose.
    times: (rows of A, rows of B, matmul) -> these rows of A B, if it is not
      matmul(rows of A, gather(rows of B)): a mesh forms B's whole columns a few at a
      time, so that no whole m×m matrix is live.
    applied: (rows of M, X's part, matmul) -> M X's part, if it is not
      matmul(gather(rows of M), X's part): a mesh forms M a few rows at a time.
    gram: (X's part, matmul, peak or None) -> this part's rows of X Xᵀ, divided by
      peak² (see `gram_rows`), if it is not sum_rows of the parts' products: a mesh sums
      a few rows at a time, dividing only each block of rows, twice.
    blocks: the block rows a symmetric product of whole rows is cut into
      (`symmetric_product`; None: `block_count`'s, 1: whole products).
    gram_space: whether whole rows' X Xᵀ starts the Gram-space iteration (its
      `block_count` differs from the standard iteration's).
  """

  sum_rows: Callable[[jax.Array], jax.Array]
  gather: Callable[[jax.Array], jax.Array]
  rows: Callable[[jax.Array], jax.Array]
  transposed: Callable[[jax.Array], jax.Array]
  times: Optional[Callable[[jax.Array, jax.Array, Callable], jax.Array]] = None
  applied: Optional[Callable[[jax.Array, jax.Array, Callable], jax.Array]] = None
  gram: Optional[Callable[[jax.Array, Callable, Optional[jax.Array]], jax.Array]] = None
  blocks: Optional[int] = None
  gram_space: bool = False

  def apply(self, m, x, mm: Matmul):
    """M X (this part's columns), from this part's rows of M."""
    return self.applied(m, x, mm) if self.applied else mm(self.gather(mm.operand(m)), x)

  def gram_rows(self, x, mm, peak=None):
    """This part's rows of X Xᵀ, summed over the column parts; with `peak` (see
    `operands.power_of_two_peak`; a mesh's `gram` only), of (X / peak)(X / peak)ᵀ, formed as
    X ((X / peak) / peak)ᵀ: the mesh divides only its blocks of rows, so that no scaled
    copy of X is made. Its entries stay within float32's range for any peak up to
    about 1e37. Whole rows take X already divided: both operands are then one copy."""
    if self.gram:
      return self.gram(x, mm, peak)
    if peak is not None:
      raise ValueError("whole rows take X already divided by its peak, not the peak")
    return self.sum_rows(symmetric_gram(x, mm, self.blocks, gram_space=self.gram_space))

  def product(self, a, b, mm: Matmul):
    """This part's rows of A B, from this part's rows of A and of B."""
    return self.times(a, b, mm) if self.times else mm(a, self.gather(mm.operand(b)))


def _identity(x):
  return x


def whole_rows(reduce: Reduce = whole, blocks: Optional[int] = None,
               gram_space: bool = False, cols: Optional[int] = None) -> RowBlocks:
  """Every part holds all rows: the m×m work is repeated on each part, and a Gram sum
  is `reduce` over the parts. Every m×m product of the iteration is of two commuting
  symmetric matrices, so it is computed as a symmetric one (`symmetric_product`) in
  `blocks` block rows (None: `block_count`'s, for the Gram-space iteration's products
  and X Xᵀ with `gram_space`, in the iteration of an X of `cols` columns; 1: whole)."""
  return RowBlocks(lambda partial: reduce(partial, jnp.add), _identity, _identity,
                   jnp.matrix_transpose,
                   times=functools.partial(symmetric_product, blocks=blocks,
                                           of="gram_space" if gram_space else "squares",
                                           n=cols),
                   blocks=blocks, gram_space=gram_space)
