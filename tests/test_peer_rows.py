"""Buffers of one row per peer (`peer_rows`), against the same exchange in NumPy, on 8
simulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import all_to_all_bytes
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._placement.peer_rows import from_every_peer, to_peers

N, WIDTH = 8, 5


def each_device(fn):
  """`fn` run on each device's block of its argument, jitted."""
  mesh = Mesh(np.asarray(jax.devices()[:N]), ("d",))
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


def on_each_device(fn, x):
  return each_device(fn)(x)


def test_to_peers_sends_row_q_to_peer_q_in_the_order_of_the_segments():
  # Device s holds rows x[s, q]; peer q receives them as its row s.
  x = np.arange(N * N * WIDTH, dtype=np.float32).reshape(N, N, WIDTH)
  # Two segments (3 rows, then 5) stack up as the rows they hold.
  got = on_each_device(lambda b: to_peers([b[0, :3], b[0, 3:]], "d")[None], jnp.asarray(x))
  assert got.shape == (N, N, 1, WIDTH)
  np.testing.assert_array_equal(got[:, :, 0], x.transpose(1, 0, 2))


def test_from_every_peer_gives_every_device_every_row():
  x = np.arange(N * WIDTH, dtype=np.float32).reshape(N, WIDTH)
  got = on_each_device(lambda b: from_every_peer(b[0], "d")[None], jnp.asarray(x))
  assert got.shape == (N, N, 1, WIDTH)
  for s in range(N):
    np.testing.assert_array_equal(got[s, :, 0], x)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("width", [1, 6, 7])
def test_rows_arrive_bit_for_bit_and_16_bit_rows_move_their_own_bytes(dtype, width):
  # 16-bit rows travel as 32-bit words of two elements each, an odd one padded.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((N, N, width)) * 1e3, dtype)
  x = x.at[0, 0, 0].set(jnp.nan).at[0, 0, -1].set(-jnp.inf)
  bits = lambda y: np.asarray(jax.lax.bitcast_convert_type(y, f"uint{8 * y.dtype.itemsize}"))
  send = lambda b: to_peers([b[0]], "d")[None]
  got = on_each_device(send, x)
  assert got.dtype == x.dtype
  np.testing.assert_array_equal(bits(got[:, :, 0]), bits(x.transpose(1, 0, 2)))
  gathered = on_each_device(lambda b: from_every_peer(b[0, 0], "d")[None], x)
  for s in range(N):
    np.testing.assert_array_equal(bits(gathered[s, :, 0]), bits(x[:, 0]))
  text = each_device(send).lower(x).as_text()
  words = width if x.dtype.itemsize == 4 else -(-width // 2)
  assert all_to_all_bytes(text) == [N * words * 4]
