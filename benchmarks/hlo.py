"""Deterministic figures from compiled XLA programs: collectives and the bytes they move."""

from __future__ import annotations

import re

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


def collective_stats(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{collective: (count, bytes)} of one device's compiled program.

  Bytes are those one device receives from the others: for an all-gather or
  all-to-all over g devices, (g − 1)/g of its result; a reduce-scatter (g − 1)
  times its result; an all-reduce 2 (g − 1)/g of its result (ring); a
  collective-permute its result. Asynchronous pairs (`*-start` / `*-done`) count once.

  Example:
    >>> compiled = jax.jit(step).lower(*args).compile()  # doctest: +SKIP
    >>> collective_stats(compiled.as_text())["all-gather"]
  """
  partitions = int(m.group(1)) if (m := _PARTITIONS.search(hlo_text)) else 1
  stats = {op: [0, 0.0] for op in COLLECTIVES}
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
    stats[op][0] += 1
    stats[op][1] += _moved(op, size, _group_size(line, partitions), line)
  return {op: (n, int(round(b))) for op, (n, b) in stats.items()}
