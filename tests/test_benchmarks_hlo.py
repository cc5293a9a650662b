"""benchmarks.hlo: the collectives of a compiled program and the bytes each device
receives."""


import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from sharded_case import (
  mesh_of,
)

from benchmarks.hlo import collective_stats


def test_collective_stats_counts_the_bytes_each_device_receives():
  mesh = mesh_of((4, 2), ("a", "b"))
  x = jnp.ones((64, 64))  # each device's block: 16×32 float32 = 2048 bytes
  f = jax.shard_map(lambda x: (jax.lax.psum(x, "a"), jax.lax.all_gather(x, "b"),
                               jax.lax.ppermute(x, "a", [(0, 1), (1, 0)]),
                               jax.lax.all_to_all(x, ("a", "b"), 0, 0, tiled=True)),
                    mesh=mesh, in_specs=P("a", "b"), out_specs=(P("a", "b"),) * 4)
  stats = collective_stats(jax.jit(f).lower(x).compile().as_text())
  block = 16 * 32 * 4
  assert stats["all-reduce"] == (1, 2 * block * 3 // 4)  # ring over 4 devices
  assert stats["all-gather"] == (1, block)  # 2 blocks result, 1 received
  assert stats["collective-permute"] == (1, block)
  assert stats["all-to-all"] == (1, block * 7 // 8)  # all but its own eighth
