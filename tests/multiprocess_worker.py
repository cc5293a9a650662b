"""One process of a 2-process × 4-CPU-device Muon run; tests/test_multiprocess.py starts it.

Usage: python multiprocess_worker.py PORT PROCESS_ID OUT.npz LAYOUT

LAYOUT: "auto-replicated" (Auto axes, replicated params) or "explicit-fsdp" (Explicit
axes, params split by `fsdp_shardings`).
"""

import os
import sys

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=4"])
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, out, layout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
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
  types, kind = layout.split("-")
  axis_type = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type[types],))
  values = make_params()
  pshard = (mo.fsdp_shardings(values, mesh) if kind == "fsdp"
            else jax.tree.map(lambda _: NamedSharding(mesh, P()), values))
  # Each process builds the shards its devices hold from the full values it computed.
  place = lambda tree: jax.tree.map(
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: np.asarray(x)[index]),
      tree, pshard)
  params = place(values)
  tx = optimizer(mesh)
  shardings = mo.state_shardings(tx, params, mesh)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p), out_shardings=(pshard, shardings))
  for i in range(STEPS):
    updates, state = step(place(grads_at(i, values)), state, params)
    params = jax.jit(lambda p, u: jax.tree.map(lambda a, b: a + b, p, u),
                     out_shardings=pshard)(params, updates)
  flat = {paths.path_str(path): np.asarray(multihost_utils.process_allgather(x, tiled=True))
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  if process_id == 0:
    np.savez(out, **flat)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
