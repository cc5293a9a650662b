"""The array checksums: the same for any sharding, computed where the shards lie, and
changed by any changed element."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax.checkpoint import _checksum


def sharded_copies(x):
  """`x` laid out as checkpoints get restored: split over 8 or 4 devices (along either
  axis), on one device, and replicated."""
  layouts = [(8, P("data")), (4, P(None, "data")), (1, P()), (8, P())]
  return [jax.device_put(x, NamedSharding(jax.make_mesh((n,), ("data",),
                                                        devices=jax.devices()[:n]), spec))
          for n, spec in layouts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool", "complex64", "uint8"])
def test_checksums_do_not_depend_on_the_sharding(dtype):
  x = (jax.random.normal(jax.random.key(0), (16, 24)) * 50).astype(dtype)
  expected = _checksum.checksums({"x": x})["x"]
  for copy in sharded_copies(x):
    assert _checksum.checksums({"x": copy}) == {"x": expected}, copy.sharding


def test_checksums_gather_no_array():
  mesh = jax.make_mesh((8,), ("data",))
  x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("data")))
  hlo = _checksum._checksum.lower(x).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_any_changed_element_changes_the_checksum():
  x = jax.random.normal(jax.random.key(1), (8, 8))
  base = _checksum.checksums(x)
  flipped = jax.lax.bitcast_convert_type(x, jnp.uint32).at[3, 5].add(1 << 20)
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
  for changed in (jax.lax.bitcast_convert_type(flipped, jnp.float32), swapped, x.T, -x):
    assert _checksum.checksums(changed) != base
