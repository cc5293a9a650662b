"""Full optimizer step: muon_optax.muon against optax.contrib.muon and optax.adamw.

A GPT-2-small-shaped params tree (token/position embeddings 50257×768 / 1024×768; per
layer qkv 768×2304, proj 768×768, fc 768×3072, fc_proj 3072×768 kernels, their biases
and two LayerNorms; a final LayerNorm; tied LM head). Routing is made equal: both Muon
optimizers send exactly the 4 kernels per layer to Muon (optax.contrib.muon through
`muon_weight_dimension_numbers`) and everything else to AdamW. Same Muon settings:
jordan coefficients, 5 steps, beta 0.95, Nesterov, width scaling √max(1, fan_out/fan_in).

One timed step is a jitted `update` + `apply_updates` with params and state donated,
waited on; arms take turns step by step so that load on a shared machine hits all alike.
Prints the median step time, its ratio to optax.contrib.muon, and optimizer-state bytes
per parameter (all parameters, and the Muon kernels alone), with the machine it ran on.

    python -m benchmarks.optimizer_step [--layers 12] [--warmup 1] [--steps 3]

`--layers 2` is the quick variant.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

import muon_optax as mo
from benchmarks.common import machine
from muon_optax._ns_plan import newton_schulz_flops, newton_schulz_plan

D, VOCAB, CTX = 768, 50257, 1024
KERNELS = {"attn/qkv": (D, 3 * D), "attn/proj": (D, D), "mlp/fc": (D, 4 * D),
           "mlp/fc_proj": (4 * D, D)}


def gpt2_params(layers: int, key) -> dict:
  keys = iter(jax.random.split(key, 4 * layers + 2))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape)
  params = {"wte": {"embedding": normal((VOCAB, D))}, "wpe": {"embedding": normal((CTX, D))},
            "ln_f": {"scale": jnp.ones(D), "bias": jnp.zeros(D)}}
  for i in range(layers):
    block = {"ln_1": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
             "ln_2": {"scale": jnp.ones(D), "bias": jnp.zeros(D)}, "attn": {}, "mlp": {}}
    for name, shape in KERNELS.items():
      group, leaf = name.split("/")
      block[group][leaf] = {"kernel": normal(shape), "bias": jnp.zeros(shape[1])}
    params[f"h_{i}"] = block
  return params


def is_kernel(path) -> bool:
  return jax.tree_util.keystr(path).endswith("['kernel']")


def arms(params) -> dict[str, optax.GradientTransformation]:
  lr, adam_lr = 0.02, 3e-4
  dims = jax.tree_util.tree_map_with_path(
      lambda p, _: optax.contrib.MuonDimensionNumbers() if is_kernel(p) else None, params)
  adam = mo.AuxAdam(learning_rate=adam_lr, b1=0.9, b2=0.999, eps=1e-8)
  return {
      "muon_optax.muon (defaults)": mo.muon(lr, adam=adam),
      "muon_optax.muon": mo.muon(lr, ns="jordan", ns_steps=5, adam=adam),
      "muon_optax.muon gram=False": mo.muon(lr, ns="jordan", ns_steps=5, adam=adam, gram=False),
      "optax.contrib.muon": optax.contrib.muon(
          lr, ns_coeffs=mo.PRESETS["jordan"][0][0].tolist(), ns_steps=5, beta=0.95,
          nesterov=True, adam_b1=0.9, adam_b2=0.999, adam_learning_rate=adam_lr,
          muon_weight_dimension_numbers=dims),
      "optax.adamw": optax.adamw(adam_lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
  }


def state_bytes(state) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of an optimizer state."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(state) if hasattr(x, "dtype"))


def num_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def make_step(tx, params):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(jnp.copy, params)  # donated: keep the caller's arrays
  return jax.jit(step, donate_argnums=(0, 1)), [params, tx.init(params)]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--steps", type=int, default=3)
  args = ap.parse_args()

  params = gpt2_params(args.layers, jax.random.key(0))
  leaves, treedef = jax.tree.flatten(params)
  grads = treedef.unflatten([1e-3 * jax.random.normal(k, p.shape) for k, p in
                             zip(jax.random.split(jax.random.key(1), len(leaves)), leaves)])
  kernels = {f"k{i}": x for i, x in enumerate(
      x for p, x in jax.tree_util.tree_leaves_with_path(params) if is_kernel(p))}
  txs = arms(params)

  runs = {name: make_step(tx, params) for name, tx in txs.items()}
  for step, carry in runs.values():
    for _ in range(args.warmup):
      carry[:] = step(*carry, grads)
    jax.block_until_ready(carry)
  times = {name: [] for name in runs}
  for _ in range(args.steps):
    for name, (step, carry) in runs.items():
      t0 = time.perf_counter()
      carry[:] = jax.block_until_ready(step(*carry, grads))
      times[name].append(time.perf_counter() - t0)
  medians = {name: statistics.median(t) for name, t in times.items()}

  # State of the Muon kernels alone: the same optimizers on the kernels-only tree.
  kernel_dims = jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(), kernels)
  kernel_txs = {
      "muon_optax.muon (defaults)": mo.muon(0.02, labels=jax.tree.map(lambda _: "muon", kernels)),
      "muon_optax.muon": mo.muon(0.02, labels=jax.tree.map(lambda _: "muon", kernels)),
      "muon_optax.muon gram=False": mo.muon(0.02, labels=jax.tree.map(lambda _: "muon", kernels)),
      "optax.contrib.muon": optax.contrib.muon(0.02, muon_weight_dimension_numbers=kernel_dims),
      "optax.adamw": optax.adamw(3e-4)}

  n_all, n_muon = num_params(params), num_params(kernels)
  base = medians["optax.contrib.muon"]
  flops = args.layers * sum(newton_schulz_plan(s).flops for s in KERNELS.values())
  flops_std = args.layers * sum(newton_schulz_flops(*s, 5, gram=False) for s in KERNELS.values())
  print(f"machine: {machine()}")
  print(f"GPT-2-small tree, {args.layers} layers: {n_all:,} parameters, {n_muon:,} in "
        f"{4 * args.layers} Muon kernels; Newton–Schulz per step with defaults "
        f"{flops / 1e9:.0f} GFLOP (jordan standard iteration, 5 steps: {flops_std / 1e9:.0f}); "
        f"{args.warmup} warm-up + "
        f"{args.steps} timed steps\n")
  print("| optimizer | median step (s) | vs optax.contrib.muon | state B/param (all) "
        "| state B/param (Muon kernels) |")
  print("|---|--:|--:|--:|--:|")
  for name, t in medians.items():
    all_b = state_bytes(runs[name][1][1]) / n_all
    kernel_b = state_bytes(jax.eval_shape(kernel_txs[name].init, kernels)) / n_muon
    print(f"| {name} | {t:.3f} | {t / base:.2f}× | {all_b:.2f} | {kernel_b:.2f} |")
  polar_errors(grads)


def polar_errors(grads) -> None:
  """‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F of the orthogonalized layer-0 kernel gradients (U Σ Vᵀ the
  float64 SVD), for the defaults and for optax.contrib.muon's iteration."""
  from newton_schulz import optax_orthogonalize
  jordan = jnp.asarray(mo.PRESETS["jordan"].table[0])
  fns = {"muon_optax.muon (defaults)": jax.jit(mo.newton_schulz),
         "muon_optax.muon": jax.jit(lambda g: mo.newton_schulz(g, ns="jordan", steps=5)),
         "optax.contrib.muon": jax.jit(lambda g: optax_orthogonalize(g, jordan, 5))}
  print("\n| Muon kernel (layer 0 gradient) | " + " | ".join(fns) + " |")
  print("|---|" + "--:|" * len(fns))
  for name in KERNELS:
    group, leaf = name.split("/")
    g = grads["h_0"][group][leaf]["kernel"]
    u, _, vt = np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)
    polar = u @ vt
    errs = [np.linalg.norm(np.asarray(f(g), np.float64) - polar) / np.linalg.norm(polar)
            for f in fns.values()]
    print(f"| {name} {g.shape[0]}×{g.shape[1]} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


if __name__ == "__main__":
  main()
