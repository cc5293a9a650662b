"""The whole training step, Muon against AdamW: forward, backward, global-norm clip,
update and apply, compiled together, for a Llama-style decoder written as trainers write
it (`workload.llama`: Flax Linen, layers under `nn.scan` with remat, logical axis rules,
bfloat16 compute on float32 params, a chunked cross-entropy).

Compiled and read, never run (`--platform tpu`: TPU v5p topologies, the real TPU compiler
offline; `--platform cpu`: N simulated CPU devices), one process per device count:

- flops and HBM bytes per chip (`cost_analysis`, which counts a `scan` body once: the
  same model in every arm, so the difference between arms is the optimizer's);
- collectives by kind and the bytes a chip receives, of the whole step and of the
  optimizer alone (everything traced in `jax.named_scope(OPTIMIZER_SCOPE)`: clip, update,
  apply), and how many of the optimizer's the compiler made asynchronous;
- peak memory: arguments + outputs + temp − aliased (params and state are donated),
  against a v5p chip's 95 GB;
- compile time.

The table prints each arm's extra over AdamW and an estimated step time from a roofline
(`ROOFLINE`): AdamW's step is the model's flops (`workload.llama.model_flops`, PaLM's
convention, computed analytically) at the chip's peak; the extra is the optimizer's
extra flops at peak + its extra HBM bytes at HBM bandwidth + its extra bytes received at
ICI bandwidth, one after another, nothing overlapped: an upper bound on both counts. The
extra received is the whole step's against AdamW's, not the optimizer scope's alone: XLA
may combine or move collectives out of the scope they were traced in (`optax.contrib.muon`'s
partitioned products mostly land outside it).
A second estimate ("% overlapped") takes the longer of the extra flops and HBM bytes, as
a roofline prices a kernel whose reads run under its flops, and adds the collectives
after them: where the extra is mostly matrix products, the nearer figure.

Models: `8b` (Llama-3-8B), `moe` (Mixtral-8x7B: 8 experts, top 2, its 32000-token
vocabulary), `tiny` and `tiny-moe` (2 layers, width 64: the executed check). Layouts
(`LAYOUTS`): fsdp, zero1, tp (data × tensor, params replicated over data), fsdp_tp,
3d (data × fsdp × tensor), ep (fsdp × expert). Arms (`ARMS`): "muon float32 exchange"
and "muon bfloat16 exchange" are `mo.muon` with `MeshLayout(exchange_dtype=...)`, the
matrices and their results moved in that dtype both ways (the default moves float32
momenta whole and their results back in bfloat16 where the operands are 16-bit);
"muon no memory cap" is `mo.muon` with `MeshLayout(memory=math.inf)`, its Newton–Schulz
work not capped at twice the state shard. Rows go to --out as JSON lines as they are
measured, one per case (model, layout, chips, tokens a step) and arm; a row already
there is not measured again, and each arm is weighed against AdamW's row of its own
case.

`--execute` runs the step instead, on 8 simulated CPU devices with float32 compute, for
each layout and arm, and prints its largest difference from the same steps on one device.

    python -m benchmarks.train_step --platform tpu --model 8b --layouts fsdp fsdp_tp --devices 64 256
    python -m benchmarks.train_step --platform tpu --devices 256 --arms optax.adamw muon --tokens 4194304
    python -m benchmarks.train_step --platform tpu --model moe --layouts ep --devices 64
    python -m benchmarks.train_step --table
    python -m benchmarks.train_step --model tiny --arms optax.adamw muon --devices 8 --seq 16 --tokens 128
    python -m benchmarks.train_step --execute --model tiny --layouts fsdp zero1 tp fsdp_tp 3d
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"
OPTIMIZER_SCOPE = "optimizer"
HBM_BYTES = 95e9  # one v5p chip
# A v5p chip, from Google Cloud's TPU v5p page (cloud.google.com/tpu/docs/v5p): 459
# TFLOP/s bfloat16 peak, 2,765 GB/s HBM, 4,800 Gbit/s of inter-chip interconnect.
ROOFLINE = {"flops": 459e12, "hbm": 2.765e12, "ici": 600e9}
TPU_TOPOLOGIES = {8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
                  256: "4x8x8", 512: "8x8x8"}
ARMS = ("optax.adamw", "muon", "muon float32 exchange", "muon bfloat16 exchange",
        "muon no memory cap", "nordion2", "muonbp block step", "muonbp full step",
        "optax.contrib.muon")
COLLECTIVE_RE = re.compile(r"(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)"
                           r"-start\(|async-start\(")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh's axes (sizes from the device count), its logical-axis rules, and the axes
  the optimizer state is split over (`data_axis` of `state_shardings` and `MeshLayout`)."""

  axes: tuple[str, ...]
  rules: tuple[tuple[str, Any], ...]
  data_axis: Any

  def shape(self, devices: int, tensor: int, experts: int) -> tuple[int, ...]:
    fixed = {"tensor": tensor, "expert": experts, "data": 2 if len(self.axes) == 3 else None}
    known = int(np.prod([fixed[a] for a in self.axes if fixed.get(a)]))
    return tuple(fixed.get(a) or devices // known for a in self.axes)


_TENSOR = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
           ("act_heads", "tensor"), ("act_mlp", "tensor"), ("act_vocab", "tensor"))
LAYOUTS = {
    "fsdp": Layout(("fsdp",), (("batch", "fsdp"), ("embed", "fsdp"), ("exp_batch", "fsdp")), "fsdp"),
    "zero1": Layout(("data",), (("batch", "data"), ("exp_batch", "data")), "data"),
    "tp": Layout(("data", "tensor"), (("batch", "data"), ("exp_batch", "data")) + _TENSOR, "data"),
    "fsdp_tp": Layout(("fsdp", "tensor"), (("batch", "fsdp"), ("embed", "fsdp"),
                                           ("exp_batch", "fsdp")) + _TENSOR, "fsdp"),
    "3d": Layout(("data", "fsdp", "tensor"), (("batch", ("data", "fsdp")), ("embed", "fsdp"),
                                              ("exp_batch", ("data", "fsdp"))) + _TENSOR,
                 ("data", "fsdp")),
    "ep": Layout(("fsdp", "expert"), (("batch", ("fsdp", "expert")), ("embed", "fsdp"),
                                      ("exp", "expert"), ("act_exp", "expert"),
                                      ("exp_batch", "fsdp")), "fsdp"),
}


def model_config(model: str):
  """The model's shape; the tiny ones compute in float32 when executed."""
  from workload.llama import LLAMA3_8B, MIXTRAL_8X7B, LlamaConfig
  big = {"8b": LLAMA3_8B, "moe": MIXTRAL_8X7B}
  if model in big:
    return dataclasses.replace(big[model], loss_chunks=8)
  return LlamaConfig(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                     experts=4 if model == "tiny-moe" else 0, loss_chunks=2)


def make_mesh(devices: Sequence[Any], layout: str, cfg) -> Any:
  from jax.sharding import AxisType, Mesh
  spec = LAYOUTS[layout]
  tensor = 4 if len(devices) >= 64 else 2
  shape = spec.shape(len(devices), tensor, cfg.experts or 1)
  return Mesh(np.asarray(devices).reshape(shape), spec.axes,
              axis_types=(AxisType.Auto,) * len(shape))


def optimizer(arm: str, routing: Any, mesh_layout: Any, ns: Any = "turbo") -> Any:
  """`arm` after `optax.clip_by_global_norm(1.0)`; Muon arms routed by `routing` (a
  `mo.Routing`), dealt over `mesh_layout` (None: one device), Newton–Schulz by `ns`."""
  import optax

  import muon_optax as mo
  from benchmarks.common import at_step
  adam = mo.AuxAdam(3e-4)
  if arm == "optax.adamw":
    tx = optax.adamw(3e-4)
  elif arm == "muon":
    tx = mo.muon(0.02, ns=ns, routing=routing, mesh=mesh_layout, adam=adam)
  elif arm in ("muon float32 exchange", "muon bfloat16 exchange"):  # both ways in it
    wire = arm.split()[1]
    moved = mesh_layout and dataclasses.replace(mesh_layout, exchange_dtype=wire)
    tx = mo.muon(0.02, ns=ns, routing=routing, mesh=moved, adam=adam)
  elif arm == "muon no memory cap":  # Newton–Schulz work not capped at twice the state shard
    uncapped = mesh_layout and dataclasses.replace(mesh_layout, memory=math.inf)
    tx = mo.muon(0.02, ns=ns, routing=routing, mesh=uncapped, adam=adam)
  elif arm == "nordion2":
    tx = mo.nordion2(0.02, fraction=0.25, ns=ns, routing=routing, mesh=mesh_layout, adam=adam)
  elif arm.startswith("muonbp"):
    bp = mo.muonbp(0.02, blocks=mo.BlockPeriodic(period=4), ns=ns, routing=routing, mesh=mesh_layout,
                   adam=adam)
    tx = at_step(bp, 1 if arm == "muonbp block step" else 0)
  elif arm == "optax.contrib.muon":
    tx = optax.contrib.muon(0.02, adam_learning_rate=3e-4,
                            muon_weight_dimension_numbers=lambda p: contrib_dims(p, routing))
  else:
    raise ValueError(f"arm {arm!r}: choose one of {list(ARMS)}.")
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


def contrib_dims(params: Any, routing: Any) -> Any:
  """optax.contrib.muon's weight dimension numbers for `params`: each Muon leaf's matrix
  view from `routing` (a scanned kernel's layer axis is a batch axis), None elsewhere."""
  import jax
  import numpy as np
  import optax
  dims = []
  for path, x, decision in routing.decide(params):
    view = decision.view
    if view is not None and view.blocks > 1:
      raise ValueError(f"{path}: optax.contrib.muon cannot split a fused fan-out into blocks.")
    dims.append(None if view is None else optax.contrib.MuonDimensionNumbers(
        *view.normalize(np.ndim(x))[1:3]))
  return jax.tree.unflatten(jax.tree.structure(params), dims)


@dataclasses.dataclass(frozen=True)
class Setup:
  """A step ready to lower: the jitted function, abstract (or concrete) arguments, the
  optimizer, and the shardings of params and state (None on one device)."""

  step: Any
  params: Any
  state: Any
  batch: tuple[Any, Any]
  mesh: Any
  tx: Any
  shardings: Any = None


def setup(cfg, layout: Optional[str], mesh: Any, arm: str, batch: int, seq: int,
          params: Any = None) -> Setup:
  """The jitted whole step on `mesh` laid out as `layout` (None, None: one device), with
  abstract arguments, or `params` (concrete, unsharded) placed and a state initialized."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import muon_optax as mo
  from workload.llama import Llama
  model = Llama(cfg)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)["params"]
  abstract = nn.unbox(boxed)
  routing = mo.infer_routing(lambda p, x, y: model.apply({"params": p}, x, y), abstract,
                             tokens, tokens)
  rules = LAYOUTS[layout].rules if layout else ()
  placed = shardings = None
  if mesh is not None:  # the layout stated as the shardings passed to jit
    spec = LAYOUTS[layout]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    placed = mo.MeshLayout(mesh, params=shardings, data_axis=spec.data_axis)
  # A float64 reference runs Newton–Schulz in float64 too.
  ns = mo.NewtonSchulz(compute_dtype=cfg.dtype) if cfg.dtype == "float64" else "turbo"
  tx = optimizer(arm, routing, placed, ns)

  def step(params, opt_state, inputs, targets):
    with nn.logical_axis_rules(rules):
      loss, grads = jax.value_and_grad(
          lambda p: model.apply({"params": p}, inputs, targets))(params)
    with jax.named_scope(OPTIMIZER_SCOPE):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, loss

  if mesh is None:
    params = params if params is not None else abstract
    state = jax.eval_shape(tx.init, params) if params is abstract else tx.init(params)
    return Setup(jax.jit(step), params, state, (tokens, tokens), None, tx)
  batch_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", None), rules))
  typed = lambda tree, sh: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
  state_shardings = mo.state_shardings(tx, typed(abstract, shardings), mesh, spec.data_axis)
  jitted = jax.jit(step, in_shardings=(shardings, state_shardings, batch_sharding, batch_sharding),
                   out_shardings=(shardings, state_shardings, NamedSharding(mesh, P())),
                   donate_argnums=(0, 1))
  if params is None:
    params = typed(abstract, shardings)
    state = typed(jax.eval_shape(tx.init, params), state_shardings)
  else:
    params = jax.device_put(params, shardings)
    state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sharding)
  return Setup(jitted, params, state, (tokens, tokens), mesh, tx, (shardings, state_shardings))


def lower(s: Setup) -> Any:
  import jax
  if s.mesh is None:
    return s.step.lower(s.params, s.state, *s.batch)
  with jax.set_mesh(s.mesh):
    return s.step.lower(s.params, s.state, *s.batch)


def collectives(text: str) -> dict[str, dict[str, list]]:
  """Collectives of a compiled program, {kind: [count, bytes received]}, of the whole step
  ("step"), of the optimizer alone ("optimizer"), and the optimizer's asynchronous ones
  ("async": `*-start` ops and `async-start` wrappers traced in its scope)."""
  from benchmarks.hlo import collective_ops
  out = {"step": {}, "optimizer": {}}
  for op, _, moved, name in collective_ops(text):
    for part in ("step", "optimizer") if f"{OPTIMIZER_SCOPE}/" in name else ("step",):
      count, moved_before = out[part].get(op, (0, 0))
      out[part][op] = [count + 1, int(moved_before + moved)]
  out["async"] = sum(1 for line in text.splitlines()
                     if COLLECTIVE_RE.search(line) and f"{OPTIMIZER_SCOPE}/" in line)
  return out


def measure(model: str, layout: str, arm: str, devices: Sequence[Any], platform: str,
            seq: int, tokens: int) -> dict[str, Any]:
  """Compiles one whole step and reads its figures (see the module doc)."""
  from benchmarks.common import cost_analysis
  from workload.llama import model_flops
  cfg = model_config(model)
  mesh = make_mesh(devices, layout, cfg)
  s = setup(cfg, layout, mesh, arm, tokens // seq, seq)
  lowered = lower(s)
  start = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  cost = cost_analysis(compiled)
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  return {"model": model, "layout": layout, "arm": arm, "platform": platform,
          "devices": mesh.size, "mesh": dict(mesh.shape), "seq": seq, "tokens": tokens,
          "compile_s": round(seconds, 1), "flops": cost.get("flops", 0.0),
          "hbm_bytes": cost.get("bytes accessed", 0.0),
          "model_flops": model_flops(cfg, tokens, seq) / mesh.size,
          "collectives": collectives(compiled.as_text()), "peak_bytes": peak,
          "temp_bytes": memory.temp_size_in_bytes, "alias_bytes": memory.alias_size_in_bytes,
          "argument_bytes": memory.argument_size_in_bytes,
          "output_bytes": memory.output_size_in_bytes}


def _key(row) -> tuple:
  return row["model"], row["layout"], row["arm"], row["platform"], row["devices"], row["tokens"]


def _child(args) -> None:
  """Measures every asked case at one device count, appending each row to --out."""
  import jax
  if args.platform == "tpu":
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(f"v5p:{TPU_TOPOLOGIES[args.count]}", "tpu").devices
  else:
    devices = jax.devices()[:args.count]
  done = {_key(json.loads(line)) for line in args.out.read_text().splitlines()
          if line.strip()} if args.out.exists() else set()
  for model in args.model:
    for layout in args.layouts:
      for arm in args.arms:
        if (model, layout, arm, args.platform, args.count, args.tokens) in done:
          continue
        try:
          row = measure(model, layout, arm, devices, args.platform, args.seq, args.tokens)
        except Exception as e:  # a failed compile is a row too: it says what failed
          row = {"model": model, "layout": layout, "arm": arm, "platform": args.platform,
                 "devices": args.count, "seq": args.seq, "tokens": args.tokens,
                 "error": f"{type(e).__name__}: {str(e)[:300]}"}
        with args.out.open("a") as f:
          f.write(json.dumps(row) + "\n")
        print(json.dumps(row)[:300], flush=True)


def extra(row: dict, adamw: dict) -> dict[str, float]:
  """The arm's extra over AdamW's step, in flops, HBM bytes, bytes received (the whole
  step's collectives), and the roofline time they take (`ROOFLINE`), as a fraction
  of AdamW's step at peak: one after another ("seconds", "percent": an upper bound), and
  with the HBM traffic under the flops ("overlapped", "overlapped_percent": the longer of
  the two, as a roofline prices a kernel, the collectives still after them)."""
  received = lambda r: sum(b for _, b in r["collectives"]["step"].values())
  flops, hbm = row["flops"] - adamw["flops"], row["hbm_bytes"] - adamw["hbm_bytes"]
  recv = received(row) - received(adamw)
  compute, memory = max(flops, 0) / ROOFLINE["flops"], max(hbm, 0) / ROOFLINE["hbm"]
  ici = max(recv, 0) / ROOFLINE["ici"]
  seconds, overlapped = compute + memory + ici, max(compute, memory) + ici
  step = adamw["model_flops"] / ROOFLINE["flops"]
  return {"flops": flops, "hbm": hbm, "recv": recv, "seconds": seconds, "step": step,
          "percent": 100 * seconds / step, "overlapped": overlapped,
          "overlapped_percent": 100 * overlapped / step}


def markdown_table(rows: list[dict]) -> str:
  """One line per case and arm; the extra columns against AdamW's row of the same case."""
  short = {"all-to-all": "A2A", "all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS",
           "collective-permute": "CP"}
  count = lambda c: " ".join(f"{n} {short[k]}" for k, (n, _) in sorted(c.items())) or "—"
  tokens = lambda n: f"{n / 2**20:g}M" if n >= 2**20 else str(n)
  good = [r for r in rows if "error" not in r]
  adamw = {_key(r)[:2] + _key(r)[3:]: r for r in good if r["arm"] == "optax.adamw"}
  out = ["| model | layout | chips | tokens | arm | flops/chip | HBM GB | step collectives | "
         "optimizer collectives (async) | received GB | peak GB (of 95) | compile s | "
         "extra: flops, HBM GB, received GB | est. extra ms | % of AdamW step | "
         "% overlapped |",
         "|---|---|--:|--:|---|--:|--:|---|---|--:|--:|--:|---|--:|--:|--:|"]
  order = lambda r: (r["model"], r["layout"], r["platform"], r["devices"], r["tokens"],
                     ARMS.index(r["arm"]))
  for r in sorted(good, key=order):
    c = r["collectives"]
    recv = sum(b for _, b in c["step"].values()) / 1e9
    base = adamw.get(_key(r)[:2] + _key(r)[3:])
    tail = "— | — | — | —"
    if r["platform"] != "tpu":  # the roofline is a v5p chip's
      pass
    elif base is not None and r is not base:
      e = extra(r, base)
      tail = (f"{e['flops']:.2e}, {e['hbm'] / 1e9:.1f}, {e['recv'] / 1e9:.2f} | "
              f"{1e3 * e['seconds']:.1f} | {e['percent']:.2f} | {e['overlapped_percent']:.2f}")
    elif r is base:
      tail = f"step {1e3 * extra(r, r)['step']:.0f} ms at peak | — | — | —"
    out.append(f"| {r['model']} | {r['layout']} | {r['devices']} | {tokens(r['tokens'])} | "
               f"{r['arm']} | "
               f"{r['flops']:.3e} | {r['hbm_bytes'] / 1e9:.1f} | {count(c['step'])} | "
               f"{count(c['optimizer'])} ({c['async']}) | {recv:.2f} | "
               f"{r['peak_bytes'] / 1e9:.1f} | {r['compile_s']:.0f} | {tail} |")
  return "\n".join(out)


def run_steps(cfg, layout: Optional[str], mesh: Any, arm: str, params: Any,
              data: np.ndarray) -> Any:
  """The step run on `data` (steps, batch, length + 1) from `params` (one device when
  `mesh` is None); the params after the last step, on the host."""
  import jax
  s = setup(cfg, layout, mesh, arm, data.shape[1], data.shape[2] - 1, params)
  p, state = s.params, s.state
  for tokens in data:
    if mesh is None:
      p, state, _ = s.step(p, state, tokens[:, :-1], tokens[:, 1:])
    else:
      with jax.set_mesh(mesh):
        p, state, _ = s.step(p, state, tokens[:, :-1], tokens[:, 1:])
  return jax.device_get(p)


def init_params(cfg, batch: int, seq: int, seed: int = 0) -> Any:
  """The model's params, initialized, as float32 numpy arrays (on the host: a run that
  donates its params never deletes these)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from workload.llama import Llama
  tokens = jnp.zeros((batch, seq), jnp.int32)
  return jax.device_get(nn.unbox(Llama(cfg).init(jax.random.key(seed), tokens, tokens))["params"])


def execute(args) -> dict[tuple[str, str], float]:
  """Each layout and arm run for --steps steps on the simulated devices and on one; the
  largest parameter difference of each, printed and returned."""
  import jax
  cfg = dataclasses.replace(model_config(args.model[0]), dtype="float32")
  batch, seq = 8, 16
  params = init_params(cfg, batch, seq)
  data = np.asarray(jax.random.randint(jax.random.key(1), (args.steps, batch, seq + 1), 0,
                                       cfg.vocab))
  diffs = {}
  for arm in args.arms:
    alone = run_steps(cfg, None, None, arm, params, data)
    for layout in args.layouts:
      mesh = make_mesh(jax.devices(), layout, cfg)
      got = run_steps(cfg, layout, mesh, arm, params, data)
      diffs[layout, arm] = max(float(np.max(np.abs(a - b)))
                               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(alone)))
      print(f"{layout:<8} {str(dict(mesh.shape)):<40} {arm:<20} "
            f"max |params - one device's| = {diffs[layout, arm]:.2e}", flush=True)
  return diffs


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", nargs="+", choices=["8b", "moe", "tiny", "tiny-moe"], default=["8b"])
  p.add_argument("--devices", type=int, nargs="+", default=[64, 256])
  p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["fsdp", "fsdp_tp"])
  p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  p.add_argument("--platform", choices=["cpu", "tpu"], default="cpu")
  p.add_argument("--seq", type=int, default=4096, help="sequence length")
  p.add_argument("--tokens", type=int, default=2 ** 20, help="tokens a step")
  p.add_argument("--execute", action="store_true",
                 help="run the step on 8 simulated CPU devices and on one, and compare")
  p.add_argument("--steps", type=int, default=2, help="steps run by --execute")
  p.add_argument("--table", action="store_true",
                 help="print the rows already in --out as a markdown table, compile nothing")
  p.add_argument("--out", type=pathlib.Path, default=RESULTS / "train_step.jsonl")
  p.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # child process
  return p


def main(argv: Optional[Sequence[str]] = None) -> Any:
  args = parser().parse_args(argv)
  if args.count is not None:
    return _child(args)
  from benchmarks.common import header
  print(header("benchmarks.train_step", argv))
  if args.table:
    return print(markdown_table([json.loads(line) for line in args.out.read_text().splitlines()
                                 if line.strip()]))
  if args.execute:
    import jax
    if jax.device_count() < 8:
      parser().error("--execute needs 8 devices: set XLA_FLAGS="
                     "--xla_force_host_platform_device_count=8 before jax is imported.")
    return execute(args)
  if args.platform == "tpu" and (bad := [n for n in args.devices if n not in TPU_TOPOLOGIES]):
    parser().error(f"--devices {bad}: TPU v5p topologies here are {sorted(TPU_TOPOLOGIES)}")
  forwarded = list(sys.argv[1:] if argv is None else argv)
  for n in args.devices:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if args.platform == "tpu":  # compiling offline: other processes may hold libtpu too
      env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if args.platform == "cpu":
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={n}").strip()
    subprocess.run([sys.executable, "-m", "benchmarks.train_step", *forwarded, "--count", str(n)],
                   env=env, check=True)
  return None


if __name__ == "__main__":
  main()
