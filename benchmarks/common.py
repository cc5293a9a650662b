"""Helpers shared by the benchmarks: GPT-2-shaped parameter trees and the optimizers
compared on them, Newton–Schulz references (optax.contrib's iteration, the exact polar
factor), a donating optimizer step, interleaved timing and its report with the load on
the machine (`machine` and `machine_info`, from `workload.machine`, name the machine
beside every number).

Import from the repository root: `from benchmarks import common`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from workload.machine import machine, machine_info  # noqa: F401  (re-exported)

# GPT-2 small: width, vocabulary, context, and the four hidden kernels of a block.
D, VOCAB, CTX = 768, 50257, 1024
KERNELS = {"attn/qkv": (D, 3 * D), "attn/proj": (D, D), "mlp/fc": (D, 4 * D),
           "mlp/fc_proj": (4 * D, D)}


def gpt2_tree(layers: int = 12, key: Optional[jax.Array] = None, *, d: int = D,
              vocab: int = VOCAB, ctx: int = CTX, small_leaves: bool = True) -> dict:
  """A GPT-2-small-shaped params tree with a tied LM head.

  `wte` (vocab×d) and `wpe` (ctx×d, left out when ctx=0) embeddings; per layer `h_<i>`
  the kernels of `KERNELS` scaled to width d (attn/qkv d×3d, attn/proj d×d, mlp/fc
  d×4d, mlp/fc_proj 4d×d); with `small_leaves`, their biases, `ln_1`/`ln_2` and a
  final `ln_f` LayerNorm too.

  Args:
    layers: transformer blocks.
    key: random init (normal, std 0.02; LayerNorm scales 1, biases 0); None gives
      `jax.ShapeDtypeStruct` leaves, for measurements read off compiled programs.
  """
  keys = iter(jax.random.split(key, 4 * layers + 2)) if key is not None else None
  kernels = {name: tuple(d * s // D for s in shape) for name, shape in KERNELS.items()}

  def leaf(shape, fill=None):
    if keys is None:
      return jax.ShapeDtypeStruct(shape, jnp.float32)
    if fill is None:
      return 0.02 * jax.random.normal(next(keys), shape)
    return jnp.full(shape, fill, jnp.float32)

  norm = lambda: {"scale": leaf((d,), 1.0), "bias": leaf((d,), 0.0)}
  params = {"wte": {"embedding": leaf((vocab, d))}}
  if ctx:
    params["wpe"] = {"embedding": leaf((ctx, d))}
  if small_leaves:
    params["ln_f"] = norm()
  for i in range(layers):
    block = {"attn": {}, "mlp": {}}
    for name, shape in kernels.items():
      group, sub = name.split("/")
      block[group][sub] = {"kernel": leaf(shape)}
      if small_leaves:
        block[group][sub]["bias"] = leaf((shape[1],), 0.0)
    if small_leaves:
      block["ln_1"], block["ln_2"] = norm(), norm()
    params[f"h_{i}"] = block
  return params


def is_kernel(path: tuple) -> bool:
  """Whether a tree path (as `tree_map_with_path` gives it) ends in a `kernel` leaf."""
  return jax.tree_util.keystr(path).endswith("['kernel']")


def kernels(params: Any) -> dict[str, Any]:
  """The kernels of a tree, by '/'-joined path (without the final "kernel")."""
  return {"/".join(str(getattr(k, "key", k)) for k in path[:-1]): x
          for path, x in jax.tree_util.tree_leaves_with_path(params) if is_kernel(path)}


def kernel_labels(params: Any) -> Any:
  """"muon" for every kernel, "adam" for the rest: the routing every Muon arm is given,
  so that all of them update exactly the same leaves."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "muon" if is_kernel(path) else "adam", params)


def random_like(tree: Any, key: jax.Array, scale: float = 1.0) -> Any:
  """Gaussian arrays (times `scale`) of the tree's shapes: stand-in gradients."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([scale * jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])


def jordan_contrib_muon(params: Any, learning_rate: float, adam_learning_rate: float,
                        **kwargs) -> optax.GradientTransformation:
  """optax.contrib.muon with the jordan coefficients and 5 steps, routed as
  `kernel_labels` (through `muon_weight_dimension_numbers`)."""
  dims = jax.tree.map(lambda label: optax.contrib.MuonDimensionNumbers() if label == "muon"
                      else None, kernel_labels(params))
  return optax.contrib.muon(
      learning_rate, ns_coeffs=tuple(mo.PRESETS["jordan"].table[0]), ns_steps=5, beta=0.95,
      nesterov=True, adam_b1=0.9, adam_b2=0.999, adam_learning_rate=adam_learning_rate,
      muon_weight_dimension_numbers=dims, **kwargs)


# Newton–Schulz settings of the arms that match optax.contrib.muon's iteration.
JORDAN5 = mo.NewtonSchulz("jordan", steps=5)
JORDAN5_STANDARD = mo.NewtonSchulz("jordan", steps=5, gram=False)


def split_qkv(path: str, shape: tuple[int, ...]) -> mo.MatrixView:
  """The default view, with a fused attention qkv kernel (d, 3d) as its 3 blocks: what
  infer_routing finds where the model splits its product into q, k and v."""
  view = mo.default_view(path, shape)
  return view._replace(blocks=3) if "qkv" in path else view


def at_step(tx: optax.GradientTransformation, step: int) -> optax.GradientTransformation:
  """`tx` with its MuonBP step count fixed at `step` when it updates: only that kind of
  step (block or full) is compiled, so each kind's collectives and flops can be read."""

  def fix(state):
    return jax.tree.map(
        lambda x: mo.BlockPeriodicState(np.asarray(step, np.int32))
        if isinstance(x, mo.BlockPeriodicState) else x,
        state, is_leaf=lambda x: isinstance(x, mo.BlockPeriodicState))

  return optax.GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, fix(s), p))


def optimizer_arms(params: Any, learning_rate: float = 0.02, adam_learning_rate: float = 3e-4,
                   names: Optional[Sequence[str]] = None
                   ) -> dict[str, optax.GradientTransformation]:
  """The optimizers the step benchmarks compare, by name: muon_optax's `muon` (defaults;
  jordan at 5 steps, with and without Gram-space) and the rest of its family,
  optax.contrib.muon (jordan, 5 steps) and optax.adamw. Every Muon arm routes as
  `kernel_labels`; every AdamW has b1 0.9, b2 0.999, eps 1e-8 and no decay
  (optax.contrib.muon's is also Nesterov: it shares `nesterov` with its Muon). `names`
  keeps those arms only, in that order."""
  labels = kernel_labels(params)
  adam = mo.AuxAdam(learning_rate=adam_learning_rate, b1=0.9, b2=0.999, eps=1e-8)

  def muon(alias=mo.muon, **options):
    return alias(learning_rate, adam=adam, **{"routing": labels, **options})

  make = {
      "muon_optax.muon (defaults)": muon,
      "muon_optax.muon jordan 5": lambda: muon(ns=JORDAN5),
      "muon_optax.muon jordan 5 gram=False": lambda: muon(ns=JORDAN5_STANDARD),
      "muon_optax.normuon": lambda: muon(mo.normuon),
      "muon_optax.adamuon": lambda: muon(mo.adamuon),
      "muon_optax.muon scale='adaptive'": lambda: muon(scale="adaptive"),
      "muon_optax.muon qkv split in 3": lambda: muon(
          routing=mo.Routing.from_labels(labels, views=split_qkv)),
      "muon_optax.nordion2 (fraction 0.25)": lambda: muon(mo.nordion2),
      "muon_optax.muonbp (8 blocks, period 4)": lambda: muon(
          mo.muonbp, blocks=mo.BlockPeriodic(4, devices=8)),
      "muon_optax.muonh": lambda: muon(mo.muonh),
      "optax.contrib.muon": lambda: jordan_contrib_muon(params, learning_rate,
                                                        adam_learning_rate),
      "optax.adamw": lambda: optax.adamw(adam_learning_rate, b1=0.9, b2=0.999, eps=1e-8,
                                         weight_decay=0.0),
  }
  unknown = set(names or ()) - set(make)
  if unknown:
    raise ValueError(f"unknown arms {sorted(unknown)}; choose from {list(make)}")
  return {name: make[name]() for name in (names or make)}


def optax_orthogonalize(x: jax.Array, coeffs: Any, steps: int = 5) -> jax.Array:
  """optax.contrib.muon's Newton–Schulz on x (..., m, n), through its public
  `scale_by_muon` with no momentum (beta 0: the momentum is the gradient, exactly); a
  leading batch axis is a stack of matrices."""
  dims = None if x.ndim == 2 else optax.contrib.MuonDimensionNumbers(
      reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)
  tx = optax.contrib.scale_by_muon(jnp.asarray(coeffs), steps, beta=0.0, nesterov=False,
                                   weight_dimension_numbers=dims)
  return tx.update(x, tx.init(x))[0]


def newton_schulz_flops(m: int, n: int, ns: mo.NewtonSchulz) -> int:
  """Matmul flops of `mo.newton_schulz` with settings `ns` on one m×n matrix, as
  `mo.newton_schulz_plan` counts them."""
  return mo.newton_schulz_plan((m, n), ns).flops


def parse_shapes(spec: str, scale: float = 1.0) -> list[tuple[int, ...]]:
  """"768x768,12x768x768" -> [(768, 768), (12, 768, 768)]: leading numbers are a stack;
  `scale` multiplies the matrix dimensions (not the stack)."""
  shapes = []
  for item in spec.split(","):
    *batch, m, n = map(int, item.lower().split("x"))
    shapes.append((*batch, *(max(1, int(round(k * scale))) for k in (m, n))))
  return shapes


def with_spectrum(shape: tuple[int, int], low: float, seed: int = 0) -> jax.Array:
  """A float32 m×n matrix with singular values log-spaced from 1 down to `low`."""
  rng = np.random.default_rng(seed)
  m, n = shape
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return jnp.asarray((u * np.logspace(0, np.log10(low), k)) @ v.T, jnp.float32)


def polar_factor(x: Any) -> np.ndarray:
  """U Vᵀ of each matrix of x (..., m, n), from its float64 SVD U Σ Vᵀ."""
  u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  return u @ vt


def polar_error(out: Any, polar: np.ndarray) -> float:
  """‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F over the whole stack."""
  o = np.asarray(out, np.float64).reshape(polar.shape)
  return float(np.linalg.norm(o - polar) / np.linalg.norm(polar))


def cost_analysis(compiled: Any) -> dict[str, Any]:
  """XLA's cost analysis of a compiled program (flops, "bytes accessed"), one dict
  whether jax returns it alone or as a one-element list."""
  analysis = compiled.cost_analysis()
  return analysis[0] if isinstance(analysis, (list, tuple)) else analysis


def v5p_chip() -> Any:
  """One chip of a v5p topology, for the offline TPU compiler (libtpu; no TPU needed)."""
  from jax.experimental import topologies
  return topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[0]


def traced_for(backend: str, fn: Callable, *specs: Any) -> Any:
  """`jax.jit(fn)` traced for `specs` as on `backend`: while tracing, jax's default
  backend reads `backend`, so that what the library picks per platform at trace time
  (the block rows of symmetric products) is the target's when a program is compiled
  here for another platform (the offline TPU compiler). Lower and compile the result."""
  with mock.patch.object(jax, "default_backend", lambda: backend):
    return jax.jit(fn).trace(*specs)


def header(module: str, argv: Optional[Sequence[str]] = None) -> str:
  """The command that reproduces a report (`argv` None: this process's arguments) and
  the machine it ran on: the first two lines of every benchmark's output."""
  args = sys.argv[1:] if argv is None else list(argv)
  return f"# python -m {module} {' '.join(args)}".rstrip() + f"\nmachine: {machine()}"


def num_params(tree: Any) -> int:
  """Scalars in a tree of arrays or ShapeDtypeStructs."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def tree_bytes(tree: Any) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf, e.g. of an optimizer state."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def commit(tree: Any) -> Any:
  """Commits every array to the default device. jit specializes on committed vs not, so
  next to committed host-memory (offloaded) state, the uncommitted arrays of a fresh
  init would make the second step compile again."""
  return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, jax.devices()[0]), tree)


def make_step(tx: optax.GradientTransformation, params: Any) -> tuple[Callable, list]:
  """A jitted, donating `update` + `apply_updates`, and its own [params, state] carry."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(jnp.copy, params)  # donated: keep the caller's arrays
  return jax.jit(step, donate_argnums=(0, 1)), [params, tx.init(params)]


def time_interleaved(calls: dict[str, Callable[[], Any]], reps: int, warmup: int = 1
                     ) -> dict[str, list[float]]:
  """Seconds per call of each zero-argument function, each result waited on.

  After `warmup` calls each (compilation), the functions take turns call by call, so a
  load change on a shared machine hits them all alike rather than whichever ran then.
  """
  for fn in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times = {name: [] for name in calls}
  for _ in range(reps):
    for name, fn in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  return times


def time_steps(arms: dict[str, optax.GradientTransformation], params: Any, grads: Any,
               warmup: int, steps: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
  """Seconds per optimizer step of each arm (`make_step`, interleaved), and each arm's
  final optimizer state."""
  runs = {name: make_step(tx, params) for name, tx in arms.items()}

  def call(step, carry):
    def fn():
      carry[:] = step(*carry, grads)
      return carry
    return fn

  times = time_interleaved({name: call(*run) for name, run in runs.items()}, steps, warmup)
  return times, {name: carry[1] for name, (_, carry) in runs.items()}


def load_average() -> float:
  """The 1-minute load average (0 where the platform has none)."""
  return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


# Other processes using this share of all CPUs during a timed run make it "busy".
BUSY_SHARE = 0.1
# CPU times come in clock ticks (10 ms): shorter runs cannot be measured this way.
MIN_WATCH_SECONDS = 1.0


def _cpu_times() -> tuple[float, Optional[float], float, int]:
  """(wall clock, busy CPU seconds of the whole machine or None, of this process, CPUs)."""
  own = sum(os.times()[:2])
  try:
    with open("/proc/stat") as f:
      lines = f.read().splitlines()
  except OSError:
    return time.monotonic(), None, own, 0
  # user nice system idle iowait irq softirq steal, in clock ticks (guest time is in user).
  ticks = [int(v) for v in lines[0].split()[1:9]]
  busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
  cpus = sum(line[:3] == "cpu" and line[3:4].isdigit() for line in lines)
  return time.monotonic(), busy, own, cpus


class LoadWatch:
  """The load on the machine around a timed run: `with LoadWatch() as load: ...`, then
  `load.note()`.

  The 1-minute load average lags, and after a run it counts the run itself; so where
  /proc/stat exists, the CPU time other processes used while the run ran, as a share
  of all CPUs (`others`), says directly whether anything competed with the timed calls
  (None for runs under `MIN_WATCH_SECONDS`).
  """

  before: float = 0.0
  after: float = 0.0
  others: Optional[float] = None

  def __enter__(self) -> LoadWatch:
    self.before, self._start = load_average(), _cpu_times()
    return self

  def __exit__(self, *exc) -> None:
    self.after = load_average()
    (t0, busy0, own0, _), (t1, busy1, own1, cpus) = self._start, _cpu_times()
    if busy0 is not None and t1 - t0 >= MIN_WATCH_SECONDS and cpus:
      others = ((busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * cpus)
      self.others = min(1.0, max(0.0, others))

  def note(self) -> str:
    return load_note(self.before, self.after, others=self.others)


def load_note(before: float, after: float, cores: int = os.cpu_count() or 1,
              others: Optional[float] = None) -> str:
  """The load around a timed run and whether the machine was busy: on a busy machine,
  time ratios flatter whichever arm suffers less from contention. `others`, the share
  of all CPUs other processes used (`LoadWatch`), decides where known; otherwise a load
  average of half the cores or more does."""
  busy = others >= BUSY_SHARE if others is not None else max(before, after) >= 0.5 * cores
  verdict = ("BUSY: other jobs ran, so times and ratios are indicative only" if busy else
             "the machine was otherwise idle")
  used = "" if others is None else f"; other processes used {others:.0%} of the CPUs"
  return f"load average {before:.2f} before, {after:.2f} after{used} ({verdict})"


def min_median(times: Sequence[float]) -> tuple[float, float]:
  """The best case and the typical one of repeated timings."""
  return min(times), statistics.median(times)


def ratio_table(times: dict[str, list[float]], reference: str, unit: float = 1e3,
                unit_name: str = "ms", extra: Optional[dict[str, dict[str, str]]] = None) -> str:
  """Min and median of each arm's times and their ratios to `reference`'s, one row an arm;
  `extra` adds columns, {header: {arm: text}}."""
  extra = extra or {}
  ref_min, ref_med = min_median(times[reference])
  header = (f"| arm | min {unit_name} | median {unit_name} | min / {reference} "
            f"| median / {reference} | N |")
  rows = [header + "".join(f" {h} |" for h in extra),
          "|---|--:|--:|--:|--:|--:|" + "--:|" * len(extra)]
  for name, ts in times.items():
    lo, med = min_median(ts)
    rows.append(f"| {name} | {lo * unit:.2f} | {med * unit:.2f} | {lo / ref_min:.2f}× | "
                f"{med / ref_med:.2f}× | {len(ts)} |" +
                "".join(f" {col.get(name, '')} |" for col in extra.values()))
  return "\n".join(rows)

# The layouts users train in, on 8 simulated devices: FSDP, ZeRO-1, Megatron-style tensor
# parallelism alone and with FSDP, data × fsdp × tensor, and MoE experts on an expert axis
# with FSDP (EP). Measured by benchmarks/distributed.py, tested by tests/test_param_layout.py.
LAYOUTS = ("fsdp", "zero1", "tp", "fsdp_tp", "3d", "ep")
# Megatron-style tensor parallelism: column-parallel kernels split their outputs over the
# model axis, row-parallel ones (the projections back to the residual) their inputs.
COLUMN_PARALLEL = ("qkv", "c_attn", "/fc/", "c_fc")


def layout_mesh(kind: str, types=AxisType.Auto) -> Mesh:
  """The mesh of layout `kind` (`LAYOUTS`) on the first devices."""
  shape, names = {"fsdp": ((8,), ("data",)), "zero1": ((8,), ("data",)),
                  "tp": ((4, 2), ("data", "model")), "fsdp_tp": ((4, 2), ("data", "model")),
                  "3d": ((2, 2, 2), ("data", "fsdp", "tensor")),
                  "ep": ((2, 4), ("data", "expert"))}[kind]
  return jax.make_mesh(shape, names, axis_types=(types,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])


def layout_data_axis(kind: str):
  """The state's data-parallel axes in layout `kind`."""
  return ("data", "fsdp") if kind == "3d" else "data"


def _megatron(path: str, ndim: int, model: str, fsdp) -> P:
  """A 2-D kernel's spec: `model` on its outputs (column-parallel) or inputs (row-
  parallel, and the vocabulary of the embedding), `fsdp` (or None) on the other axis."""
  if ndim != 2:
    return P()
  if any(name in f"/{path}/" for name in COLUMN_PARALLEL):
    return P(fsdp, model)
  return P(model, fsdp)


def layout_specs(kind: str, params: Any, mesh: Mesh) -> Any:
  """The PartitionSpec of every parameter in layout `kind`."""
  def spec(path, x):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if kind == "fsdp":
      return mo.fsdp_shardings({"x": x}, mesh)["x"].spec
    if kind == "zero1":
      return P()
    if kind in ("tp", "fsdp_tp"):
      return _megatron(name, x.ndim, "model", "data" if kind == "fsdp_tp" else None)
    if kind == "3d":
      return _megatron(name, x.ndim, "tensor", "fsdp")
    # EP: each expert whole on the device of its (expert, data) pair; the rest FSDP.
    if "experts" in name:
      return P(("expert", "data"))
    return mo.fsdp_shardings({"x": x}, mesh)["x"].spec
  return jax.tree_util.tree_map_with_path(spec, params)


def layout_shardings(kind: str, params: Any, mesh: Mesh) -> Any:
  """The params' shardings in layout `kind`: what a trainer passes to `jax.jit`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), layout_specs(kind, params, mesh))
