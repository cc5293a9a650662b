"""Products known to be symmetric, computed by their upper block triangle and mirrored.

X Xᵀ is symmetric, and so is every m×m product of the iteration: R, the polynomials in
R and the Gram-space Q all commute, so each product of two of them is symmetric too.
XLA computes a whole product. Here the m rows are cut into b blocks, block row i of
C = A B is computed from its diagonal block on (C[i, i:] = A[i, :] B[:, i:], one product
per block row), and the blocks left of the diagonal are the transposes of those above
it: (b + 1) / (2b) of the whole product's flops, as plain JAX products that every
backend compiles. The blocks off the diagonal mirror each other exactly.
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

from muon_optax._newton_schulz.operands import Matmul
from muon_optax._util.order import after

# Block rows of at least this many rows, so that each strip stays a large product; a
# matrix under twice this size is computed whole. Not yet timed on an idle machine: the
# busy runs in benchmarks/results/newton_schulz_symmetric.txt hint that strips of 96
# rows (8 blocks of 768) run slower, and cannot rank 2 to 6 blocks.
MIN_BLOCK_ROWS = 256
# At most this many block rows: (b + 1) / (2b) gains little past it (9/16 at 8, 1/2 in
# the limit), while each block row is one more product to compile and schedule.
MAX_BLOCKS = 8
# Platforms that form every product whole: an H200 ran GPT-2-small's Newton–Schulz
# (768-row products in 3 block rows) 1.2-1.6x slower than whole products
# (benchmarks/results/accelerator_h200.txt against its first run), as narrow strips
# fill few of its multiprocessors.
WHOLE_PRODUCTS_ON = ("gpu",)
# What a symmetric product multiplies, as its block rows are priced: X by Xᵀ in the
# standard iteration (every step) or in the Gram-space one (once a segment), two m×m
# matrices of the standard iteration, or two of the Gram-space iteration.
ProductOf = Literal["x_xt", "gram_space_x_xt", "squares", "gram_space"]
# Platforms that form the Gram-space iteration's products of two m×m matrices whole,
# and cut its X Xᵀ: compiled for a v5p chip, block rows of those m×m products cost more
# HBM bytes than their flops save, while the standard iteration's pay for theirs in large
# enough steps (`MIN_SQUARE_CUT_WORK_ON`; the v5p roofline rows of
# benchmarks/results/newton_schulz_symmetric.txt).
WHOLE_GRAM_SPACE_PRODUCTS_ON = ("tpu",)
# Platforms that cut products only from this many rows: on a v5p chip the block rows of
# a smaller X Xᵀ add more HBM bytes than the flops they save (whole X Xᵀ ran the default
# iteration faster by the roofline at 1024, 1536 and 2048 rows, its block rows at 3072
# and 4096: the row sweeps in benchmarks/results/newton_schulz_symmetric.txt).
MIN_CUT_ROWS_ON = {"tpu": 3072}
# Products of two m×m matrices on these platforms: cut only in the iteration of an m×n X
# (m ≤ n) with m²n at least this (the work of its X Xᵀ and of its product with X), in at
# most this many block rows. Compiled for a v5p chip, the squares' block rows cost more
# HBM bytes than they save in flops until those products with X are large enough to
# hide them: the standard iteration ran faster with them whole on 3072² and 3072×4608,
# even on 3072×6144, faster with them cut on 3072×9216, 3072×12288 and 4096² (the last in
# 4 block rows rather than 8): the v5p rows of benchmarks/results/newton_schulz_symmetric.txt.
MIN_SQUARE_CUT_WORK_ON = {"tpu": 4096**3}
MAX_SQUARE_BLOCKS_ON = {"tpu": 4}
# X Xᵀ of the Gram-space iteration on these platforms: cut only where m²n is at least
# this. It runs once a segment, not every step, so its block rows' HBM bytes are hidden
# only in as large a step as the squares' are: compiled for a v5p chip, the Gram-space
# default ran faster with it whole on 3072×6144 (2.28 ms against 2.38), with it cut on
# 3072×8192 to 3072×12288; on 3072×7168, just under the floor, 1% faster cut (2.42
# against 2.45: benchmarks/results/newton_schulz_symmetric.txt).
MIN_GRAM_SPACE_X_XT_CUT_WORK_ON = {"tpu": 4096**3}


def block_count(m: int, backend: Optional[str] = None, *, of: ProductOf = "x_xt",
                n: Optional[int] = None) -> int:
  """How many block rows a symmetric m×m product `of` these factors is cut into on
  `backend` (default: jax's; 1: the whole product), in the iteration of an m×n X
  (`n`, default m)."""
  backend = backend or jax.default_backend()
  if backend in WHOLE_PRODUCTS_ON or m < MIN_CUT_ROWS_ON.get(backend, 0):
    return 1
  work, most = m * m * (n or m), MAX_BLOCKS
  if of == "gram_space_x_xt" and work < MIN_GRAM_SPACE_X_XT_CUT_WORK_ON.get(backend, 0):
    return 1
  if of in ("squares", "gram_space"):
    if ((of == "gram_space" and backend in WHOLE_GRAM_SPACE_PRODUCTS_ON)
        or work < MIN_SQUARE_CUT_WORK_ON.get(backend, 0)):
      return 1
    most = MAX_SQUARE_BLOCKS_ON.get(backend, MAX_BLOCKS)
  return max(1, min(m // MIN_BLOCK_ROWS, most))


def _cuts(m: int, blocks: Optional[int], backend: Optional[str] = None,
          of: ProductOf = "x_xt", n: Optional[int] = None) -> list[int]:
  """Block row boundaries 0 = c_0 < … < c_b = m, blocks of equal size but the last."""
  if blocks is None:
    blocks = block_count(m, backend, of=of, n=n)
  if not 1 <= blocks <= m:
    raise ValueError(f"a symmetric product of {m} rows takes 1 to {m} block rows, got {blocks}")
  size = -(-m // blocks)
  return list(range(0, m, size)) + [m]


def symmetric_flops(m: int, k: int, blocks: Optional[int] = None,
                    backend: Optional[str] = None, *, of: ProductOf = "x_xt",
                    n: Optional[int] = None) -> int:
  """Matmul flops of an m×m symmetric product `of` these factors with inner dimension
  k, in the iteration of an m×n X, as computed here on `backend` (2m²k when whole)."""
  cuts = _cuts(m, blocks, backend, of, n)
  return sum(2 * (stop - start) * k * (m - start) for start, stop in zip(cuts[:-1], cuts[1:]))


def symmetric_product(a: jax.Array, b: jax.Array, matmul: Matmul,
                      blocks: Optional[int] = None, *, of: ProductOf = "x_xt",
                      n: Optional[int] = None) -> jax.Array:
  """`matmul(a, b)` for (..., m, k) `a` and (..., k, m) `b` whose product is symmetric
  (the caller knows: X Xᵀ, or two commuting symmetric matrices, `of`), from its upper
  block triangle in (at most) `blocks` block rows, default `block_count`'s for the
  iteration of an m×n X.

  Both factors are read as the product reads them (`matmul.operand`) once, before they
  are cut. Each block row is `matmul` of a's rows and b's columns from the diagonal on,
  one after another (each tied to the last by both), so that one block row's copies of
  them are live at a time. Its blocks left of the diagonal are the transposes of those
  above it (exactly symmetric; the diagonal blocks, computed whole, as symmetric as a
  whole product's)."""
  m = a.shape[-2]
  if b.shape[-1] != m:
    raise ValueError(f"a symmetric product is square: a has {m} rows, b {b.shape[-1]} columns")
  cuts = _cuts(m, blocks, of=of, n=n)
  if len(cuts) == 2:
    return matmul(a, b)
  a, b = matmul.operand(a), matmul.operand(b)
  spans = list(zip(cuts[:-1], cuts[1:]))
  strips = []  # strips[i] = C[c_i:c_{i+1}, c_i:], the block row from its diagonal block on
  for start, stop in spans:
    strips.append(matmul(*after((a[..., start:stop, :], b[..., :, start:]), strips[-1:])))
  rows = []
  for i, (start, stop) in enumerate(spans):
    left = [jnp.swapaxes(strips[j][..., :, start - cuts[j]:stop - cuts[j]], -1, -2)
            for j in range(i)]
    rows.append(jnp.concatenate([*left, strips[i]], axis=-1))
  return jnp.concatenate(rows, axis=-2)


def symmetric_gram(x: jax.Array, matmul: Matmul, blocks: Optional[int] = None, *,
                   gram_space: bool = False) -> jax.Array:
  """X Xᵀ of (..., m, n) `x` by `symmetric_product`, in the iteration that runs (the
  Gram-space one with `gram_space`)."""
  return symmetric_product(x, jnp.swapaxes(x, -1, -2), matmul, blocks,
                           of="gram_space_x_xt" if gram_space else "x_xt", n=x.shape[-1])
