"""How a Newton–Schulz product reads its operands: rounded to a dtype (`Matmul`) or to
float8 with a per-matrix power-of-two scale (`Float8Matmul`), and the exact power-of-two
scaling both rely on, taken over a matrix's column parts where devices split it
(`Reduce`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Combines per-part results over the column parts of a matrix split across devices:
# reduce(partial, op) with op jnp.maximum or jnp.add. One part: the identity.
Reduce = Callable[[jax.Array, Callable], jax.Array]


def whole(x: jax.Array, op: Callable) -> jax.Array:
  del op
  return x


def power_of_two_peak(x: jax.Array, reduce: Reduce = whole) -> jax.Array:
  """The power of two at or just above max|X| per matrix (1 for a zero matrix), shape
  (..., 1, 1): dividing by it keeps later sums of squares from overflowing (entries
  ~1e30) or underflowing (~1e-30) in float32, and is exact, so that X / peak rounded
  to any operand dtype is X rounded, divided."""
  peak = reduce(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True), jnp.maximum)
  exponent = jnp.clip(jnp.frexp(peak)[1], -125, 127)  # within float32's normal range
  return jnp.ldexp(jnp.ones_like(peak), exponent)


def frobenius_normalize(x: jax.Array, safety: float, reduce: Reduce = whole) -> jax.Array:
  """X / (‖X‖_F · safety), exact for any finite scale; 0 stays exactly 0."""
  x = x / power_of_two_peak(x, reduce)
  norm = jnp.sqrt(reduce(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True), jnp.add)) * safety
  return x / jnp.where(norm > 0, norm, 1)


class Matmul(NamedTuple):
  """a @ b with its operands in `operands` and the products accumulated in `accumulate`
  (float32 or wider)."""

  operands: Any
  accumulate: Any
  precision: Any = None

  def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(self.operand(a), self.operand(b), precision=self.precision,
                      preferred_element_type=self.accumulate)

  def operand(self, x: jax.Array) -> jax.Array:
    """x as the product reads it: what a collective gathering an operand moves, exactly
    (half the bytes with 16-bit operands)."""
    return x.astype(self.operands)


class Float8Matmul(NamedTuple):
  """a @ b with float8 (e4m3) operands, each matrix first multiplied by the power of two
  that puts its largest entry in [128, 256) (e4m3 holds up to 448, with 3 mantissa bits
  wherever the entry lands), the product divided back, exactly, in `accumulate`. The
  operands travel unrounded (`operand`): each product scales what it reads."""

  accumulate: Any
  precision: Any = None

  def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
    scale_a, scale_b = 256 / power_of_two_peak(a), 256 / power_of_two_peak(b)
    product = jnp.matmul((a * scale_a).astype(jnp.float8_e4m3fn),
                         (b * scale_b).astype(jnp.float8_e4m3fn), precision=self.precision,
                         preferred_element_type=self.accumulate)
    return product / (scale_a * scale_b)

  def operand(self, x: jax.Array) -> jax.Array:
    return x
