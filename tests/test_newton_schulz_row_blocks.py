"""Whole rows: every part holds the m×m matrices whole; their Gram sum, products and
transposes against float64 references, and the errors it gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax._newton_schulz.operands import Matmul
from muon_optax._newton_schulz.row_blocks import RowBlocks, whole_rows

EPS32 = float(np.finfo(np.float32).eps) / 2
MM = Matmul(jnp.float32, jnp.float32, jax.lax.Precision.HIGHEST)


def f64(x):
  return np.asarray(x, np.float64)


def within_float32(out, ref, a, b):
  """|out − ref| within two float32 evaluations' bound γ_k |A| |B| (k = inner size)."""
  k = a.shape[-1]
  bound = 2 * k * EPS32 / (1 - k * EPS32) * (np.abs(f64(a)) @ np.abs(f64(b)))
  return np.all(np.abs(f64(out) - ref) <= bound)


@pytest.mark.parametrize("blocks", [None, 1, 3])
def test_whole_rows_gram_and_products_match_float64(blocks):
  rows = whole_rows(blocks=blocks)
  x = jax.random.normal(jax.random.key(0), (2, 24, 40))
  gram = rows.gram_rows(x, MM)
  assert within_float32(gram, f64(x) @ np.swapaxes(f64(x), -1, -2), x, np.swapaxes(x, -1, -2))
  # Products of two commuting symmetric matrices (polynomials of R): symmetric too.
  r = f64(gram)
  a, b = jnp.asarray(r @ r, jnp.float32), jnp.asarray(2 * r + r @ r @ r, jnp.float32)
  assert within_float32(rows.product(a, b, MM), f64(a) @ f64(b), a, b)
  m = jnp.asarray(r, jnp.float32)
  assert within_float32(rows.apply(m, x, MM), f64(m) @ f64(x), m, x)
  np.testing.assert_array_equal(rows.transposed(a), jnp.swapaxes(a, -1, -2))
  np.testing.assert_array_equal(rows.gather(a), a)
  np.testing.assert_array_equal(rows.rows(a), a)


def test_whole_rows_sum_over_column_parts_with_their_reduce():
  x = jax.random.normal(jax.random.key(1), (16, 64))
  reduce = lambda v, op: jax.lax.psum(v, "part") if op is jnp.add else jax.lax.pmax(v, "part")
  parts = jnp.stack(jnp.split(x, 4, axis=-1))
  split = jax.vmap(lambda p: whole_rows(reduce).gram_rows(p, MM), axis_name="part")(parts)
  ref = f64(x) @ f64(x).T
  for part in split:  # every part holds the whole sum
    assert within_float32(part, ref, x, x.T)


def test_whole_rows_take_x_already_divided():
  with pytest.raises(ValueError, match="already divided"):
    whole_rows().gram_rows(jnp.ones((4, 8)), MM, peak=jnp.ones((1, 1)))


def test_a_mesh_supplies_its_own_products():
  # A mesh's row blocks form products, M X and X Xᵀ its own way: the methods defer.
  calls = []
  def record(name):
    return lambda *args: calls.append(name) or args[0]
  blocks = RowBlocks(lambda v: v, lambda v: v, lambda v: v, lambda v: v,
                     times=record("times"), applied=record("applied"), gram=record("gram"))
  a = jnp.ones((4, 4))
  blocks.product(a, a, MM)
  blocks.apply(a, a, MM)
  blocks.gram_rows(a, MM, jnp.ones((1, 1)))
  assert calls == ["times", "applied", "gram"]
