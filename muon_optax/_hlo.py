"""Deterministic figures from compiled XLA programs: collectives and their bytes."""

from __future__ import annotations

import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([\d,]*)\]")


def collective_stats(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{collective: (count, bytes)} of one device's compiled program.

  Bytes are those of each collective's result on one device; asynchronous pairs
  (`*-start` / `*-done`) count once.

  Example:
    >>> compiled = jax.jit(step).lower(*args).compile()  # doctest: +SKIP
    >>> mo.collective_stats(compiled.as_text())["all-gather"]
  """
  stats = {op: [0, 0] for op in COLLECTIVES}
  for line in hlo_text.splitlines():
    match = _OP.search(line)
    if not match:
      continue
    result_type, op = match.groups()
    if op + "-start" in line:  # the start's result tuple repeats the operands: count outputs only
      arrays = _ARRAY.findall(result_type)[len(_ARRAY.findall(result_type)) // 2:]
    else:
      arrays = _ARRAY.findall(result_type)
    stats[op][0] += 1
    stats[op][1] += sum(_ITEM_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                        for t, dims in arrays)
  return {op: (n, b) for op, (n, b) in stats.items()}
