"""Deterministic figures from compiled XLA programs: collectives and the bytes they move.

`collective_stats(compiled.as_text())` is what `benchmarks/distributed.py` reports. As a
command it reads programs saved as text (`compiled.as_text()` written to a file, or the
`*after_optimizations.txt` files of `XLA_FLAGS=--xla_dump_to=DIR`) and prints one row
per file:

    python -m benchmarks.hlo PROGRAM.txt [PROGRAM.txt ...]
"""

from __future__ import annotations

import argparse
import pathlib
import re
from collections.abc import Sequence
from typing import Optional

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_COMMENT = re.compile(r"/\*.*?\*/")
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PAIRS = re.compile(r"source_target_pairs=\{([\d,{}]*)\}")


def _group_size(line: str, partitions: int) -> int:
  if match := _GROUPS.search(line):
    return len([d for d in match.group(1).split(",") if d])
  if match := _IOTA_GROUPS.search(line):
    return int(match.group(2))
  return partitions  # `replica_groups={}`: every device


def _moved(op: str, result_bytes: int, group: int, line: str) -> float:
  """Bytes one device receives from others (ring algorithms for reductions)."""
  if op in ("all-gather", "all-to-all"):
    return result_bytes * (group - 1) / group  # its own slice stays put
  if op == "reduce-scatter":
    return result_bytes * (group - 1)
  if op == "all-reduce":
    return 2 * result_bytes * (group - 1) / group  # reduce-scatter, then all-gather
  pairs = _PAIRS.search(line)
  moving = pairs and any(a != b for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0)))
  return result_bytes if moving else 0


def collective_stats(hlo_text: str, outside: Optional[str] = None) -> dict[str, tuple[int, int]]:
  """{collective: (count, bytes)} of one device's compiled program; with `outside`, only
  the collectives not traced in `jax.named_scope(outside)`.

  Bytes are those one device receives from the others: for an all-gather or
  all-to-all over g devices, (g − 1)/g of its result; a reduce-scatter (g − 1)
  times its result; an all-reduce 2 (g − 1)/g of its result (ring); a
  collective-permute its result. Asynchronous pairs (`*-start` / `*-done`) count once.

  Example:
    >>> compiled = jax.jit(step).lower(*args).compile()  # doctest: +SKIP
    >>> collective_stats(compiled.as_text())["all-gather"]
  """
  stats = {op: [0, 0.0] for op in COLLECTIVES}
  for op, _, moved, name in collective_ops(hlo_text):
    if outside is not None and f"/{outside}/" in name:
      continue
    stats[op][0] += 1
    stats[op][1] += moved
  return {op: (n, int(round(b))) for op, (n, b) in stats.items()}


def collective_ops(hlo_text: str) -> list[tuple[str, int, float, str]]:
  """(collective, devices in its group, bytes one device receives, the op_name it was
  traced under) of every collective of one device's compiled program, in program order
  (see `collective_stats`)."""
  partitions = int(m.group(1)) if (m := _PARTITIONS.search(hlo_text)) else 1
  ops = []
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)
    match = _OP.search(line)
    if not match:
      continue
    result_type, op = match.groups()
    arrays = _ARRAY.findall(result_type)
    if op + "-start" in line:  # the start's result tuple repeats the operands: count outputs only
      arrays = arrays[len(arrays) // 2:]
    size = sum(_ITEM_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for t, dims in arrays)
    group = _group_size(line, partitions)
    name = m.group(1) if (m := _OP_NAME.search(line)) else ""
    ops.append((op, group, _moved(op, size, group, line), name))
  return ops


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("programs", nargs="+", type=pathlib.Path, help="HLO text files")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> dict[str, dict[str, tuple[int, int]]]:
  """Prints count and bytes of each collective per program; returns them by file name."""
  args = parser().parse_args(argv)
  print("| program | " + " | ".join(f"{op} (count, bytes)" for op in COLLECTIVES) + " |")
  print("|---|" + "--:|" * len(COLLECTIVES))
  stats = {}
  for path in args.programs:
    stats[str(path)] = collective_stats(path.read_text())
    print(f"| {path} | " + " | ".join(f"{n}, {b:,}" for n, b in
                                      stats[str(path)].values()) + " |")
  return stats


if __name__ == "__main__":
  main()
