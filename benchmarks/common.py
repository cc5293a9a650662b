"""Helpers shared by the benchmarks: GPT-2-shaped parameter trees, a donating optimizer
step, interleaved timing and its report (`machine` and `machine_info`, from
`workload.machine`, name the machine beside every number).

Import from the repository root: `from benchmarks import common`.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def load_note(before: float, after: float, cores: int = os.cpu_count() or 1) -> str:
  """The load average around a timed run, and whether the machine was busy: on a busy
  machine, time ratios flatter whichever arm suffers less from contention."""
  busy = max(before, after) >= 0.5 * cores
  verdict = ("BUSY: other jobs ran, so ratios are indicative only" if busy else
             "the machine was otherwise idle")
  return f"load average {before:.2f} before, {after:.2f} after ({verdict})"


def ratio_table(times: dict[str, list[float]], reference: str, unit: float = 1e3,
                unit_name: str = "ms") -> str:
  """Min and median of each arm's times and their ratios to `reference`'s, one row an arm."""
  ref_min, ref_med = min(times[reference]), statistics.median(times[reference])
  rows = [f"| arm | min {unit_name} | median {unit_name} | min / {reference} | "
          f"median / {reference} | N |", "|---|--:|--:|--:|--:|--:|"]
  for name, ts in times.items():
    lo, med = min(ts), statistics.median(ts)
    rows.append(f"| {name} | {lo * unit:.2f} | {med * unit:.2f} | {lo / ref_min:.2f}× | "
                f"{med / ref_med:.2f}× | {len(ts)} |")
  return "\n".join(rows)
