"""Distributed Muon at pod scale, compiled and read, never run: flops, bytes, memory.

For real model shapes (`8b`: Llama-3-8B; `70b`: 80 layers, width 8192, ffn 28672;
`moe`: Mixtral-like, experts stacked (8, 4096, 14336)) it compiles `tx.update` on
abstract `ShapeDtypeStruct(sharding=...)` arguments for N simulated CPU devices
(`--platform cpu`) or for a TPU v5p topology (`--platform tpu`, the real TPU compiler,
offline: needs libtpu, the `tpu` extra), one process per device count, and reads:

- collectives by kind, from the compiled HLO (`benchmarks.hlo.collective_stats`);
- exchange bytes (all-to-alls and whole-mesh all-gathers, received per device) over the
  minimal (n−1)/n · (Muon bytes / n) in and the same out (ZeRO-1: out is every update,
  AdamW's too, to every device, (n−1)/n · all param bytes), the Muon results counted in
  bfloat16 on a TPU, where they go back so (`MeshLayout.exchange_dtype`; rows measured
  before moved them in float32, and their minimal counts them so); the split matrices'
  own traffic (the collectives traced in `SHARED_MATRIX_SCOPE`: Gram sums
  reduce-scattered, whole m×m matrices gathered from row blocks) is its own column;
- flops per device (`cost_analysis`) over the ideal: the Newton–Schulz flops of every
  Muon matrix (`newton_schulz_plan`, products whole as a mesh forms them) divided by n;
- temp memory (`memory_analysis().temp_size_in_bytes`) over the Muon state shard
  (Muon leaves' bytes / n); on TPU also the whole per-chip footprint against 95 GB HBM;
- compile time.

Layouts: `fsdp` (params split by `mo.fsdp_shardings`), `zero1` (replicated params),
`2d` (a data × fsdp mesh with `data_axis=("data", "fsdp")`). Arms: muon_optax, and
optax.contrib.muon (same routing) and optax.adamw where asked; "muon_optax flops alone"
is muon_optax with `MeshLayout(flops_per_byte=0)`, whose splits ignore their traffic;
"muon_optax memory 1" with `MeshLayout(memory=1)`, which splits for memory, and "muon_optax no
memory cap" with `MeshLayout(memory=math.inf)`, which splits for flops and traffic alone
(the default caps a unit of work at twice the state shard). Rows go to `--out` as
JSON lines as they are measured; a row already there is not measured again, so a long
sweep resumes where it stopped. `--plan-only` prints the planner's own per-device flops
over the ideal up to any device count, for the CPU and the GPU defaults, without
compiling.

    python -m benchmarks.scale --model 8b 70b moe --devices 8 64 256 1024
    python -m benchmarks.scale --platform tpu --devices 64 256
    python -m benchmarks.scale --plan-only --devices 8 64 256 1024 4096
    python -m benchmarks.scale --table  # the rows measured so far, as markdown
    python -m benchmarks.scale --model 8b --layers 2 --devices 8 --out /tmp/s.jsonl  # smallest
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = {  # layers, width, ffn, kv width, experts (0: dense)
    "8b": (32, 4096, 14336, 1024, 0),
    "70b": (80, 8192, 28672, 1024, 0),
    "moe": (32, 4096, 14336, 1024, 8),
}
TPU_TOPOLOGIES = {8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
                  256: "4x8x8", 512: "8x8x8"}
HBM_BYTES = 95e9  # one v5p chip
ARMS = ("muon_optax", "optax.contrib.muon", "optax.adamw")
# The frontier's cheaper steps, measured where asked (--arms): NorDion2 choosing its
# quarter of the neurons per shard, and each kind of MuonBP step (period 4).
FRONTIER_ARMS = ("nordion2 per shard", "muonbp block step", "muonbp full step")
# muon_optax with MeshLayout(flops_per_byte=0): splits balance flops alone, whatever
# traffic they cost.
FLOPS_ALONE = "muon_optax flops alone"
# muon_optax with MeshLayout(memory=1): every matrix split until its Newton–Schulz fits
# in about one Muon state shard, whatever m×m traffic that costs.
MEMORY_CAPPED = "muon_optax memory 1"
# muon_optax with MeshLayout(memory=math.inf): splits for flops and traffic alone.
UNCAPPED = "muon_optax no memory cap"
OURS = (FLOPS_ALONE, MEMORY_CAPPED, UNCAPPED)


def model_tree(model: str, layers: Optional[int] = None) -> dict:
  """The model's params as float32 ShapeDtypeStructs; names route as the default rules do
  (embedding, head, norms to AdamW; attention and MLP kernels to Muon)."""
  import jax
  import jax.numpy as jnp
  depth, d, ffn, kv, experts = MODELS[model]
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  e = (experts,) if experts else ()

  def block():
    return {"attn": {"q": {"kernel": s(d, d)}, "k": {"kernel": s(d, kv)},
                     "v": {"kernel": s(d, kv)}, "o": {"kernel": s(d, d)}},
            "mlp": {"gate": {"kernel": s(*e, d, ffn)}, "up": {"kernel": s(*e, d, ffn)},
                    "down": {"kernel": s(*e, ffn, d)}},
            "attn_norm": {"scale": s(d)}, "mlp_norm": {"scale": s(d)}}

  tree = {f"layer{i:02d}": block() for i in range(depth if layers is None else layers)}
  tree["embed"] = {"embedding": s(128256, d)}
  tree["lm_head"] = {"kernel": s(d, 128256)}
  tree["final_norm"] = {"scale": s(d)}
  return tree


def muon_matrices(params) -> list[tuple[int, int, int]]:
  """(count, rows ≤ cols) of every Muon leaf's matrices, as the default routing sees them."""
  import jax

  import muon_optax as mo
  routing = mo.Routing.from_rules()
  out = []
  labels = jax.tree_util.tree_leaves_with_path(mo.label_params(params))
  leaves = jax.tree.leaves(params)
  for (path, label), leaf in zip(labels, leaves):
    if label == "muon":
      name = "/".join(str(getattr(k, "key", k)) for k in path)
      count, fan_in, fan_out = routing.view(name, leaf.shape).matrix_shape(leaf.shape)
      out.append((count, min(fan_in, fan_out), max(fan_in, fan_out)))  # wide, as NS runs
  return out


def ideal_flops(matrices, devices: int, ns) -> float:
  """The Newton–Schulz flops of `matrices` over `devices`, products counted whole, as a
  mesh forms them (`newton_schulz_plan(symmetric=False)`)."""
  import muon_optax as mo
  return sum(c * mo.newton_schulz_plan((r, k), ns, symmetric=False).flops
             for c, r, k in matrices) / devices


def _mesh(devices, layout: str):
  from jax.sharding import AxisType, Mesh
  n = len(devices)
  if layout == "2d":
    fsdp = 8 if n >= 16 else 2
    return Mesh(np.asarray(devices).reshape(n // fsdp, fsdp), ("data", "fsdp"),
                axis_types=(AxisType.Auto,) * 2), ("data", "fsdp")
  return Mesh(np.asarray(devices).reshape(n), ("data",), axis_types=(AxisType.Auto,)), "data"


def _optimizer(arm: str, mesh, layout: str, data_axis, exchanges: Optional[int] = None):
  import optax

  import muon_optax as mo
  if arm == "optax.adamw":
    return optax.adamw(3e-4)
  if arm == "optax.contrib.muon":
    import jax
    dims = optax.contrib.MuonDimensionNumbers()
    return optax.contrib.muon(0.02, muon_weight_dimension_numbers=lambda p: jax.tree.map(
        lambda label: dims if label == "muon" else None, mo.label_params(p)))
  params = "replicated" if layout == "zero1" else "sharded"
  extra = {} if exchanges is None else {"exchanges": exchanges}
  if arm == FLOPS_ALONE:
    extra["flops_per_byte"] = 0
  if arm == MEMORY_CAPPED:
    extra["memory"] = 1.0
  if arm == UNCAPPED:
    extra["memory"] = math.inf
  placed = mo.MeshLayout(mesh, params=params, data_axis=data_axis, **extra)
  adam = mo.AuxAdam(backend="optax")
  if arm == "nordion2 per shard":
    return mo.nordion2(0.02, fraction=mo.RowSelection(0.25, scope="shard"), mesh=placed,
                       adam=adam)
  if arm.startswith("muonbp"):
    from benchmarks.common import at_step
    bp = mo.muonbp(0.02, blocks=mo.BlockPeriodic(period=4), mesh=placed, adam=adam)
    return at_step(bp, 1 if arm == "muonbp block step" else 0)
  return mo.muon(0.02, mesh=placed, adam=adam)


def measure(model: str, layout: str, arm: str, devices, platform: str,
            layers: Optional[int], exchanges: Optional[int] = None) -> dict[str, Any]:
  """Compiles one update and reads its figures (see the module doc)."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import muon_optax as mo
  from benchmarks.common import cost_analysis
  from benchmarks.hlo import collective_ops, collective_stats
  mesh, data_axis = _mesh(devices, layout)
  n = mesh.size
  params = model_tree(model, layers)
  shard = (jax.tree.map(lambda _: NamedSharding(mesh, P()), params) if layout == "zero1"
           else mo.fsdp_shardings(params, mesh, data_axis=data_axis))
  params = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h),
                        params, shard)
  tx = _optimizer(arm, mesh, layout, data_axis, exchanges)
  state_shard = mo.state_shardings(tx, params, mesh, data_axis=data_axis)
  state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                       jax.eval_shape(tx.init, params), state_shard)
  start = time.perf_counter()
  compiled = jax.jit(tx.update, out_shardings=(shard, state_shard)).lower(
      params, state, params).compile()
  seconds = time.perf_counter() - start
  stats = collective_stats(compiled.as_text())
  memory = compiled.memory_analysis()
  matrices = muon_matrices(params)
  elements = sum(c * r * k for c, r, k in matrices)
  muon_bytes = 4 * elements
  # The Muon results go back in bfloat16 where the platform's operands are 16-bit
  # (`MeshLayout.exchange_dtype`); the momenta and ZeRO-1's AdamW updates in float32.
  wire = 2 if mo.NewtonSchulz().on(platform).dtype().itemsize == 2 else 4
  # ZeRO-1: every device receives every update it did not compute, AdamW's included.
  back = (4 * sum(math.prod(p.shape) for p in jax.tree.leaves(params)) - (4 - wire) * elements
          if layout == "zero1" else wire * elements / n)
  minimal = (n - 1) / n * (muon_bytes / n + back)
  # The split matrices' own work: the collectives traced in their named scope (Gram
  # sums, whole m×m matrices gathered from row blocks). The exchange: every other
  # all-to-all (in, out, and among the devices of a residue for block-wise parts) and the
  # all-gathers over the whole mesh (ZeRO-1's results).
  ops = collective_ops(compiled.as_text())
  shared = lambda name: f"/{mo.SHARED_MATRIX_SCOPE}/" in name
  exchange = sum(b for op, g, b, name in ops if not shared(name)
                 and (op == "all-to-all" or (op == "all-gather" and g == n)))
  split_work = sum(b for _, _, b, name in ops if shared(name))
  cost = cost_analysis(compiled)
  row = {"model": model, "layers": layers or MODELS[model][0], "layout": layout, "arm": arm,
         "exchanges": exchanges if arm == "muon_optax" else None,
         "platform": platform, "devices": n, "compile_s": round(seconds, 1),
         "collectives": {k: v for k, v in stats.items() if v[0]},
         "exchange_bytes": exchange, "minimal_bytes": minimal,
         "split_bytes": split_work,
         "flops": cost.get("flops", 0.0),
         "ideal_flops": ideal_flops(matrices, n, mo.NewtonSchulz().on(platform)),
         "temp_bytes": memory.temp_size_in_bytes, "muon_state_shard_bytes": muon_bytes / n,
         "argument_bytes": memory.argument_size_in_bytes,
         "output_bytes": memory.output_size_in_bytes}
  return row


def _key(row) -> tuple:
  return (row["model"], row["layers"], row["layout"], row["arm"], row["platform"], row["devices"],
          row.get("exchanges"))


def _done(out: pathlib.Path) -> set:
  if not out.exists():
    return set()
  return {_key(json.loads(line)) for line in out.read_text().splitlines() if line.strip()}


def _child(args) -> None:
  """Measures every asked case at one device count, appending each row to --out."""
  import jax
  if args.platform == "tpu":
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(f"v5p:{TPU_TOPOLOGIES[args.count]}", "tpu").devices
  else:
    devices = jax.devices()[:args.count]
  done = _done(args.out)
  for model in args.model:
    for layout in args.layouts:
      if layout == "zero1" and args.count > args.zero1_max:
        continue
      for arm in args.arms:
        if arm == "optax.contrib.muon" and args.count > args.contrib_max:
          continue
        exchanges = args.exchanges if arm == "muon_optax" else None
        key = (model, args.layers or MODELS[model][0], layout, arm, args.platform, args.count,
               exchanges)
        if key in done:
          continue
        try:
          row = measure(model, layout, arm, devices, args.platform, args.layers, exchanges)
        except Exception as e:  # a failed compile is a row too: it says what failed
          row = dict(zip(("model", "layers", "layout", "arm", "platform", "devices",
                          "exchanges"), key),
                     error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        with args.out.open("a") as f:
          f.write(json.dumps(row) + "\n")
        print(_line(row), flush=True)


def _line(row) -> str:
  arm = row["arm"] + (f" x{row['exchanges']}" if row.get("exchanges") else "")
  head = (f"{row['model']:>4} L{row['layers']:<3} {row['layout']:<5} {row['platform']:<3} "
          f"{row['devices']:>5} {arm:<18}")
  if "error" in row:
    return f"{head} FAILED: {row['error']}"
  kinds = {"all-to-all": "A2A", "all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS",
           "collective-permute": "CP"}
  coll = " ".join(f"{n}{kinds[k]}" for k, (n, _) in row["collectives"].items()) or "none"
  ratio = lambda a, b: f"{a / b:.2f}" if b else "—"
  hbm = ""
  if row["platform"] == "tpu":
    total = row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"]
    hbm = f" {total / 1e9:6.1f} GB ({total / HBM_BYTES:.0%} HBM)"
  return (f"{head} {coll:<16} {ratio(row['exchange_bytes'], row['minimal_bytes']):>7} "
          f"{row['split_bytes'] / 1e6:>9.1f} {ratio(row['flops'], row['ideal_flops']):>7} "
          f"{ratio(row['temp_bytes'], row['muon_state_shard_bytes']):>7} "
          f"{row['compile_s']:>7.1f}{hbm}")


HEADER = (f"{'':>4} {'':4} {'layout':<5} {'':<3} {'dev':>5} {'arm':<18} {'collectives':<16} "
          f"{'B/min':>7} {'split MB':>9} {'F/ideal':>7} {'T/shard':>7} {'compile':>7}")


def markdown_table(rows: list[dict]) -> str:
  """The measured rows as a markdown table, one line per case and arm."""
  kinds = {"all-to-all": "A2A", "all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS"}
  out = ["| model | layout | platform | devices | arm | collectives | exchange / minimal | "
         "split MB | flops / ideal | temp / state shard | compile s |",
         "|---|---|---|--:|---|---|--:|--:|--:|--:|--:|"]
  order = {m: k for k, m in enumerate(MODELS)}
  rows = sorted(rows, key=lambda r: (order[r["model"]], -r["layers"], r["layout"], r["platform"],
                                     r["devices"],
                                     (ARMS + FRONTIER_ARMS + OURS).index(r["arm"]),
                                     r.get("exchanges") or 0))
  for r in rows:
    if "error" in r:
      continue
    coll = " + ".join(f"{n} {kinds.get(k, k)}" for k, (n, _) in r["collectives"].items()) or "—"
    arm = r["arm"] + (f" ×{r['exchanges']}" if r.get("exchanges") else "")
    f = lambda a, b: f"{a / b:.2f}" if b and a else "—"
    # The anchors split no matrix: their traffic is all in the collectives column.
    split = lambda r: "—" if r["arm"] in ARMS[1:] else f"{r['split_bytes'] / 1e6:.0f}"
    out.append(f"| {r['model']} ×{r['layers']} | {r['layout']} | {r['platform']} | "
               f"{r['devices']} | {arm} | {coll} | {f(r['exchange_bytes'], r['minimal_bytes'])} | "
               f"{split(r)} | {f(r['flops'], r['ideal_flops'])} | "
               f"{f(r['temp_bytes'], r['muon_state_shard_bytes'])} | {r['compile_s']:.0f} |")
  return "\n".join(out)


def plan_table(devices: Sequence[int], models: Sequence[str]) -> str:
  """The planner's per-device Newton–Schulz flops over the ideal, no compiling, under the
  default memory cap: with each backend's defaults, which weigh a split's traffic
  against the flops it saves (`MeshLayout.flops_per_byte`), and with flops alone
  (`flops_per_byte=0`)."""
  import muon_optax as mo
  defaults = {"cpu": mo.NewtonSchulz(),
              "gpu": mo.NewtonSchulz(compute_dtype="bfloat16", precision="default")}
  lines = [f"{'model':>5} {'defaults':>8} {'weighing':>12} " + " ".join(f"{n:>7}" for n in devices)]
  for model in models:
    params = model_tree(model)
    for (name, ns), (weighing, per_byte) in itertools.product(
        defaults.items(), [("flops, bytes", {}), ("flops alone", {"flops_per_byte": 0})]):
      cells = []
      for n in devices:
        plan = mo.mesh_plan(params, n, ns=ns, **per_byte)
        cells.append(plan.flops_per_device / plan.ideal_flops_per_device)
      lines.append(f"{model:>5} {name:>8} {weighing:>12} " + " ".join(f"{c:>7.2f}" for c in cells))
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["8b"])
  p.add_argument("--devices", type=int, nargs="+", default=[8, 64, 256])
  p.add_argument("--layouts", nargs="+", choices=["fsdp", "zero1", "2d"], default=["fsdp", "zero1"])
  p.add_argument("--arms", nargs="+", choices=ARMS + FRONTIER_ARMS + OURS,
                 default=list(ARMS))
  p.add_argument("--platform", choices=["cpu", "tpu"], default="cpu")
  p.add_argument("--layers", type=int, default=None, help="fewer layers than the model has")
  p.add_argument("--exchanges", type=int, default=None,
                 help="MeshLayout(exchanges=...) for muon_optax (default: its default)")
  p.add_argument("--zero1-max", type=int, default=64, help="largest device count for ZeRO-1")
  p.add_argument("--contrib-max", type=int, default=64,
                 help="largest device count for optax.contrib.muon (its compile grows fast)")
  p.add_argument("--plan-only", action="store_true", help="the planner's flops table alone")
  p.add_argument("--table", action="store_true",
                 help="print the rows already in --out as a markdown table, compile nothing")
  p.add_argument("--out", type=pathlib.Path, default=RESULTS / "scale.jsonl")
  p.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # child process
  return p


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  if args.count is not None:
    return _child(args)
  from benchmarks.common import header
  print(header("benchmarks.scale", argv))
  if args.table:
    print(markdown_table([json.loads(line) for line in args.out.read_text().splitlines()
                          if line.strip()]))
    return None
  if args.plan_only:
    print("Planner's Newton–Schulz flops per device / ideal (1-D mesh), no compile:")
    print(plan_table(args.devices, args.model))
    return None
  if args.platform == "tpu":
    bad = [n for n in args.devices if n not in TPU_TOPOLOGIES]
    if bad:
      parser().error(f"--devices {bad}: TPU v5p topologies here are {sorted(TPU_TOPOLOGIES)}")
  print(HEADER + "\n" + "-" * len(HEADER))
  forwarded = [a for a in (sys.argv[1:] if argv is None else list(argv))]
  for n in args.devices:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if args.platform == "cpu":
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={n}").strip()
    subprocess.run([sys.executable, "-m", "benchmarks.scale", *forwarded, "--count", str(n)],
                   env=env, check=True)
  print("B/min: exchange bytes (all-to-alls, whole-mesh all-gathers) over minimal; split MB: "
        "bytes per device of the split matrices' own collectives (Gram sums reduce-scattered, "
        "whole m×m matrices gathered from row blocks); F/ideal: flops per device over the "
        "ideal; T/shard: temp memory over the Muon state shard.")
  return None


if __name__ == "__main__":
  main()
