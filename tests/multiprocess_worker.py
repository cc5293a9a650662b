"""One process of a 2-process × 4-CPU-device Muon run; tests/test_multiprocess.py starts it.

Usage: python multiprocess_worker.py PORT PROCESS_ID OUT.npz
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id, initialization_timeout=60)

import numpy as np  # noqa: E402
from distributed_case import STEPS, grads_at, make_params, optimizer  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax as mo  # noqa: E402
from muon_optax._util import paths  # noqa: E402


def main():
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rep = NamedSharding(mesh, P())
  # Every process holds the full (replicated) values and contributes its local copies.
  place = lambda tree: jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(rep, np.asarray(x)), tree)
  params = place(make_params())
  tx = optimizer(mesh)
  shardings = mo.state_shardings(tx, params, mesh)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p), out_shardings=(rep, shardings))
  for i in range(STEPS):
    updates, state = step(place(grads_at(i, make_params())), state, params)
    params = jax.jit(lambda p, u: jax.tree.map(lambda a, b: a + b, p, u),
                     out_shardings=rep)(params, updates)
  flat = {paths.path_str(path): np.asarray(multihost_utils.process_allgather(x, tiled=True))
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  if process_id == 0:
    np.savez(out, **flat)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
