"""What a matrix split by columns over g devices costs each of them, at trace time (no
jax): its Newton–Schulz flops (`split_flops`), the bytes (`split_bytes`) and collectives
(`split_collectives`) its m×m matrices add, the float32 elements its work holds live
(`working_set`), and the caps and prices the plan weighs them by (`memory_budget`,
`FLOPS_PER_BYTE`, `COLLECTIVE_BYTES`). `rounds` deals the matrices by them; the iteration
that runs a split is `newton_schulz_column_parts` with `FactorMesh.row_blocks`."""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from muon_optax._newton_schulz.settings import NewtonSchulz
from muon_optax._newton_schulz.variant import newton_schulz_plan, shared_settings
from muon_optax._placement.mesh_layout import FLOPS_PER_BYTE  # noqa: F401  (the price's home is MeshLayout's default)


def rows_split(rows: int, split: int) -> bool:
  """Whether the m×m products of a matrix shared by `split` devices are split by rows
  too (its rows divide evenly), so that each device does 1/split of all the work."""
  return split > 1 and rows % split == 0


def split_flops(rows: int, cols: int, split: int, ns: NewtonSchulz) -> int:
  """Per-device flops of `newton_schulz_column_parts` on a rows×cols (rows ≤ cols) matrix
  split over `split` devices: products with X are split by columns; the rows×rows
  products by rows when `rows_split`, else repeated on each device. Counted with whole
  products throughout: a mesh's row blocks compute them so, and whole and split matrices
  are weighed alike (a whole matrix's symmetric products save it about a quarter)."""
  plan = newton_schulz_plan((rows, cols), shared_settings(ns, split), symmetric=False)
  if rows_split(rows, split):
    return plan.flops // split
  return plan.flops - plan.x_flops + plan.x_flops // split


# An m×m product of a shared matrix may form the whole right factor in this many chunks
# of columns, one at a time (`FactorMesh.row_blocks`): one chunk is live, never the whole
# m×m. A unit of work does so only where the memory cap needs it
# (`exchange_schedule.units`): each chunk is a collective of its own.
PRODUCT_CHUNKS = 4
# ... where the matrix has more rows than this: below, a whole m×m (16 MB in float32)
# is small beside any device's memory.
CHUNKED_ABOVE_ROWS = 2048


def most_product_chunks(rows: int, chunked_above: int = CHUNKED_ABOVE_ROWS) -> int:
  """The most chunks an m×m product of a shared matrix with `rows` rows is formed in."""
  return PRODUCT_CHUNKS if rows > chunked_above else 1


def apply_chunks(rows: int, part_cols: int, split: int, operand_bytes: int = 4,
                 x_bytes: int = 4, product_chunks: Optional[int] = None) -> int:
  """How many chunks of rows M X is formed in for a matrix of `rows` rows shared by
  `split` devices, each with `part_cols` columns of X (`FactorMesh.row_blocks`), where
  its m×m products are formed in `product_chunks` chunks (default: the most,
  `most_product_chunks`): the Gram sums' chunks where the whole m×m, gathered as
  `operand_bytes`-byte operands,
  is larger than X's part (`x_bytes` an element), else 1. Chunks leave X, the result
  and a chunk of M live, against the whole M, but add collectives and k result buffers
  that are put together in a new array, which fragments a compiler's heap: they pay
  only where M is the larger."""
  if rows * operand_bytes <= part_cols * x_bytes:
    return 1
  chunks = most_product_chunks(rows) if product_chunks is None else product_chunks
  return math.gcd(chunks, rows // split)


def working_set(rows: int, cols: int, split: int, product_chunks: Optional[int] = None
                ) -> float:
  """About the float32 elements one device holds live while it orthogonalizes its part
  of a rows×cols (rows ≤ cols) matrix split over `split` devices: its part and the next
  one, four m×m matrices (or their row blocks, see `rows_split`), and a chunk of a
  whole m×m gathered for a product, formed in `product_chunks` chunks (default: the most,
  `most_product_chunks`)."""
  part, square = rows * cols / split, rows * rows
  if rows_split(rows, split):
    chunks = most_product_chunks(rows) if product_chunks is None else product_chunks
    return 2 * part + 4 * square / split + square / chunks
  return 2 * part + 4 * square


# The default cap on one unit of Newton–Schulz work (`working_set`), as a multiple of
# the Muon state shard: finer splits where a matrix's work alone would take more, at
# m×m traffic that grows with the split (benchmarks/results/scale.jsonl).
DEFAULT_MEMORY = 2.0
# ... never below this many float32 elements (32 MB): a small model's matrices, each
# larger than its shard on many devices, are not split for a few megabytes.
MEMORY_FLOOR = 2**23


def memory_budget(shapes: list[tuple[int, int, int]], devices: int,
                  memory: Optional[float], held: float = 0.0) -> Optional[float]:
  """The float32 elements one unit of Newton–Schulz work, or one exchange's buffers
  beside it, may hold live on a device, for stacks of shapes (count, rows, cols) over
  `devices`: `memory` times their shard, by default (None) `DEFAULT_MEMORY` times it and
  at least `MEMORY_FLOOR`, plus what `held` (the elements of their updates a device
  holds in the layout they are wanted in) has beyond the shard: the replicas of a
  layout that replicates the params over some axes (ZeRO-1, tensor parallelism beside a
  data axis), which its exchange brings to every device that holds one. None (no cap)
  for an infinite `memory`."""
  if memory is not None and math.isinf(memory):
    return None
  shard = sum(math.prod(s) for s in shapes) / devices
  replicas = max(held - shard, 0.0)
  if memory is None:
    return max(DEFAULT_MEMORY * shard, MEMORY_FLOOR) + replicas
  return memory * shard + replicas


# A unit of split work forms its m×m products whole only where its work with them fits
# this share of the memory cap (by default one state shard), else in chunks
# (`exchange_schedule.units`): a whole m×m saves its chunks' collectives, and within this
# share a step's temporary memory stays where the chunks kept it
# (benchmarks/results/scale.jsonl).
WHOLE_PRODUCTS_SHARE = 0.5



def matmul_passes(ns: NewtonSchulz) -> int:
  """What one of `ns`'s matmul flops costs in 16-bit ones, the unit of `FLOPS_PER_BYTE`:
  float32 operands at HIGHEST precision run as six bfloat16 passes on a TPU (a GPU's
  full float32 is slower still), at HIGH as three; anything else as one."""
  if ns.dtype().itemsize < 4:
    return 1
  return {"HIGHEST": 6, "HIGH": 3}.get(ns.matmul_precision().name, 1)


def split_bytes(rows: int, split: int, ns: NewtonSchulz) -> float:
  """Bytes one device of a group of `split` receives to share a matrix of `rows` rows:
  per step, about three m×m transfers, each (g − 1)/g of the m×m matrix: the Gram sum
  reduce-scattered into row blocks, in float32, and two whole m×m matrices gathered
  from them as the products read them (`ns.dtype()`: 16-bit operands halve them)."""
  per_element = 4 + 2 * ns.dtype().itemsize
  return ns.num_steps() * (split - 1) / split * rows * rows * per_element if split > 1 else 0.0


# A collective's fixed cost, whatever it carries (about 10 µs to start and synchronize),
# as the bytes an interconnect moves meanwhile (TPU v5p ICI: 600 GB/s): `flops_per_byte`
# prices it in flops like any byte.
COLLECTIVE_BYTES = 6e6


def split_collectives(rows: int, cols: int, split: int, ns: NewtonSchulz,
                      product_chunks: Optional[int] = None) -> int:
  """How many collectives a kind of split adds to the iteration on rows×cols (rows ≤
  cols) matrices (the split matrices of one shape and split run together, so that each
  serves all of them), counted from what `newton_schulz_column_parts` runs with
  `FactorMesh.row_blocks`: the norm (its peak and, without AOL, its sum of squares); a
  Gram sum reduce-scattered per chunk of rows; a whole m×m gathered per chunk of its
  columns for each m×m product, per chunk of rows for M X (`apply_chunks`); the
  Gram-space iteration's transposes; the m×m products formed in `product_chunks` chunks
  (default: the most, `most_product_chunks`). Without `rows_split`, each part holds the m×m
  whole: one all-reduce per Gram sum."""
  if split == 1:
    return 0
  ns = shared_settings(ns, split)
  plan = newton_schulz_plan((rows, cols), ns)
  aol = plan.precondition == "aol"
  norm = 1 if aol else 2  # its peak; without AOL, then its sum of squares
  grams = plan.steps if plan.variant == "standard" else len(plan.segments)
  if not rows_split(rows, split):
    return norm + grams
  chunks = most_product_chunks(rows) if product_chunks is None else product_chunks
  gram, product = math.gcd(chunks, rows // split), math.gcd(chunks, rows)
  apply = apply_chunks(rows, cols // split, split, ns.dtype().itemsize, product_chunks=chunks)
  count = norm + gram * grams + aol  # the Gram sums, AOL's gathered scale
  if plan.variant == "standard":
    return count + plan.steps * (product + apply)
  # With 16-bit operands each product reads centred operands (`_centred_product`): R's
  # centred copy serves R R and Z R, one gather where products are whole; the centres
  # are means gathered once a step (R's, D's), once more where R is updated (P R's),
  # and once for each Q X (`centering`).
  sixteen = jnp.dtype(plan.compute_dtype).itemsize < 4
  shared = sixteen and product == 1
  for start, stop in plan.segments:  # each step forms P; all but one also Rᵀ, Q, next R
    steps = stop - start
    count += (apply * (start > 0) + steps * product
              + (steps - 1) * (1 + 3 * product - shared)
              + sixteen * (steps + (steps - 1) + 1))
  return count + apply
