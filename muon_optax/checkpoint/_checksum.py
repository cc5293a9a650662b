"""Per-array checksums that do not depend on how an array is sharded.

The checksum of an array is the wrapping uint32 sum, over its elements, of a mixed hash
of (element bits, global flat position). A sum is order-free, so each device hashes the
shards it holds and only a scalar is all-reduced: no array is gathered onto one device,
and a checkpoint saved on 8 devices checks out on 4, 1 or fully replicated ones. The
hash is a bijection of the bits at a given position, so any change of a single element
always changes the sum; several changes cancel with probability about 2^-32. It detects
accidental corruption, not deliberate tampering. It costs one read of each array on its
devices (about 5 GB/s on a 2-core CPU, where XLA's integer sums are the bound; see
benchmarks/checkpoint_io).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from muon_optax._util import paths
from muon_optax.checkpoint import _files

ALGORITHM = "sum32-fmix32-v1"  # recorded with the checksums: a new scheme gets a new name
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
_HOST_KINDS = ("pinned_host", "unpinned_host")


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32: one word per element, two (a trailing axis) for 8-byte
  and complex elements."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], axis=-1)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  itemsize = jnp.dtype(x.dtype).itemsize
  if itemsize not in _UINT:  # sub-byte types (int4, float4): widen losslessly first
    x, itemsize = x.astype(jnp.float32), 4
  return lax.bitcast_convert_type(x, _UINT[itemsize]).astype(jnp.uint32)


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finalizer: a bijection of uint32 that spreads every bit."""
  h = (h ^ (h >> 16)) * jnp.uint32(_MIX1)
  h = (h ^ (h >> 13)) * jnp.uint32(_MIX2)
  return h ^ (h >> 16)


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
  words = _words(x)
  # The global flat position from per-axis iotas: a reshape could move shards around.
  position = jnp.zeros(words.shape, jnp.uint32)
  for axis, size in enumerate(words.shape):
    position = position * jnp.uint32(size) + lax.broadcasted_iota(jnp.uint32, words.shape, axis)
  return jnp.sum(_fmix32(words ^ (position * jnp.uint32(_GOLDEN))), dtype=jnp.uint32)


def _in_device_memory(x: Any) -> Any:
  """Host-memory (offloaded) arrays are hashed on the device, one leaf at a time."""
  sharding = getattr(x, "sharding", None)
  if getattr(sharding, "memory_kind", None) in _HOST_KINDS:
    return jax.device_put(x, sharding.with_memory_kind("device"))
  return x


class Pending(NamedTuple):
  """Checksums dispatched to the devices and still being computed: the paths of each
  tree's leaves and their scalar sums, read by `collect`."""

  paths: list[list[str]]
  sums: list[list[jax.Array]]


def dispatch(trees: Sequence[Any]) -> Pending:
  """Starts the checksums of every leaf of each tree, all dispatched before any is read,
  so that the devices hash them while the host goes on (with a save, say). Every process
  of a multi-process job must call it (each sum is all-reduced across the devices that
  hold the array)."""
  leaves = [paths.leaves_with_path(tree) for tree in trees]
  return Pending([[path for path, _ in tree] for tree in leaves],
                 [[_checksum(_in_device_memory(x)) for _, x in tree] for tree in leaves])


def collect(pending: Pending) -> list[dict[str, int]]:
  """Path -> checksum for each tree of `dispatch`, waiting for the devices."""
  sums = jax.device_get(pending.sums)
  return [{path: int(np.asarray(s)) for path, s in zip(tree_paths, tree_sums)}
          for tree_paths, tree_sums in zip(pending.paths, sums)]


def checksums_of(trees: Sequence[Any]) -> list[dict[str, int]]:
  """`checksums` of each tree (see `dispatch`)."""
  return collect(dispatch(trees))


def checksums(tree: Any) -> dict[str, int]:
  """Path -> checksum of every array leaf of `tree` (a pytree of arrays)."""
  return checksums_of([tree])[0]


# The checksums of a step, written into it just before it is committed (so the save can
# return, and the arrays be written, while the devices still compute them).
FILE = "muon_optax_checksums.json"


def write(step_dir: str, trees: Sequence[str], pending: Pending) -> None:
  """Waits for `pending` and writes its sums, as {tree name: path -> sum}, to `FILE`."""
  _files.write_json(os.path.join(step_dir, FILE),
                    {"algorithm": ALGORITHM, **dict(zip(trees, collect(pending)))})


def read(step_dir: str) -> dict:
  """What `write` wrote to `step_dir` (OSError or ValueError if it cannot be read)."""
  with open(os.path.join(step_dir, FILE)) as f:
    return json.load(f)
