"""What the checkpoint checksums cost: save and restore with and without them.

A GPT-2-shaped params tree of two blocks (width 768; a vocabulary of 2048 keeps the
embedding from dominating) and its `muon` optimizer state, about 66 and 76 MB, both
filled with random values (zeros would compress to nothing). One timed save is
`Checkpointer.save` then `wait()`, so it includes the write, the commit and the
retirement of the step that falls out of `max_to_keep=2`; one timed restore reads the
latest step into an abstract target on the default device. The verified arms write
checksums (`save(checksums=True)`) and check them (`restore(verify=True)`); the
unverified arms do neither. The arms take turns call by call. Prints min and median of N
per arm with the 1-minute load average before and after the timed calls, and writes the
same to `--out`.

    python -m benchmarks.checkpoint_io [--layers 2] [--reps 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
from benchmarks.common import gpt2_tree, machine, time_interleaved, tree_bytes
from muon_optax.checkpoint import _checksum

RESULTS = os.path.join(os.path.dirname(__file__), "results", "checkpoint_io.txt")


def random_like(tree, seed: int):
  """Random normal values in each leaf's shape and dtype (host-generated: no compiles)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), tree)


def arms(stack: contextlib.ExitStack, directory: str, params, state, target) -> dict:
  """Zero-argument calls, one per arm: save+wait and restore, verified or not."""
  calls = {}
  for verify in (False, True):
    ckpt = stack.enter_context(mo.checkpoint.Checkpointer(
        os.path.join(directory, str(verify)), max_to_keep=2))
    steps = iter(range(1, 1 << 30))

    def save(ckpt=ckpt, steps=steps, verify=verify):
      ckpt.save(next(steps), params, state, checksums=verify)
      ckpt.wait()

    def restore(ckpt=ckpt, verify=verify):
      return ckpt.restore(params_target=target[0], opt_state_target=target[1], verify=verify)

    calls["save", verify], calls["restore", verify] = save, restore
  calls["checksums", True] = lambda: _checksum.checksums((params, state))
  return calls


def report(args, times: dict, load: tuple[float, float], nbytes: int) -> str:
  """The header saying how it ran, then min and median per operation and arm."""
  shared = ("a shared 2-core CPU machine" if os.cpu_count() == 2
            else f"a {os.cpu_count()}-core machine")
  busy = "; above 1 before the run: other jobs were running" if load[0] > 1 else ""
  ms = lambda t: f"{min(t) * 1e3:7.1f} / {statistics.median(t) * 1e3:7.1f}"
  lines = [
      f"# python -m benchmarks.checkpoint_io {' '.join(args.argv)}".rstrip()
      + f", on {shared}; 1-minute load average {load[0]:.2f} before, {load[1]:.2f} after "
      "(after includes this run's own load)" + busy,
      f"machine: {machine()}",
      f"GPT-2-shaped tree: {args.layers} blocks, width {args.d}, vocabulary {args.vocab}, "
      f"context {args.ctx}; params + muon state: {nbytes / 2**20:.1f} MiB of arrays; "
      f"{args.reps} interleaved calls per arm after 1 warm-up",
      "",
      "| Operation | unverified min / median (ms) | verified min / median (ms) "
      "| overhead min / median |",
      "|-----------|-----------------------------:|---------------------------:"
      "|----------------------:|",
  ]
  for op in ("save", "restore"):
    off, on = times[op, False], times[op, True]
    overhead = (f"{min(on) / min(off) - 1:+6.1%} / "
                f"{statistics.median(on) / statistics.median(off) - 1:+6.1%}")
    lines.append(f"| {op:<9} | {ms(off):>28} | {ms(on):>26} | {overhead:>21} |")
  lines.append(f"\nchecksums alone (params + state, computed on the device): "
               f"{ms(times['checksums', True])} ms min / median")
  return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> dict[tuple[str, bool], list[float]]:
  """Runs the benchmark; returns seconds per call keyed by (operation, verified)."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--vocab", type=int, default=2048)
  ap.add_argument("--ctx", type=int, default=1024)
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--out", default=RESULTS, help="where to write the report ('-': nowhere)")
  args = ap.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)

  params = random_like(gpt2_tree(args.layers, d=args.d, vocab=args.vocab, ctx=args.ctx), 0)
  tx = mo.muon(0.02)
  state = random_like(jax.eval_shape(tx.init, params), 1)
  target = mo.checkpoint.abstract_target(tx, params)
  with tempfile.TemporaryDirectory() as directory, contextlib.ExitStack() as stack:
    calls = arms(stack, directory, params, state, target)
    before = os.getloadavg()[0]
    times = time_interleaved(calls, args.reps)
    load = before, os.getloadavg()[0]
  text = report(args, times, load, tree_bytes((params, state)))
  print(text, end="")
  if args.out != "-":
    with open(args.out, "w") as f:
      f.write(text)
  return times


if __name__ == "__main__":
  main()
