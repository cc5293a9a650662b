"""Train the example GPT on a simulated 8-device mesh, with ZeRO-1 and with FSDP.

    python -m examples.sharded_training [--devices 8] [--steps 30]
    python -m examples.sharded_training --devices 2 --steps 2 --batch 4 --seq-len 16 \
        --d-model 32 --layers 1 --heads 2 --data-root DIR   # smallest: both layouts train

ZeRO-1: params replicated, optimizer state split along the "data" axis. FSDP: params
(and so gradients and state) split along "data" too. In both, Muon orthogonalizes whole
matrices dealt over the devices (`mo.muon(..., mesh=mesh)`), and the batch is split
along "data". Prints the per-device bytes of params and optimizer state, and the loss.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Optional

from workload.config import add_flags, simulate_devices


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  add_flags(p, ["devices", "steps", "batch", "seq_len", "d_model", "layers", "heads", "lr",
                "adam_lr", "data_root"], devices=8, steps=30, batch=16, seq_len=64,
            d_model=128, layers=2, lr=0.02, adam_lr=3e-3)
  return p


if __name__ == "__main__":
  simulate_devices(parser().parse_args().devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax as mo  # noqa: E402
from workload import stdlib_text  # noqa: E402
from workload.gpt import GPT, GPTConfig, loss_fn  # noqa: E402


def device_bytes(tree, device) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


# Where each layout's params lie, which an Auto mesh's traced arrays do not say.
PLACEMENT = {"zero1": "replicated", "fsdp": "sharded"}


def train(args, layout: str, mesh, data) -> dict:
  cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, layers=args.layers, heads=args.heads)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  routing = mo.infer_routing(model, jnp.zeros((1, args.seq_len), jnp.int32))
  graphdef, params = nnx.split(model)
  param_sharding = (jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
                    if layout == "zero1" else mo.fsdp_shardings(params, mesh))
  params = jax.device_put(params, param_sharding)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   mo.muon(args.lr, mesh=mo.MeshLayout(mesh, params=PLACEMENT[layout]),
                           routing=routing, adam=mo.AuxAdam(args.adam_lr, b2=0.95)))
  state_sharding = mo.state_shardings(tx, params, mesh)
  opt_state = jax.jit(tx.init, out_shardings=state_sharding)(params)
  batch_sharding = NamedSharding(mesh, P("data"))

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, out_shardings=(param_sharding, state_sharding, None))
  losses, t0 = [], time.perf_counter()
  for _ in range(args.steps):
    params, opt_state, loss = step(params, opt_state, jax.device_put(next(data), batch_sharding))
    losses.append(float(loss))
  first = jax.devices()[0]
  return {"layout": layout, "first_loss": losses[0], "final_loss": losses[-1],
          "param_bytes": device_bytes(params, first), "state_bytes": device_bytes(opt_state, first),
          "state_total": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
          "seconds": time.perf_counter() - t0}


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
  """Trains with both layouts; returns one record of each."""
  args = parser().parse_args(argv)
  if jax.device_count() < args.devices:
    parser().error(f"--devices {args.devices} but jax sees {jax.device_count()}: run it as "
                   "`python -m examples.sharded_training`, which sets XLA_FLAGS first")
  mesh = jax.make_mesh((args.devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:args.devices])
  train_split, _ = stdlib_text.load_splits(args.data_root or None, max_bytes=20_000_000)
  print(f"{args.devices} simulated devices, mesh {dict(mesh.shape)}; jax {jax.__version__}")
  rows = []
  for layout in ("zero1", "fsdp"):
    data = stdlib_text.batches(train_split.data, args.batch, args.seq_len, seed=0)
    rows.append(train(args, layout, mesh, data))
  print(f"\n{'layout':<7} {'first loss':>10} {'final loss':>10} {'params/device':>14} "
        f"{'state/device':>13} {'state total':>12} {'state share':>11} {'time':>7}")
  for r in rows:
    print(f"{r['layout']:<7} {r['first_loss']:>10.4f} {r['final_loss']:>10.4f} "
          f"{r['param_bytes']:>14,} {r['state_bytes']:>13,} {r['state_total']:>12,} "
          f"{r['state_bytes'] / r['state_total']:>11.3f} {r['seconds']:>6.1f}s")
  print(f"(an even split would give a state share of 1/{args.devices} = {1 / args.devices:.3f})")
  return rows


if __name__ == "__main__":
  main()
