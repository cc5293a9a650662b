"""Newton–Schulz accuracy per operand precision: the table that picks the platform defaults.

For every precision (float32, bfloat16, float16 operands; "fp8": the first half of the
steps with float8 e4m3 operands, the rest bfloat16), variant (standard, Gram-space) and
preset, on four classes of inputs (`--count` matrices each):
- gaussian: N(0, 1) entries;
- heavy: Student-t (3 degrees of freedom) entries times a column scale log-spaced from
  1 to 1e-3 (heavy tails, decaying spectrum);
- lowrank: a rank-4 product plus 1% Gaussian noise;
- gpt: gradients and their Nesterov momenta (β = 0.95) of the workload GPT's hidden
  matrices (2×64), captured while `mo.muon` trains it, regenerated deterministically;
prints the polar error ‖NS(G) − U Vᵀ‖_F / ‖U Vᵀ‖_F against a float64 SVD (mean and
max over the matrices) and the smallest and largest singular value after the iteration,
and how many matrices diverged (overflowed), whose figures are left out of the others.
`--mode exchange`: the same figures for each preset's TPU settings on the matrices moved
as a mesh's exchange may move them (`EXCHANGES`, `MeshLayout.exchange_dtype`): whole
both ways; the results back in bfloat16 (the default where the operands are 16-bit);
both ways in bfloat16.
`--mode flops`: XLA's compiled flops of each setting on one matrix of Llama-3-8B's
shapes, on this CPU and from the TPU compiler (v5p, offline), the bfloat16 passes
per flop as the planner prices them, and the v5p program's HBM bytes accessed.
`--mode time`: min and median seconds of N interleaved calls on a stack of `--count`
matrices, on jax's default backend (a GPU where there is one).
`--mode convergence`: the workload GPT's final validation loss (2×64, its defaults) with
mo.muon and each arm's Newton–Schulz settings (`CONVERGENCE_ARMS`), per seed; the
"mesh8" arms train on 8 simulated devices, the matrices exchanged as each says.
Rows are appended to `--out` (JSON lines) and skipped when already there (resumable);
the table printed is made from the file.

    python -m benchmarks.newton_schulz_precision --mode accuracy --count 1000
    python -m benchmarks.newton_schulz_precision --mode exchange --presets turbo \
        --out benchmarks/results/newton_schulz_exchange.jsonl
    python -m benchmarks.newton_schulz_precision --mode flops
    python -m benchmarks.newton_schulz_precision --mode time --count 64
    python -m benchmarks.newton_schulz_precision --mode convergence --seeds 0,1,2 \
        [--arms bfloat16_standard,bfloat16_Gram]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m \
        benchmarks.newton_schulz_precision --mode convergence \
        --arms mesh8_default,mesh8_float32,mesh8_bfloat16
    python -m benchmarks.newton_schulz_precision --count 3 --shapes 16x48 \
        --presets turbo,cubic5 --classes gaussian,heavy --llama 16x48 --reps 2 \
        --out DIR/p.jsonl                                     # smallest (any --mode)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
from benchmarks import common
from benchmarks.common import LoadWatch, header, min_median, parse_shapes, time_interleaved

PRECISIONS = ("float32", "bfloat16", "float16", "fp8")
VARIANTS = ("standard", "gram")
CLASSES = ("gaussian", "heavy", "lowrank", "gpt")
LLAMA = "4096x4096,4096x1024,4096x14336,14336x4096"
RESULTS = pathlib.Path(__file__).parent / "results"


def settings(preset: str, precision: str, variant: str) -> mo.NewtonSchulz | None:
  """The setting of one cell (None: fp8 steps have no Gram-space form)."""
  if precision == "fp8":
    if variant == "gram":
      return None
    return mo.NewtonSchulz(preset, gram=False, compute_dtype="bfloat16",
                           fp8_steps=mo.NewtonSchulz(preset).num_steps() // 2)
  return mo.NewtonSchulz(preset, gram=variant == "gram", compute_dtype=precision)


def synthetic(kind: str, shape: tuple[int, int], count: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  m, n = shape
  if kind == "gaussian":
    return rng.standard_normal((count, m, n))
  if kind == "heavy":
    return rng.standard_t(3, (count, m, n)) * np.geomspace(1, 1e-3, n)
  low = rng.standard_normal((count, m, 4)) @ rng.standard_normal((count, 4, n))
  return low + 1e-2 * np.sqrt(4.0) * rng.standard_normal((count, m, n))


def gpt_matrices(count: int, seed: int = 0) -> dict[tuple[int, int], np.ndarray]:
  """Gradients and Nesterov momenta of the workload GPT's (2×64) hidden matrices while
  mo.muon trains it, by wide shape, `count` of each (same seed: same matrices)."""
  from flax import nnx

  from workload import stdlib_text
  from workload.config import TrainConfig
  from workload.gpt import loss_fn
  from workload.train import setup

  cfg = TrainConfig(seed=seed, steps=10_000)
  train, val = stdlib_text.load_splits(max_bytes=4_000_000)
  train_data, run = train.data, setup(cfg, val.data, log=lambda _: None)
  grad_fn = nnx.jit(nnx.grad(loss_fn))
  data = stdlib_text.batches(train_data, cfg.batch, cfg.seq_len, cfg.seed)
  momenta, found = {}, {}
  while not found or min(len(v) for v in found.values()) < count:
    batch = next(data)
    grads = nnx.to_flat_state(grad_fn(run.model, batch))
    for path, g in grads:
      name = "/".join(map(str, path))
      g = np.asarray(g.get_value() if hasattr(g, "get_value") else g, np.float64)
      if g.ndim != 2 or min(g.shape) < 16 or "embed" in name or "head" in name:
        continue
      m = momenta[name] = 0.95 * momenta.get(name, 0) + 0.05 * g
      for x in (g, 0.05 * g + 0.95 * m):
        x = x.T if x.shape[0] > x.shape[1] else x
        found.setdefault(x.shape, []).append(x)
    run.step_fn(batch)
  return {shape: np.stack(xs[:count]) for shape, xs in found.items()}


def polar_of(x: np.ndarray) -> np.ndarray:
  """U Vᵀ of each matrix, from its float64 SVD."""
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  return u @ vt


def measure(x: np.ndarray, polar: np.ndarray, ns: mo.NewtonSchulz,
            wire: Any = jnp.float32, back: Any = None) -> dict[str, float]:
  """The polar error and singular values of `ns` on `x`, handed the matrices in `wire`
  and its results rounded to `back` (as a mesh's exchange moves them: bfloat16 hands
  over the result in it too)."""
  out = jax.jit(lambda a: mo.newton_schulz(a, ns))(jnp.asarray(x, wire))
  out = np.asarray(out if back is None else out.astype(back), np.float64)
  # A diverged iteration (fp8 on a steep schedule) overflows: it is counted, and the
  # figures are those of the others.
  finite = np.all(np.isfinite(out), axis=(-2, -1))
  out, polar = out[finite], polar[finite]
  if not len(out):
    return {"diverged": int(finite.size), "err_mean": float("inf"), "err_max": float("inf"),
            "sigma_min": float("nan"), "sigma_max": float("inf")}
  err = np.linalg.norm(out - polar, axis=(-2, -1)) / np.linalg.norm(polar, axis=(-2, -1))
  wide = out if out.shape[-2] <= out.shape[-1] else np.swapaxes(out, -1, -2)
  sigma = np.sqrt(np.clip(np.linalg.eigvalsh(wide @ np.swapaxes(wide, -1, -2)), 0, None))
  return {"diverged": int(finite.size - finite.sum()), "err_mean": float(err.mean()),
          "err_max": float(err.max()), "sigma_min": float(sigma.min()),
          "sigma_max": float(sigma.max())}


def tpu_cost(ns: mo.NewtonSchulz, shape: tuple[int, int]) -> dict[str, float]:
  """The v5p compiler's flops and HBM bytes accessed of one matrix's iteration."""
  spec = jax.ShapeDtypeStruct(shape, jnp.float32,
                              sharding=jax.sharding.SingleDeviceSharding(common.v5p_chip()))
  ns = ns.on("tpu")
  analysis = common.cost_analysis(common.traced_for(
      "tpu", lambda a: mo.newton_schulz(a, ns), spec).lower().compile())
  return {"flops": float(analysis["flops"]), "bytes": float(analysis["bytes accessed"])}


def compiled_flops(lowered) -> float:
  return float(common.cost_analysis(lowered.compile())["flops"])


def cells(args) -> list[tuple[str, str, str]]:
  return [(p, q, v) for p in args.presets for q in args.precisions for v in VARIANTS
          if settings(p, q, v) is not None]


def done_keys(path: pathlib.Path) -> set[str]:
  if not path.exists():
    return set()
  return {json.loads(line)["key"] for line in path.read_text().splitlines() if line.strip()}


def append(path: pathlib.Path, row: dict[str, Any]) -> None:
  with path.open("a") as f:
    f.write(json.dumps(row) + "\n")


def inputs_of(args, kind: str) -> dict[tuple[int, int], np.ndarray]:
  """The class's matrices by shape: the listed shapes (for gpt: those among the model's,
  or all of them)."""
  if kind == "gpt":
    found = gpt_matrices(args.count)
    return {s: x for s, x in found.items() if s in args.shapes} or found
  return {s: synthetic(kind, s, args.count, seed=i) for i, s in enumerate(args.shapes)}


def run_accuracy(args, out: pathlib.Path, done: set[str]) -> None:
  for kind in args.classes:
    for shape, x in inputs_of(args, kind).items():
      polar = polar_of(x)
      for preset, precision, variant in cells(args):
        key = f"accuracy {kind} {shape[0]}x{shape[1]} {preset} {precision} {variant}"
        if key not in done:
          append(out, {"key": key, "class": kind, "shape": list(shape), "count": len(x),
                       **measure(x, polar, settings(preset, precision, variant))})


# How a mesh's exchange may move the matrices and their results (`MeshLayout.exchange_dtype`):
# (the matrices' dtype, the results' rounding, None: none).
EXCHANGES = {"float32": (jnp.float32, None),  # exchange_dtype="float32"
             "back-bfloat16": (jnp.float32, jnp.bfloat16),  # the default, 16-bit operands
             "bfloat16": (jnp.bfloat16, None)}  # exchange_dtype="bfloat16": both ways


def run_exchange(args, out: pathlib.Path, done: set[str]) -> None:
  """Each preset's TPU settings on the matrices moved as each of `EXCHANGES` moves them."""
  for kind in args.classes:
    for shape, x in inputs_of(args, kind).items():
      polar = polar_of(x)
      for preset in args.presets:
        for wire, (there, back) in EXCHANGES.items():
          key = f"exchange {kind} {shape[0]}x{shape[1]} {preset} {wire}"
          if key not in done:
            append(out, {"key": key, "class": kind, "shape": list(shape), "count": len(x),
                         **measure(x, polar, mo.NewtonSchulz(preset).on("tpu"), there, back)})


def bf16_passes(ns: mo.NewtonSchulz) -> int:
  """bfloat16 passes a TPU runs per matmul flop of `ns` there, as the planner prices them
  (its split cost): float32 operands at HIGHEST precision 6, at HIGH 3, anything else 1
  (float16 is not native on a TPU, so it is no saving there: it runs as bfloat16
  passes too)."""
  ns = ns.on("tpu")
  if ns.dtype("tpu").itemsize < 4:
    return 1
  return {"HIGHEST": 6, "HIGH": 3}.get(ns.matmul_precision("tpu").name, 1)


def run_flops(args, out: pathlib.Path, done: set[str]) -> None:
  for shape in parse_shapes(args.llama):
    for preset, precision, variant in cells(args):
      key = f"flops {shape[0]}x{shape[1]} {preset} {precision} {variant}"
      if key in done:
        continue
      ns = settings(preset, precision, variant)
      cpu = compiled_flops(jax.jit(lambda a, ns=ns: mo.newton_schulz(a, ns)).lower(
          jax.ShapeDtypeStruct(shape, jnp.float32)))
      try:
        tpu = tpu_cost(ns, shape)
      except (ImportError, RuntimeError) as e:  # no libtpu here
        tpu = {"flops": None, "bytes": None}
        print(f"no TPU compiler: {e}")
      plan = mo.newton_schulz_plan(shape, ns.on("tpu"), backend="tpu")
      append(out, {"key": key, "shape": list(shape), "cpu_flops": cpu, "tpu_flops": tpu["flops"],
                   "tpu_bytes": tpu["bytes"],
                   "variant_run": plan.variant, "passes": bf16_passes(ns)})


def run_time(args, out: pathlib.Path, done: set[str]) -> None:
  backend = jax.default_backend()
  for shape in args.shapes:
    x = jnp.asarray(synthetic("gaussian", shape, args.count, 0), jnp.float32)
    calls = {}
    for preset, precision, variant in cells(args):
      key = f"time {backend} {shape[0]}x{shape[1]} {args.count} {preset} {precision} {variant}"
      if key not in done:
        ns = settings(preset, precision, variant)
        fn = jax.jit(lambda a, ns=ns: mo.newton_schulz(a, ns))
        calls[key] = lambda fn=fn: fn(x)
    if not calls:
      continue
    with LoadWatch() as load:
      times = time_interleaved(calls, args.reps)
    for key, t in times.items():
      best, median = min_median(t)
      append(out, {"key": key, "backend": backend, "shape": list(shape), "count": args.count,
                   "min_s": best, "median_s": median, "load": load.note()})


# The convergence check a new platform default needs against today's, on the workload GPT.
CONVERGENCE_ARMS = {
    "bfloat16 standard (the GPU and TPU default before Gram space)":
        dict(compute_dtype="bfloat16", gram=False),
    "float16 Gram (the GPU candidate)": dict(compute_dtype="float16"),
    "bfloat16 Gram (the GPU and TPU default: Gram space on wide matrices)":
        dict(compute_dtype="bfloat16"),
    # On 8 simulated devices (ZeRO-1), bfloat16 operands, the results exchanged in
    # bfloat16 (the default) or float32, or both ways in bfloat16: needs
    # XLA_FLAGS=--xla_force_host_platform_device_count=8.
    "mesh8 default (results back in bfloat16)": dict(compute_dtype="bfloat16", devices=8),
    "mesh8 float32 (exchange_dtype='float32')":
        dict(compute_dtype="bfloat16", devices=8, exchange_dtype="float32"),
    "mesh8 bfloat16 (exchange_dtype='bfloat16': both ways)":
        dict(compute_dtype="bfloat16", devices=8, exchange_dtype="bfloat16"),
}


def run_convergence(args, out: pathlib.Path, done: set[str]) -> None:
  """Final validation loss of mo.muon on the workload GPT (2×64, its defaults) with
  each arm's Newton–Schulz settings, per seed."""
  from workload import stdlib_text, train
  from workload.config import TrainConfig

  train_split, val_split = stdlib_text.load_splits()
  muon = train.FAMILY["muon"]
  try:
    for seed in args.seeds:
      for arm, options in CONVERGENCE_ARMS.items():
        name = arm.split(" (")[0].replace(" ", "_")
        key = f"convergence {name} seed {seed}"
        if key in done or (args.arms and name not in args.arms):
          continue
        options = dict(options)
        devices, wire = options.pop("devices", 1), options.pop("exchange_dtype", None)
        if jax.device_count() < devices:
          raise SystemExit(f"arm {arm!r} needs {devices} devices: set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={devices}.")
        ns = mo.NewtonSchulz(**options)

        def muon_with(*a, ns_=ns, wire_=wire, mesh=None, **k):
          if mesh is not None and wire_ is not None:
            mesh = dataclasses.replace(mesh, exchange_dtype=wire_)
          return mo.muon(*a, **{**k, "ns": ns_, "mesh": mesh})
        train.FAMILY["muon"] = (muon_with, {})
        record = train.train(TrainConfig(seed=seed, devices=devices), train_split.data,
                             val_split.data, progress=False, log=lambda _: None)
        append(out, {"key": key, "arm": arm, "seed": seed,
                     "val_loss": record["final_val_loss"], "seconds": record["time_s"]})
  finally:
    train.FAMILY["muon"] = muon


def table(rows: list[dict[str, Any]]) -> str:
  lines = []
  wired = [r for r in rows if r["key"].startswith("exchange")]
  if wired:
    lines += ["| class | shape | preset (TPU settings) | exchanged (`EXCHANGES`) | n | "
              "polar err mean | max | σ min | σ max |", "|---" * 9 + "|"]
    order = lambda r: (*r["key"].split()[1:4], list(EXCHANGES).index(r["key"].split()[4]))
    for r in sorted(wired, key=order):
      _, kind, shape, preset, wire = r["key"].split()
      lines.append(f"| {kind} | {shape} | {preset} | {wire} | {r['count']} | "
                   f"{r['err_mean']:.5f} | {r['err_max']:.5f} | {r['sigma_min']:.3f} | "
                   f"{r['sigma_max']:.3f} |")
    lines.append("")
  acc = [r for r in rows if r["key"].startswith("accuracy")]
  if acc:
    lines += ["| class | shape | preset | precision | variant | n | polar err mean | max | "
              "σ min | σ max |", "|---" * 10 + "|"]
    for r in acc:
      _, kind, shape, preset, precision, variant = r["key"].split()
      flag = " ⚠" if r["sigma_max"] > 1.3 or r.get("diverged") else ""
      if r.get("diverged"):
        flag += f" ({r['diverged']} diverged)"
      lines.append(f"| {kind} | {shape} | {preset} | {precision} | {variant} | {r['count']} | "
                   f"{r['err_mean']:.4f} | {r['err_max']:.4f} | {r['sigma_min']:.3f} | "
                   f"{r['sigma_max']:.3f}{flag} |")
  flops = [r for r in rows if r["key"].startswith("flops")]
  if flops:
    lines += ["", "| shape | preset | precision | variant | CPU flops | TPU v5p flops | "
              "passes | TPU 16-bit passes | TPU v5p GB accessed |", "|---" * 9 + "|"]
    for r in flops:
      _, shape, preset, precision, variant = r["key"].split()
      tpu, hbm = r["tpu_flops"], r.get("tpu_bytes")  # rows before the bytes: "—"
      tpu_text, passes_text = (("—", "—") if tpu is None else
                               (f"{tpu:.3e}", f"{tpu * r['passes']:.3e}"))
      lines.append(f"| {shape} | {preset} | {precision} | {variant} ({r['variant_run']}) | "
                   f"{r['cpu_flops']:.3e} | {tpu_text} | {r['passes']} | {passes_text} | "
                   f"{'—' if hbm is None else f'{hbm / 1e9:.2f}'} |")
  timed = [r for r in rows if r["key"].startswith("time")]
  if timed:
    lines += ["", "| backend | shape × count | preset | precision | variant | min ms | "
              "median ms |", "|---" * 7 + "|"]
    for r in timed:
      _, backend, shape, count, preset, precision, variant = r["key"].split()
      lines.append(f"| {backend} | {shape} × {count} | {preset} | {precision} | {variant} | "
                   f"{1e3 * r['min_s']:.2f} | {1e3 * r['median_s']:.2f} |")
    lines.append(f"\n{timed[-1]['load']}")
  runs = [r for r in rows if r["key"].startswith("convergence")]
  if runs:
    lines += ["", "| Newton–Schulz | seed | final val loss |", "|---|---|---|"]
    lines += [f"| {r['arm']} | {r['seed']} | {r['val_loss']:.4f} |" for r in runs]
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--mode", choices=("accuracy", "exchange", "flops", "time", "convergence"),
                  default="accuracy")
  ap.add_argument("--seeds", default="0,1,2", help="seeds of the convergence mode")
  names = ", ".join(a.split(" (")[0].replace(" ", "_") for a in CONVERGENCE_ARMS)
  ap.add_argument("--arms", default="",
                  help=f"the convergence mode's arms, by first words (default: all): {names}")
  ap.add_argument("--count", type=int, default=1000, help="matrices per class and shape")
  ap.add_argument("--shapes", default="64x256,128x128", help="synthetic and timed shapes")
  ap.add_argument("--llama", default=LLAMA, help="shapes of the flops mode")
  ap.add_argument("--presets", default=",".join(mo.PRESETS))
  ap.add_argument("--precisions", default=",".join(PRECISIONS))
  ap.add_argument("--classes", default=",".join(CLASSES))
  ap.add_argument("--reps", type=int, default=5, help="timed calls per arm (N)")
  ap.add_argument("--out", default=str(RESULTS / "newton_schulz_precision.jsonl"))
  return ap


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  args.shapes = parse_shapes(args.shapes)
  for name in ("presets", "precisions", "classes"):
    setattr(args, name, getattr(args, name).split(","))
  args.seeds = [int(s) for s in args.seeds.split(",")]
  args.arms = [a for a in args.arms.split(",") if a]
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  {"accuracy": run_accuracy, "exchange": run_exchange, "flops": run_flops, "time": run_time,
   "convergence": run_convergence}[args.mode](
      args, out, done_keys(out))
  print(header("benchmarks.newton_schulz_precision", argv))
  print(table([json.loads(line) for line in out.read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
  main()
