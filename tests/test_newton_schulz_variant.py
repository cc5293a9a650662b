"""`newton_schulz_plan`: which iteration runs on a shape, with what dtype and precision,
where the Gram-space iteration restarts, and its flops, which equal XLA's counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import compiled_flops

import muon_optax as mo
from muon_optax._newton_schulz.symmetric import symmetric_flops
from muon_optax._newton_schulz.variant import (
  GRAM_MIN_ASPECT,
  gram_flops,
  gram_restarts,
  newton_schulz_flops,
  newton_schulz_plan,
  segments,
  use_gram,
)

NS = mo.NewtonSchulz
CONVERGENT = np.array([[2.0, -1.5, 0.5]])  # a schedule that converges to the polar factor


def test_auto_dtype_and_precision_follow_the_platform():
  cpu = newton_schulz_plan((768, 3072), backend="cpu")
  assert (cpu.variant, cpu.steps, cpu.precondition) == ("gram", 4, "aol")
  assert (cpu.compute_dtype, cpu.precision) == ("float32", "HIGHEST")
  for backend in ("gpu", "tpu"):
    # bfloat16 operands: turbo runs Gram space on a wide matrix, restarted every 2 steps,
    # the other presets and square matrices the standard iteration (see use_gram).
    plan = newton_schulz_plan((768, 3072), backend=backend)
    assert (plan.variant, plan.segments, plan.compute_dtype, plan.precision) == (
        "gram", ((0, 2), (2, 4)), "bfloat16", "DEFAULT")
    assert plan.flops < 0.8 * newton_schulz_flops(768, 3072, NS(gram=False),
                                                  backend=backend)
    for ns, shape in ((NS(), (768, 768)), (NS("jordan"), (768, 3072)),
                      (NS("turbo", steps=5), (768, 3072)),
                      (NS(precondition="frobenius"), (768, 3072))):
      assert newton_schulz_plan(shape, ns, backend=backend).variant == "standard", ns
  # float16 operands run Gram space for every preset.
  half = newton_schulz_plan((768, 3072), NS("jordan", compute_dtype="float16"), backend="gpu")
  assert (half.variant, half.segments) == ("gram", ((0, 2), (2, 4), (4, 5)))
  explicit = newton_schulz_plan((3072, 768), NS("jordan", compute_dtype="float32",
                                                precision="highest"), backend="gpu")
  assert (explicit.variant, explicit.steps, explicit.precondition) == ("gram", 5, "frobenius")
  assert str(explicit).startswith("gram · 5 steps · frobenius · float32")
  # On this test's CPU backend "auto" is float32: identical to asking for it.
  x = jax.random.normal(jax.random.key(7), (16, 48))
  np.testing.assert_array_equal(mo.newton_schulz(x), mo.newton_schulz(
      x, NS(compute_dtype="float32", precision="highest")))


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (4, 32, 96)])
def test_compiled_flops_gram_cheaper_at_wide_aspect(shape):
  x = jnp.ones(shape, jnp.float32)
  count = int(np.prod(shape[:-2]))
  standard = compiled_flops(lambda x: mo.newton_schulz(x, NS(gram=False)), x)
  gram = compiled_flops(lambda x: mo.newton_schulz(x, NS(gram=True)), x)
  auto = compiled_flops(lambda x: mo.newton_schulz(x), x)
  assert gram < 0.85 * standard and auto == gram, (gram, standard, auto)
  # The matmul counts account for what XLA compiles, up to elementwise work.
  for measured, formula in ((standard, newton_schulz_flops(*shape[-2:], NS(gram=False))),
                            (gram, newton_schulz_flops(*shape[-2:], NS(gram=True)))):
    assert 1.0 <= measured / (count * formula) < 1.1, (measured, formula)


def test_compiled_flops_square_stays_standard():
  x = jnp.ones((32, 32), jnp.float32)
  auto = compiled_flops(lambda x: mo.newton_schulz(x), x)
  assert auto == compiled_flops(lambda x: mo.newton_schulz(x, NS(gram=False)), x)
  assert auto < compiled_flops(lambda x: mo.newton_schulz(x, NS(gram=True)), x)


def test_flop_formulas_and_automatic_rule():
  m, n = 768, 3072
  # 5 steps, one restart before step 4 (∏|a| of 5 steps passes the gain): with whole
  # products 8 m²n + 28 m³, against 20 m²n + 10 m³. At m = 768 a symmetric product
  # (X Xᵀ, and every m×m one) is computed in 3 block rows: 2/3 of its whole flops.
  assert symmetric_flops(m, n) * 3 == 2 * m * m * n * 2
  jordan = NS("jordan", gram=True)
  gram = (4 * m * m * n + 28 * m**3) * 2 // 3 + 4 * m * m * n
  assert gram_flops(m, n, segments(5, (4,))) == gram
  assert newton_schulz_flops(m, n, jordan, backend="cpu") == gram
  standard = (10 * m * m * n + 10 * m**3) * 2 // 3 + 10 * m * m * n
  assert newton_schulz_flops(m, n, NS("jordan", gram=False)) == standard
  # Every product whole, as a mesh splitting the m×m products' rows runs them.
  whole = lambda ns: mo.newton_schulz_plan((m, n), ns, backend="cpu", symmetric=False).flops
  assert whole(jordan) == 8 * m * m * n + 28 * m**3
  assert whole(NS("jordan", gram=False)) == 20 * m * m * n + 10 * m**3
  assert newton_schulz_flops(n, m, NS("jordan"), backend="cpu") == gram_flops(m, n, segments(5, (4,)))
  for steps in (1, 2, 3, 5, 8):
    for ratio in (1, 1.5, 2, 3, 4, 8):
      g = newton_schulz_flops(64, int(64 * ratio), NS("jordan", steps=steps, gram=True))
      s = newton_schulz_flops(64, int(64 * ratio), NS("jordan", steps=steps, gram=False))
      assert (g < s) == (ratio > 1.5 and steps >= 2), (steps, ratio, g, s)
  f32 = "float32"
  assert use_gram(768, 768 * GRAM_MIN_ASPECT, 5, None, f32)
  assert not use_gram(768, 768 * GRAM_MIN_ASPECT - 1, 5, None, f32)
  assert not use_gram(768, 3072, 1, None, f32)
  assert not use_gram(768, 3072, 5, None, "bfloat16")
  assert use_gram(768, 3072, 5, None, "float16")
  assert use_gram(768, 768, 5, True, f32) and not use_gram(768, 3072, 5, False, f32)


def test_restarts_follow_the_growth_of_rounding():
  # A float32 segment ends before its ∏|a| passes the gain or its length passes
  # GRAM_SEGMENT_STEPS: turbo (∏|a| ≈ 232) is one segment, jordan's 3.44⁵ ≈ 485 and
  # polar_express's first 4 steps (≈ 429) are not.
  expected = {"turbo": ((0, 4),), "jordan": ((0, 4), (4, 5)),
              "polar_express": ((0, 3), (3, 5)), "cubic5": ((0, 4), (4, 5)),
              "deepseek_v4": ((0, 4), (4, 8), (8, 10))}
  for ns, parts in expected.items():
    segments_ = newton_schulz_plan((64, 256), NS(ns, gram=True), backend="cpu").segments
    assert segments_ == parts, (ns, segments_)
  plan = newton_schulz_plan((64, 256), NS(CONVERGENT, steps=20, gram=True), backend="cpu")
  assert plan.segments == tuple((k, k + 4) for k in range(0, 20, 4)), plan.segments
  steep = newton_schulz_plan((64, 256), NS([[8.0, -20, 12]], steps=6, gram=True), backend="cpu")
  assert steep.segments == ((0, 2), (2, 4), (4, 6)), steep.segments  # 8·8 ≤ 256 < 8³
  # A traced (injected) table cannot be read: restart every 2 steps, as for 16-bit operands.
  assert gram_restarts(None, 7, "float32") == (2, 4, 6)
  assert gram_restarts([2.0] * 7, 7, "bfloat16") == (2, 4, 6)



def test_a_shape_without_two_axes_is_a_clear_error():
  with pytest.raises(ValueError, match=r"newton_schulz_plan needs a shape \(\.\.\., m, n\)"):
    mo.newton_schulz_plan((64,))
  with pytest.raises(ValueError, match="custom fn"):
    mo.newton_schulz_plan((64, 64), NS(fn=lambda x: x))


@pytest.mark.parametrize("gram", [False, True])
def test_cubic_steps_skip_the_square_of_the_gram_matrix(gram):
  # cubic5: c = 0 every step, so no (X Xᵀ)² product; XLA's count matches the formula.
  m, n = 32, 128
  cubic, quintic = NS("cubic5", gram=gram), NS("jordan", gram=gram)
  x = jnp.ones((m, n), jnp.float32)
  measured = compiled_flops(lambda x: mo.newton_schulz(x, cubic), x)
  formula = newton_schulz_flops(m, n, cubic)
  assert formula == newton_schulz_flops(m, n, quintic) - 5 * 2 * m**3
  assert 1.0 <= measured / formula < 1.1, (measured, formula)


def test_float8_steps_are_planned_and_keep_the_standard_iteration():
  plan = newton_schulz_plan((768, 3072), NS(fp8_steps=2), backend="gpu")
  assert (plan.variant, plan.fp8_steps) == ("standard", 2)
  assert str(plan).endswith("first 2 steps float8_e4m3fn operands")
  assert plan.flops == newton_schulz_flops(768, 3072, NS(gram=False), backend="gpu")
