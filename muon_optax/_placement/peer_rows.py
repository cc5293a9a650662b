"""Buffers of one row per peer, as the exchange's collectives move them.

They stay (peers, 1, width), the layout a TPU gives a collective's rows (a row a tile):
a (peers, width) view of them is a relayout of the whole buffer, a copy as large as the
exchange on the way in and on the way out. Read row s as `x[s, 0]`.

16-bit rows travel as 32-bit words of two elements (k and k + width/2 of a row): the
bytes of the 16-bit elements, in 32-bit tiles, which the TPU compiler lays out far
faster than a 16-bit buffer's, whose tiles pack two rows (the compile times of the
bfloat16 exchanges in docs/mesh_results.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _words(x: jax.Array) -> jax.Array:
  """16-bit `x` as 32-bit words along its last axis, word k holding elements k (high
  half) and k + ⌈width/2⌉ (low half; zero-padded to as many)."""
  if x.dtype.itemsize != 2:
    return x
  half = -(-x.shape[-1] // 2)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 2 * half - x.shape[-1])])
  bits = lambda y: jax.lax.bitcast_convert_type(y, jnp.uint16).astype(jnp.uint32)
  return (bits(x[..., :half]) << 16) | bits(x[..., half:])


def _elements(words: jax.Array, dtype, width: int) -> jax.Array:
  """The `width` elements of `dtype` in each row of `_words`."""
  if words.dtype == dtype:
    return words
  value = lambda w: jax.lax.bitcast_convert_type(w.astype(jnp.uint16), dtype)
  return jnp.concatenate([value(words >> 16), value(words & 0xFFFF)], axis=-1)[..., :width]


def to_peers(segments: list[jax.Array], axes) -> jax.Array:
  """All-to-all over `axes` of the rows of `segments` stacked in order: row q goes to
  peer q; row s of the result came from peer s. Each segment (rows, width) gains its unit
  axis before they are stacked, so that each is written where the collective reads it."""
  rows = jnp.concatenate([s[:, None] for s in segments])
  return _elements(jax.lax.all_to_all(_words(rows), axes, 0, 0), rows.dtype, rows.shape[-1])


def from_every_peer(row: jax.Array, axes) -> jax.Array:
  """All-gather over `axes` of one row: row s of the result is peer s's."""
  return _elements(jax.lax.all_gather(_words(row[None]), axes, tiled=False), row.dtype,
                   row.shape[-1])
