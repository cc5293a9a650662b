"""Work done one part after another, by data dependence: what bounds memory where a
compiler may reorder (or drop the barriers between) independent parts."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(tree, done):
  """`tree`'s arrays, computed only once the arrays in `done` are: an exact data
  dependence (x + 0 · the sum of their first elements, non-finite values read as 0)
  that no compiler can drop, unlike an optimization barrier (which XLA's CPU pipeline
  removes before it schedules), so that work done one part after another holds one
  part's temporaries at a time. Pass few arrays, each one operation's output: the
  sum is inlined wherever the result is used."""
  scalars = [jnp.ravel(y)[:1].astype(jnp.float32) for y in jax.tree.leaves(done)]
  if not scalars:
    return tree
  tie = jnp.sum(jnp.concatenate(scalars))
  zero = jnp.where(jnp.isfinite(tie), tie, 0.0) * 0.0
  return jax.tree.map(lambda x: x + zero.astype(x.dtype), tree)
