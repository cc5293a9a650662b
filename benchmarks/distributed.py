"""Distributed Muon vs optax.contrib.muon under the same sharding: per-device flops,
collectives, the bytes they move and optimizer-state bytes on a GPT-2-small-shaped tree;
NorDion2 (fraction 0.25, chosen per matrix and per shard) and each kind of MuonBP step
(period 4) beside them. "muon_optax flops alone" is muon_optax with
`MeshLayout(flops_per_byte=0)`: it splits the matrices left over whatever their traffic
costs, where the default weighs it at a TPU v5p's flops per byte.

    python -m benchmarks.distributed [--layers 12] [--devices 1 2 4 8] [--biases]
    python -m benchmarks.distributed --layers 1 --d 64 --vocab 256 --devices 1 2 --peaks zero1  # smallest

A second table compiles Muon's update on 8 devices in the layouts users train in
(`common.LAYOUTS`: FSDP, ZeRO-1, Megatron-style TP alone and with FSDP, data × fsdp ×
tensor, MoE experts on an expert axis with FSDP), on Auto and Explicit meshes, told the
layout three ways: stated (`MeshLayout(mesh, params=param_shardings)`), stated with one
exchange, and a bare `mesh=` (on an Auto mesh a guess, which warns; on an Explicit one
the types say), with the temporary memory each compiles to. `--layouts` picks some of
them, `--layouts` alone none. A third (`--peaks` and some layouts) compiles the update
with its apply, params and state donated, as a trainer's step holds them, and prints
the peak memory per device of optax.adamw and mo.muon in each.

    python -m benchmarks.distributed --devices --layouts --peaks fsdp zero1 tp 3d

Everything here is read from compiled programs (XLA cost analysis, collectives in the
HLO text) and array shards, not timed: the figures are deterministic. Collective
bytes are those one device receives from the others (`benchmarks.hlo.collective_stats`); the
minimal bytes are those of moving every Muon element to its owner and back once,
2 (n−1)/n × (Muon bytes / n); under ZeRO-1 (replicated params) the way back is
instead every device receiving the updates it did not compute: (n−1)/n × (Muon
bytes / n) + (n−1)/n × (all update bytes). Both optimizers
get the same routing (hidden matrices to Muon, the embedding to AdamW), the same
params layout (ZeRO-1: replicated; FSDP: split along "data") and the state layout of
`mo.state_shardings`. Meshes use Auto axes: optax.contrib.muon fails on Explicit ones.
The tree is `common.gpt2_tree` without position embeddings (vocabulary padded to 50304).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import warnings
from collections.abc import Sequence
from typing import Optional

MAX_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={MAX_DEVICES}")

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax as mo  # noqa: E402
from benchmarks.common import (  # noqa: E402
  LAYOUTS,
  at_step,
  gpt2_tree,
  header,
  layout_data_axis,
  layout_mesh,
  layout_shardings,
)
from benchmarks.hlo import collective_stats  # noqa: E402


def contrib_dimension_numbers(params):
  """optax.contrib.muon told to route exactly as muon_optax does."""
  dims = optax.contrib.MuonDimensionNumbers()
  return jax.tree.map(lambda label: dims if label == "muon" else None, mo.label_params(params))


def layout(params, mesh, kind: str):
  """ZeRO-1: params replicated; FSDP: split along "data" (`mo.fsdp_shardings`)."""
  shardings = (jax.tree.map(lambda _: NamedSharding(mesh, P()), params) if kind == "zero1"
               else mo.fsdp_shardings(params, mesh))
  return jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                      params, shardings)


def minimal_bytes(params, mesh, kind: str) -> float:
  n = mesh.size
  size = lambda leaves: sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
  labels = jax.tree.leaves(mo.label_params(params))
  muon = size([x for x, l in zip(jax.tree.leaves(params), labels) if l == "muon"])
  back = (n - 1) / n * (size(jax.tree.leaves(params)) if kind == "zero1" else muon / n)
  return (n - 1) / n * muon / n + back


def abstract_state(tx, params, mesh, data_axis="data"):
  """`tx`'s state for abstract `params`, laid out by `mo.state_shardings`, and its
  shardings."""
  shardings = mo.state_shardings(tx, params, mesh, data_axis)
  state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                       jax.eval_shape(tx.init, params), shardings)
  return state, shardings


def measure(tx, params, mesh, data_axis="data"):
  state, shardings = abstract_state(tx, params, mesh, data_axis)
  out = (jax.tree.map(lambda p: p.sharding, params), shardings)
  compiled = jax.jit(tx.update, out_shardings=out).lower(params, state, params).compile()
  stats = collective_stats(compiled.as_text())
  state_bytes = sum(math.prod(h.shard_shape(s.shape)) * s.dtype.itemsize
                    for s, h in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)))
  return {"flops": compiled.cost_analysis()["flops"],
          "collectives": sum(n for n, _ in stats.values()),
          "collective_bytes": sum(b for _, b in stats.values()),
          "detail": {k: v for k, v in stats.items() if v[0]},
          "state_bytes": state_bytes,
          "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--d", type=int, default=768, help="width")
  p.add_argument("--vocab", type=int, default=50304)
  p.add_argument("--devices", type=int, nargs="*", default=[1, 2, 4, 8],
                 help=f"mesh sizes, at most {MAX_DEVICES} (none: the layouts' table only)")
  p.add_argument("--biases", action="store_true", help="add GPT-2's biases and LayerNorms")
  p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS,
                 help="layouts of the second table (8 devices)")
  p.add_argument("--peaks", nargs="*", default=[], choices=LAYOUTS,
                 help="layouts of the third table: update and apply, peak memory (8 devices)")
  return p


def layout_params(params, kind: str):
  """The tree of layout `kind`: EP adds 8 experts d×4d, each whole on one device."""
  if kind != "ep":
    return params
  d = params["wte"]["embedding"].shape[1]
  return {**params, "moe": {"experts": {"kernel": jax.ShapeDtypeStruct((8, d, 4 * d),
                                                                       jax.numpy.float32)}}}


def layout_rows(params, kind: str):
  """Muon's compiled update in layout `kind` on Auto and Explicit meshes, the layout told
  three ways; one row each: collectives by kind, flops, and whether it warned."""
  params = layout_params(params, kind)
  for types in (AxisType.Auto, AxisType.Explicit):
    mesh = layout_mesh(kind, types)
    shardings = layout_shardings(kind, params, mesh)
    placed = jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                          params, shardings)
    axis = layout_data_axis(kind)
    forms = {"stated": mo.MeshLayout(mesh, params=shardings, data_axis=axis),
             "stated, 1 exchange": mo.MeshLayout(mesh, params=shardings, data_axis=axis,
                                                 exchanges=1),
             "bare mesh=": mo.MeshLayout(mesh, data_axis=axis)}
    for form, layout in forms.items():
      tx = mo.muon(0.02, mesh=layout, adam=mo.AuxAdam(backend="optax"))
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = measure(tx, placed, mesh, axis)
      kinds = ", ".join(f"{n} {op}" for op, (n, _) in r["detail"].items())
      guessed = any("MeshLayout(mesh, params=" in str(w.message) for w in caught)
      yield (f"{kind:<8} {types.name:<8} {form:<19} {r['collectives']:>11} "
             f"{r['flops'] / 1e9:>12.1f} {r['temp_bytes'] / 1e6:>7.1f} "
             f"{'yes' if guessed else 'no':>6}  {kinds}")


def peak_rows(params, kind: str):
  """The update and its apply compiled together in layout `kind`, params and state
  donated, as a trainer's step holds them: the peak memory per device (arguments +
  outputs + temp − aliased) and the temp, for optax.adamw and mo.muon (by default, and
  in 4 exchanges)."""
  params = layout_params(params, kind)
  mesh, axis = layout_mesh(kind), layout_data_axis(kind)
  shardings = layout_shardings(kind, params, mesh)
  placed = jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                        params, shardings)
  muon = lambda **kw: mo.muon(0.02, mesh=mo.MeshLayout(mesh, params=shardings, data_axis=axis,
                                                       **kw), adam=mo.AuxAdam(backend="optax"))
  arms = {"optax.adamw": optax.adamw(3e-4), "mo.muon": muon(), "mo.muon, exchanges=4":
          muon(exchanges=4)}
  for name, tx in arms.items():
    state, state_shardings = abstract_state(tx, placed, mesh, axis)

    def step(grads, state, params, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    memory = jax.jit(step, out_shardings=(shardings, state_shardings), donate_argnums=(1, 2)
                     ).lower(placed, state, placed).compile().memory_analysis()
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
    yield (f"{kind:<8} {name:<22} {peak / 1e6:>8.1f} {memory.temp_size_in_bytes / 1e6:>8.1f}")


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  if max(args.devices, default=0) > len(jax.devices()):
    parser().error(f"--devices {max(args.devices)}: jax sees {len(jax.devices())} devices")
  params = gpt2_tree(args.layers, d=args.d, vocab=args.vocab, ctx=0, small_leaves=args.biases)
  print(header("benchmarks.distributed", argv))
  print(f"GPT-2-small-shaped tree, {args.layers} layers, width {args.d}, vocabulary "
        f"{args.vocab}{', with biases and LayerNorms' * args.biases}; {len(jax.devices())} "
        "simulated CPU devices")
  columns = (f"{'layout':<6} {'dev':>3} {'optimizer':<22} {'GFLOP/device':>12} {'vs 1/n':>7} "
             f"{'collectives':>11} {'coll. MB':>9} {'minimal MB':>10} {'× min':>6} "
             f"{'state MB/device':>15}")
  if args.devices:
    print(columns + "\n" + "-" * len(columns))
  single = {}
  for kind in ("zero1", "fsdp") if args.devices else ():
    for n in args.devices:
      mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                           axis_types=(jax.sharding.AxisType.Auto,))
      placed = layout(params, mesh, kind)
      least = minimal_bytes(params, mesh, kind)
      adam = mo.AuxAdam(backend="optax")
      placement = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded")
      bp = mo.muonbp(0.02, blocks=mo.BlockPeriodic(period=4), mesh=placement, adam=adam)
      flops_alone = dataclasses.replace(placement, flops_per_byte=0)
      arms = {"muon_optax": mo.muon(0.02, mesh=placement, adam=adam),
              "muon_optax flops alone": mo.muon(0.02, mesh=flops_alone, adam=adam),
              "nordion2 (0.25)": mo.nordion2(0.02, mesh=placement, adam=adam),
              "nordion2 per shard": mo.nordion2(0.02, mesh=placement, adam=adam,
                                                fraction=mo.RowSelection(0.25, scope="shard")),
              "muonbp full step": at_step(bp, 0),
              "muonbp block step": at_step(bp, 1),
              "optax.contrib.muon": optax.contrib.muon(
                  0.02, muon_weight_dimension_numbers=contrib_dimension_numbers)}
      for name, tx in arms.items():
        r = measure(tx, placed, mesh)
        if n == 1:
          single[name] = r["flops"]
        ideal = single.get(name, r["flops"] * n) / n
        print(f"{kind:<6} {n:>3} {name:<22} {r['flops'] / 1e9:>12.1f} {r['flops'] / ideal:>7.3f} "
              f"{r['collectives']:>11} {r['collective_bytes'] / 1e6:>9.1f} {least / 1e6:>10.1f} "
              f"{r['collective_bytes'] / least if least else 0:>6.2f} "
              f"{r['state_bytes'] / 1e6:>15.1f}")
        if n == max(args.devices) and name != "optax.contrib.muon":
          print(f"{'':<10} {name} collectives: {r['detail']}")
  if args.devices:
    print("\n'vs 1/n': per-device flops over (the same optimizer's 1-device flops / n).")
    print("'coll. MB': bytes one device receives from the others per update; 'minimal MB': "
          "every Muon element to its owner and back once (ZeRO-1: back = the whole update to "
          "every device).")
    print("All route the same leaves: hidden matrices to Muon, everything else to AdamW.")
  if args.layouts:
    print(f"\nmo.muon in each layout, {MAX_DEVICES} devices (the same tree; EP adds 8 experts "
          "d×4d, each whole on one device)")
    columns = (f"{'layout':<8} {'mesh':<8} {'mesh= told':<19} {'collectives':>11} "
               f"{'GFLOP/device':>12} {'temp MB':>7} {'warned':>6}  by kind")
    print("'temp MB': XLA's temporary memory per device, against the memory cap: twice "
          "the Muon state shard, plus the replicas of the updates a device holds where the "
          "layout replicates the params (the default exchanges are the fewest that fit it, "
          "else 4).")
    print("'warned': the layout was guessed, and a warning named the fix.")
    print(columns + "\n" + "-" * len(columns))
    for kind in args.layouts:
      for row in layout_rows(params, kind):
        print(row, flush=True)
  if args.peaks:
    print(f"\nUpdate and apply in one program, params and state donated, {MAX_DEVICES} devices: "
          "peak memory per device (arguments + outputs + temp − aliased) and temp, MB")
    columns = f"{'layout':<8} {'optimizer':<22} {'peak MB':>8} {'temp MB':>8}"
    print(columns + "\n" + "-" * len(columns))
    for kind in args.peaks:
      for row in peak_rows(params, kind):
        print(row, flush=True)


if __name__ == "__main__":
  main()
