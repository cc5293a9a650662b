"""Work done one part after another, by data dependence: what bounds memory where a
compiler may reorder (or drop the barriers between) independent parts."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(tree, done):
  """`tree`'s arrays, computed only once the arrays in `done` are: an exact data
  dependence (x + 0 · the sum of their first rows, non-finite values read as 0) that no
  compiler can drop, unlike an optimization barrier (which XLA's CPU pipeline removes
  before it schedules), so that work done one part after another holds one part's
  temporaries at a time. A first row, not a first element: an all-to-all among one
  device is a copy, and one element of a product's copy is computed from one row and
  one column of its factors, ahead of the rest, which then overlaps the next part; the
  first row of an exchange's buffer is all one peer sent. Not a whole sum: that would
  be inlined wherever the result is used. Pass few arrays, each one operation's
  output."""
  scalars = [jnp.sum(y[0] if y.ndim > 1 else y, dtype=jnp.float32)[None]
             for y in jax.tree.leaves(done)]
  if not scalars:
    return tree
  tie = jnp.sum(jnp.concatenate(scalars))
  zero = jnp.where(jnp.isfinite(tie), tie, 0.0) * 0.0
  return jax.tree.map(lambda x: x + zero.astype(x.dtype), tree)
