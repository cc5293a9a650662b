"""How products read their operands: the exact power-of-two peak, Frobenius scaling, and
16-bit and float8 products against float64 products of the same rounded operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax._newton_schulz.operands import (
  Float8Matmul,
  Matmul,
  frobenius_normalize,
  power_of_two_peak,
  whole,
)

EPS32 = float(np.finfo(np.float32).eps) / 2  # unit roundoff


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 3e5, 1e30])
def test_peak_is_the_power_of_two_at_or_above_the_largest_entry(scale):
  x = jax.random.normal(jax.random.key(0), (3, 8, 16)) * jnp.asarray([1.0, scale, 0.5])[:, None, None]
  peak = np.asarray(power_of_two_peak(x), np.float64)
  largest = np.max(np.abs(np.asarray(x, np.float64)), axis=(-2, -1), keepdims=True)
  assert peak.shape == (3, 1, 1)
  np.testing.assert_array_equal(np.log2(peak), np.round(np.log2(peak)))  # powers of two
  assert np.all(largest <= peak) and np.all(peak < 2 * largest)
  # Dividing by it is exact: multiplying back gives X bit for bit.
  np.testing.assert_array_equal(np.asarray(x / power_of_two_peak(x) * power_of_two_peak(x)), x)


def test_peak_of_zero_is_one_and_of_column_parts_is_the_whole_matrix_peak():
  np.testing.assert_array_equal(power_of_two_peak(jnp.zeros((2, 4, 4))), np.ones((2, 1, 1)))
  x = jax.random.normal(jax.random.key(1), (2, 8, 32))
  reduce = lambda v, op: jax.lax.pmax(v, "part") if op is jnp.maximum else jax.lax.psum(v, "part")
  parts = jnp.stack(jnp.split(x, 4, axis=-1))
  split = jax.vmap(lambda p: power_of_two_peak(p, reduce), axis_name="part")(parts)
  for part in split:
    np.testing.assert_array_equal(part, power_of_two_peak(x))


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_frobenius_normalize_scales_to_one_over_safety_at_any_scale(scale):
  x = jax.random.normal(jax.random.key(2), (2, 16, 24)) * scale
  out = np.asarray(frobenius_normalize(x, safety=1.01), np.float64)
  norms = np.linalg.norm(out, axis=(-2, -1))
  # A sum of 384 float32 squares and a few roundings: well within 384 u.
  np.testing.assert_allclose(norms, 1 / 1.01, rtol=2 * 384 * EPS32)
  np.testing.assert_array_equal(frobenius_normalize(jnp.zeros((4, 4)), 1.0), np.zeros((4, 4)))


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_matmul_rounds_its_operands_and_accumulates_in_float32(dtype):
  a = jax.random.normal(jax.random.key(3), (16, 64))
  b = jax.random.normal(jax.random.key(4), (64, 8))
  mm = Matmul(dtype, jnp.float32, jax.lax.Precision.HIGHEST)
  out = mm(a, b)
  assert out.dtype == jnp.float32 and mm.operand(a).dtype == dtype
  ra, rb = f64(mm.operand(a)), f64(mm.operand(b))
  # The float64 product of the rounded operands, within float32 accumulation over k = 64.
  bound = 2 * 64 * EPS32 * (np.abs(ra) @ np.abs(rb))
  assert np.all(np.abs(np.asarray(out, np.float64) - ra @ rb) <= bound)


def e4m3(x):
  return f64(jnp.asarray(x).astype(jnp.float8_e4m3fn))


def test_float8_matmul_scales_each_operand_into_e4m3_range_and_back_exactly():
  a = jax.random.normal(jax.random.key(5), (16, 32)) * 1e-6
  b = jax.random.normal(jax.random.key(6), (32, 8)) * 3e4
  mm = Float8Matmul(jnp.float32, jax.lax.Precision.HIGHEST)
  out = np.asarray(mm(a, b), np.float64)
  # Reference: the same per-matrix power of two, rounded to e4m3, multiplied in float64.
  sa, sb = f64(256 / power_of_two_peak(a)), f64(256 / power_of_two_peak(b))
  ref = (e4m3(f64(a) * sa) @ e4m3(f64(b) * sb)) / (sa * sb)
  bound = 2 * 32 * EPS32 * (np.abs(e4m3(f64(a) * sa)) @ np.abs(e4m3(f64(b) * sb))) / (sa * sb)
  assert np.all(np.abs(out - ref) <= bound)
  # Each largest entry lands in [128, 256): no e4m3 overflow (max 448), full mantissa use.
  largest = np.max(np.abs(f64(a) * sa))
  assert 128 <= largest < 256
  # Against the exact product: e4m3's unit roundoff 2^-4 on each operand.
  exact = f64(a) @ f64(b)
  scale = np.abs(f64(a)) @ np.abs(f64(b))
  assert np.all(np.abs(out - exact) <= 2 * 2.0**-4 * scale + bound)
  # Operands travel unrounded: a collective gathering them moves float32.
  assert mm.operand(a).dtype == jnp.float32


def test_float8_matmul_is_invariant_to_powers_of_two():
  a = jax.random.normal(jax.random.key(7), (8, 16))
  b = jax.random.normal(jax.random.key(8), (16, 8))
  mm = Float8Matmul(jnp.float32)
  np.testing.assert_array_equal(mm(a * 2.0**40, b * 2.0**-20), mm(a, b) * 2.0**20)


def test_whole_reduce_is_the_identity():
  x = jnp.arange(6.0)
  assert whole(x, jnp.add) is x and whole(x, jnp.maximum) is x
