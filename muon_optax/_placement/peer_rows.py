"""Buffers of one row per peer, as the exchange's collectives move them.

They stay (peers, 1, width), the layout a TPU gives a collective's rows (a row a tile):
a (peers, width) view of them is a relayout of the whole buffer, a copy as large as the
exchange on the way in and on the way out. Read row s as `x[s, 0]`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_peers(segments: list[jax.Array], axes) -> jax.Array:
  """All-to-all over `axes` of the rows of `segments` stacked in order: row q goes to
  peer q; row s of the result came from peer s. Each segment (rows, width) gains its unit
  axis before they are stacked, so that each is written where the collective reads it."""
  return jax.lax.all_to_all(jnp.concatenate([s[:, None] for s in segments]), axes, 0, 0)


def from_every_peer(row: jax.Array, axes) -> jax.Array:
  """All-gather over `axes` of one row: row s of the result is peer s's."""
  return jax.lax.all_gather(row[None], axes, tiled=False)
