"""Rows picked by a static index list as slices, never as a gather: a gather's operand and
its indices are an opaque op to a compiler (the TPU's splits it into pieces, each a
buffer of its own), while slices and a concatenate fuse with the reshapes around them
into one copy, and the identity is no op at all."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def runs(index: Sequence[int]) -> list[tuple[int, int]]:
  """`index` as (start, stop) runs of consecutive rows, in order."""
  out = []
  for k in index:
    k = int(k)
    if out and out[-1][1] == k:
      out[-1] = (out[-1][0], k + 1)
    else:
      out.append((k, k + 1))
  return out


def take_rows(x: jax.Array, index: Sequence[int]) -> jax.Array:
  """`x[index]` for a static `index` (repeats allowed): x itself when it is the
  identity, else a concatenate of one slice per run of consecutive rows."""
  spans = runs(index)
  if spans == [(0, x.shape[0])]:
    return x
  return jnp.concatenate([x[a:b] for a, b in spans], axis=0)
