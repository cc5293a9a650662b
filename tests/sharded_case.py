"""The trees, meshes and runners shared by the tests of the sharded update on 8 simulated
devices, each checked against a single-device run."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit


def mesh_of(shape=(8,), names=("data",), types=AUTO):
  return jax.make_mesh(shape, names, axis_types=(types,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])


def small_tree(key=0):
  """Uneven shape groups: 6 wide 32×128 (3 transposed), one 24×40, one 32×32, stacks,
  and a 12×20 matrix that no mesh axis divides (its state stays replicated)."""
  ks = jax.random.split(jax.random.key(key), 7)
  n = lambda k, s: jax.random.normal(k, s) * 0.1
  return {"embed": {"embedding": n(ks[0], (64, 32))},
          "blocks": {"fc": {"kernel": n(ks[1], (3, 32, 128)), "bias": jnp.zeros((3, 128))},
                     "proj": {"kernel": n(ks[2], (3, 128, 32))}},
          "odd": {"kernel": n(ks[3], (24, 40))},
          "sq": {"kernel": n(ks[4], (32, 32))},
          "tiny": {"kernel": n(ks[5], (12, 20))},
          "ln": {"scale": jnp.ones(32)}}


def run_steps(tx, params, steps, shard=None):
  """`steps` updates; with `shard` = (mesh, param_shardings) everything is placed on the mesh."""
  grads = [jax.tree.map(lambda p: jax.random.normal(jax.random.key(10 + s), p.shape), params)
           for s in range(steps)]
  if shard is None:
    state, update = tx.init(params), jax.jit(tx.update)
  else:
    mesh, pshard = shard
    params = jax.device_put(params, pshard)
    grads = [jax.device_put(g, pshard) for g in grads]
    sshard = mo.state_shardings(tx, params, mesh)
    state = jax.jit(tx.init, out_shardings=sshard)(params)
    update = jax.jit(tx.update, out_shardings=(pshard, sshard))
  for g in grads:
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


# Small test matrices never pay for their traffic when split at an accelerator's
# flops-per-byte: balancing flops alone makes every split path run.
FLOPS_ALONE = 0


def placed(mesh, kind="fsdp", memory=None):
  """`mesh=` for a layout: ZeRO-1 says its params are replicated (Auto axes cannot)."""
  return mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded",
                       flops_per_byte=FLOPS_ALONE, memory=memory)


def optimizer(mesh=None, backend="optax"):
  return mo.muon(0.05, weight_decay=0.01, mesh=mesh, adam=mo.AuxAdam(1e-2, backend=backend))


def gpt2_small_tree(layers=12, d=768):
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return {str(i): {"attn": {"qkv": {"kernel": s(d, 3 * d)}, "proj": {"kernel": s(d, d)}},
                   "mlp": {"fc": {"kernel": s(d, 4 * d)}, "fc_proj": {"kernel": s(4 * d, d)}}}
          for i in range(layers)}


def param_shardings(params, mesh, kind="fsdp", data_axis="data"):
  """The params' shardings as trainers lay them out: replicated (ZeRO-1) or FSDP over
  `data_axis`."""
  if kind == "zero1":
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
  return mo.fsdp_shardings(params, mesh, data_axis=data_axis)


def lowered_update(tx, params, mesh=None, kind="zero1"):
  """The lowered update on abstract params: replicated (ZeRO-1) or FSDP on `mesh`."""
  if mesh is not None:
    shard = param_shardings(params, mesh, kind)
    params = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h),
                          params, shard)
    shardings = mo.state_shardings(tx, params, mesh)
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                         jax.eval_shape(tx.init, params), shardings)
    step = jax.jit(tx.update, out_shardings=(shard, shardings))
  else:
    state, step = jax.eval_shape(tx.init, params), jax.jit(tx.update)
  return step.lower(params, state, params)


def compiled_update(tx, params, mesh=None, kind="zero1"):
  """The compiled update on abstract params: replicated (ZeRO-1) or FSDP on `mesh`."""
  return lowered_update(tx, params, mesh, kind).compile()


def compiled_update_text(tx, params, layout, pshard):
  """The compiled program of `tx.update` with params laid out as `pshard` and the state as
  `state_shardings` lays it out beside them (`layout`), abstract: nothing runs."""
  abstract = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h),
                          params, pshard)
  sshard = mo.state_shardings(tx, abstract, layout)
  state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                       jax.eval_shape(tx.init, abstract), sshard)
  return jax.jit(tx.update, out_shardings=(pshard, sshard)).lower(
      abstract, state, abstract).compile().as_text()
