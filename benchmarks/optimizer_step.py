"""Full optimizer step: muon_optax's Muon family against optax.contrib.muon and optax.adamw.

A GPT-2-small-shaped params tree (`common.gpt2_tree`: token/position embeddings
50257×768 / 1024×768; per layer qkv 768×2304, proj 768×768, fc 768×3072, fc_proj
3072×768 kernels, their biases and two LayerNorms; a final LayerNorm; tied LM head), at
2 and 12 layers. The arms (`common.optimizer_arms`): muon_optax's `muon` with defaults,
with jordan at 5 steps (Gram-space where it picks it, and standard only), `normuon`,
`adamuon` and `muon(scale="adaptive")`; the frontier: `muon` with the qkv kernel split in
its 3 blocks, `nordion2` (fraction 0.25), `muonbp` (the blocks of 8 devices, period 4: its
steps average 3 block steps and 1 full one) and `muonh`; optax.contrib.muon (jordan, 5
steps); optax.adamw.
Routing is made equal: every Muon arm sends exactly the 4 kernels per layer to Muon
(optax.contrib.muon through `muon_weight_dimension_numbers`) and everything else to the
same AdamW; beta 0.95, Nesterov.

One timed step is a jitted `update` + `apply_updates` with params and state donated,
waited on; the arms take turns step by step (`common.time_steps`), so that load on a
shared machine hits all alike. Prints, per layer count, the min and median step time of
N steps and their ratios to optax.contrib.muon, the load while they ran (and whether
the machine was busy), each arm's update flops as XLA counts them (deterministic; MuonBP's
update holds both kinds of step), the optimizer-state bytes per parameter (all parameters, and the
Muon kernels alone); then the polar error of each arm's Newton–Schulz on the layer-0
kernel gradients.

    python -m benchmarks.optimizer_step [--layers 2 12] [--warmup 1] [--steps 5]
    python -m benchmarks.optimizer_step --layers 1 --d 32 --vocab 64 --ctx 8 --steps 2
    python -m benchmarks.optimizer_step --layers 2 12 --steps 9 --arms "muon_optax.muon (defaults)"

The second line is the smallest run (a 32-wide tree): it checks that every arm runs. The
third times the chosen arms alone against optax.contrib.muon.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

import jax

import muon_optax as mo
from benchmarks.common import (
  CTX,
  JORDAN5,
  JORDAN5_STANDARD,
  VOCAB,
  D,
  LoadWatch,
  cost_analysis,
  gpt2_tree,
  header,
  kernels,
  newton_schulz_flops,
  num_params,
  optax_orthogonalize,
  optimizer_arms,
  polar_error,
  polar_factor,
  random_like,
  ratio_table,
  time_steps,
  tree_bytes,
)

REFERENCE = "optax.contrib.muon"


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, nargs="+", default=[2, 12], help="one run per count")
  ap.add_argument("--d", type=int, default=D, help="width (GPT-2 small: 768)")
  ap.add_argument("--vocab", type=int, default=VOCAB)
  ap.add_argument("--ctx", type=int, default=CTX)
  ap.add_argument("--warmup", type=int, default=1, help="untimed steps per arm")
  ap.add_argument("--steps", type=int, default=5, help="timed steps per arm (N)")
  ap.add_argument("--arms", nargs="+", default=None,
                  help=f"these arms only (always with {REFERENCE}); default: all")
  return ap


def arms_of(args, params) -> dict:
  names = None if args.arms is None else list(dict.fromkeys([*args.arms, REFERENCE]))
  return optimizer_arms(params, names=names)


def kernel_state_bytes(args, layers: int) -> dict[str, float]:
  """Optimizer-state bytes per parameter of the Muon kernels alone: each arm's state on
  the tree without embeddings, norms and biases (shapes only, nothing allocated)."""
  tree = gpt2_tree(layers, d=args.d, vocab=args.vocab, ctx=0, small_leaves=False)
  del tree["wte"]
  return {name: tree_bytes(jax.eval_shape(tx.init, tree)) / num_params(tree)
          for name, tx in arms_of(args, tree).items()}


def compiled_gflops(args, params, grads) -> dict[str, str]:
  """Each arm's update, compiled: XLA's flop count (deterministic, whatever the load)."""
  out = {}
  for name, tx in arms_of(args, params).items():
    state = jax.eval_shape(tx.init, params)
    cost = cost_analysis(jax.jit(tx.update).lower(grads, state, params).compile())
    out[name] = f"{cost['flops'] / 1e9:.1f}"
  return out


def run(args, layers: int) -> dict[str, list[float]]:
  params = gpt2_tree(layers, jax.random.key(0), d=args.d, vocab=args.vocab, ctx=args.ctx)
  grads = random_like(params, jax.random.key(1), 1e-3)
  mats = list(kernels(params).values())
  flops = lambda ns: sum(newton_schulz_flops(*x.shape, ns) for x in mats)
  print(f"\nGPT-2-small tree, {layers} layers (width {args.d}, vocabulary {args.vocab}): "
        f"{num_params(params):,} parameters, {sum(x.size for x in mats):,} in {len(mats)} "
        f"Muon kernels; Newton–Schulz per step {flops(mo.NewtonSchulz()) / 1e9:.3g} GFLOP with "
        f"defaults, {flops(JORDAN5_STANDARD) / 1e9:.3g} for jordan's standard 5 steps; "
        f"{args.warmup} warm-up + {args.steps} timed steps per arm, interleaved")
  with LoadWatch() as load:
    times, states = time_steps(arms_of(args, params), params, grads, args.warmup, args.steps)
  print(load.note() + "\n")
  print(ratio_table(times, REFERENCE, extra={
      "update GFLOP (compiled)": compiled_gflops(args, params, grads),
      "state B/param (all)": {k: f"{tree_bytes(s) / num_params(params):.2f}"
                              for k, s in states.items()},
      "state B/param (Muon kernels)": {k: f"{b:.2f}"
                                       for k, b in kernel_state_bytes(args, layers).items()}}))
  polar_errors(grads)
  return times


def polar_errors(grads) -> None:
  """‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F of the orthogonalized layer-0 kernel gradients, for the
  Newton–Schulz each arm runs (the family shares the defaults')."""
  jordan = mo.PRESETS["jordan"].table[0]
  fns = {"defaults (family)": jax.jit(mo.newton_schulz),
         "jordan 5": jax.jit(lambda g: mo.newton_schulz(g, JORDAN5)),
         "optax.contrib.muon": jax.jit(lambda g: optax_orthogonalize(g, jordan, 5))}
  print("\n| polar error, layer-0 gradient | " + " | ".join(fns) + " |")
  print("|---|" + "--:|" * len(fns))
  for name, g in kernels(grads["h_0"]).items():
    polar = polar_factor(g)
    errs = [polar_error(f(g), polar) for f in fns.values()]
    print(f"| {name} {g.shape[0]}×{g.shape[1]} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


def main(argv: Optional[Sequence[str]] = None) -> dict[int, dict[str, list[float]]]:
  """Runs the benchmark; returns seconds per step, by layer count and arm."""
  args = parser().parse_args(argv)
  print(header("benchmarks.optimizer_step", argv))
  return {layers: run(args, layers) for layers in args.layers}


if __name__ == "__main__":
  main()
