"""What a split matrix costs each device, on its own: no mesh, no compile (the counts are
checked against compiled programs in test_sharded_ns_solver.py)."""

import math

import muon_optax as mo
from muon_optax._newton_schulz.variant import newton_schulz_flops
from muon_optax._sharded_ns.split_cost import (
  CHUNKED_ABOVE_ROWS,
  DEFAULT_MEMORY,
  MEMORY_FLOOR,
  PRODUCT_CHUNKS,
  apply_chunks,
  matmul_passes,
  memory_budget,
  most_product_chunks,
  rows_split,
  split_flops,
  working_set,
)

NS = mo.NewtonSchulz()


def test_a_float32_flop_at_highest_precision_counts_as_its_bfloat16_passes():
  assert matmul_passes(mo.NewtonSchulz(compute_dtype="float32", precision="highest")) == 6
  assert matmul_passes(mo.NewtonSchulz(compute_dtype="float32", precision="high")) == 3
  assert matmul_passes(mo.NewtonSchulz(compute_dtype="bfloat16", precision="highest")) == 1
  assert matmul_passes(mo.NewtonSchulz(compute_dtype="float32", precision="default")) == 1


def test_split_work_is_an_even_share_when_rows_split_too():
  assert rows_split(64, 4) and not rows_split(40, 16) and not rows_split(64, 1)
  whole = newton_schulz_flops(64, 256, NS)
  assert split_flops(64, 256, 4, NS) == whole // 4
  # Rows that do not divide: the m×m products repeat on each device of the group.
  assert split_flops(40, 256, 16, NS) > whole // 16


def test_the_default_memory_budget_is_twice_the_shard_and_never_below_the_floor():
  big, small = [(96, 4096, 14336)], [(4, 64, 256)]
  shard = 96 * 4096 * 14336 / 1024
  assert memory_budget(big, 1024, None) == DEFAULT_MEMORY * shard
  assert memory_budget(big, 1024, 0.5) == 0.5 * shard
  assert memory_budget(big, 1024, math.inf) is None
  assert memory_budget(small, 8, None) == MEMORY_FLOOR  # a small model is not split for it
  assert memory_budget(small, 8, 0.5) == 0.5 * 4 * 64 * 256 / 8  # a cap asked for is kept
  # Updates held replicated (ZeRO-1 holds them whole) add their replicas to the cap; a
  # device holding no more than its shard adds nothing.
  whole = 96 * 4096 * 14336
  assert memory_budget(big, 1024, None, held=whole) == DEFAULT_MEMORY * shard + whole - shard
  assert memory_budget(big, 1024, 0.5, held=whole) == 0.5 * shard + whole - shard
  assert memory_budget(big, 1024, None, held=shard) == DEFAULT_MEMORY * shard
  assert memory_budget(big, 1024, math.inf, held=whole) is None


def test_only_large_shared_matrices_form_their_products_in_blocks():
  # Blocks bound the m×m gathered for a product where it is large; a small one is
  # gathered whole (fewer collectives), and the working set counts it whole.
  big, small = CHUNKED_ABOVE_ROWS * 2, CHUNKED_ABOVE_ROWS // 2
  assert most_product_chunks(big) == PRODUCT_CHUNKS and most_product_chunks(small) == 1
  assert most_product_chunks(small, chunked_above=0) == PRODUCT_CHUNKS
  for rows in (big, small):
    square, part = rows * rows, rows * 4 * rows / 8
    assert working_set(rows, 4 * rows, 8) == (2 * part + 4 * square / 8
                                             + square / most_product_chunks(rows))
    # Formed whole, the gathered m×m counts whole.
    assert working_set(rows, 4 * rows, 8, product_chunks=1) == 2 * part + 4 * square / 8 + square


def test_m_x_is_formed_in_blocks_only_where_the_gathered_m_is_larger_than_x_s_part():
  # Llama-3-8B's gate/up at 256 devices: a 4096×3584 float32 part of X, a 4096×4096 M.
  # Gathered as float32 operands M is the larger: in the Gram sums' 4 blocks; as bfloat16
  # ones (the accelerators' default) it is half X's part: whole.
  rows, part = 4096, 3584
  assert apply_chunks(rows, part, 4) == PRODUCT_CHUNKS
  assert apply_chunks(rows, part, 4, operand_bytes=2) == 1
  assert apply_chunks(rows, 2048, 4, operand_bytes=2) == 1  # equal sizes: whole
  assert apply_chunks(rows, 2047, 4, operand_bytes=2) == PRODUCT_CHUNKS
  assert apply_chunks(rows, 1024, 2048) == 2  # never more blocks than a part's rows allow
  assert apply_chunks(CHUNKED_ABOVE_ROWS, 16, 4) == 1  # a small M: whole (`most_product_chunks`)


def test_a_shared_matrix_keeps_16_bit_operands_out_of_gram_space():
  """Gram space's centred m×m copies, gathered and held beside a shared matrix's part,
  outgrow the memory cap (docs/mesh_results.md): with 16-bit operands and the variant
  automatic, a split matrix runs the standard iteration, as priced and as traced."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from muon_optax._newton_schulz.iteration import newton_schulz_column_parts
  from muon_optax._newton_schulz.variant import shared_settings
  tpu = mo.NewtonSchulz().on("tpu")
  standard, gram = (dataclasses.replace(tpu, gram=g) for g in (False, True))
  assert shared_settings(tpu, 2) == standard and shared_settings(tpu, 1) == tpu
  assert shared_settings(gram, 2) == gram
  assert shared_settings(mo.NewtonSchulz().on("cpu"), 2).gram is None
  assert mo.newton_schulz_plan((256, 1024), tpu).variant == "gram"  # whole: Gram space
  assert split_flops(256, 1024, 2, tpu) == split_flops(256, 1024, 2, standard)
  assert split_flops(256, 1024, 2, tpu) != split_flops(256, 1024, 2, gram)

  def products(ns):
    reduce = lambda v, op: jax.lax.psum(v, "p") if op is jnp.add else jax.lax.pmax(v, "p")
    fn = jax.vmap(lambda part: newton_schulz_column_parts(part, 2, reduce, ns), axis_name="p")
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((2, 256, 512), jnp.float32))
    return str(jaxpr).count("dot_general")

  assert products(tpu) == products(standard) != products(gram)
