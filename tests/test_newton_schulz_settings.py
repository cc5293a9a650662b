"""`NewtonSchulz`: one validated, comparable value for the iteration's settings, and the
coefficient table it resolves to."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muon_optax as mo

NS = mo.NewtonSchulz


def test_custom_schedule_repeats_last_row_and_never_wraps():
  rows = np.array([[3.0, -3.2, 1.2], [2.0, -1.5, 0.5]])
  x = jax.random.normal(jax.random.key(6), (8, 16))
  explicit = np.array([[3.0, -3.2, 1.2], [2.0, -1.5, 0.5], [2.0, -1.5, 0.5], [2.0, -1.5, 0.5]])
  np.testing.assert_allclose(mo.newton_schulz(x, NS(rows, steps=4)),
                             mo.newton_schulz(x, NS(explicit, steps=4)), atol=0)
  # The last polar express row is used for every step past the table.
  table = NS("polar_express", steps=12).coefficients()
  np.testing.assert_allclose(table[8:], [[1.875, -1.25, 0.375]] * 4)
  assert not np.allclose(table[8], table[0])


@pytest.mark.parametrize("bad, match", [
    ("newton", "unknown Newton–Schulz preset"),
    (np.ones((2, 2)), r"shape \(n, 3\)"),
    (np.ones((0, 3)), r"shape \(n, 3\)"),
    (np.array([[1.0, np.nan, 0.0]]), "finite"),
    ("not a schedule", "unknown"),
])
def test_malformed_schedule_is_a_clear_error(bad, match):
  with pytest.raises(ValueError, match=match):
    mo.NewtonSchulz(bad)
  with pytest.raises(ValueError, match=match):
    mo.newton_schulz(jnp.ones((4, 4)), bad)


@pytest.mark.parametrize("settings, match", [
    (dict(steps=0), "steps must be a positive Python int"),
    (dict(steps=2.5), "steps must be a positive Python int"),
    (dict(steps=True), "steps must be a positive Python int"),
    (dict(gram="yes"), "gram must be True, False or None"),
    (dict(precondition="spectral"), "precondition must be one of"),
    (dict(compute_dtype=jnp.int8), "compute_dtype must be 'auto' or a floating dtype"),
    (dict(compute_dtype="fast"), "compute_dtype must be 'auto' or a floating dtype"),
    (dict(precision="bogus"), "precision must be 'auto'"),
    (dict(fn="svd"), "fn must be a function"),
    (dict(fn=lambda x: x, steps=3), r"fn replaces the built-in iteration, so \['steps'\]"),
])
def test_every_setting_is_checked_when_built(settings, match):
  with pytest.raises(ValueError, match=match):
    mo.NewtonSchulz(**settings)


def test_settings_are_one_comparable_value():
  assert NS("jordan", steps=5) == NS("jordan", steps=np.int64(5))
  assert NS(np.asarray(mo.PRESETS["jordan"].table)) == NS([[3.4445, -4.7750, 2.0315]])
  assert NS(compute_dtype="float32") == NS(compute_dtype=jnp.float32)
  assert hash(NS("turbo")) == hash(NS())



def test_auto_operands_and_precision_fixed_for_a_platform():
  # What runs on a mesh takes the defaults of the mesh's devices, not jax's backend.
  tpu, cpu = mo.NewtonSchulz().on("tpu"), mo.NewtonSchulz().on("cpu")
  assert (tpu.dtype(), tpu.matmul_precision("cpu")) == (jnp.bfloat16, jax.lax.Precision.DEFAULT)
  assert (cpu.dtype("tpu"), cpu.matmul_precision("tpu")) == (jnp.float32,
                                                              jax.lax.Precision.HIGHEST)
  given = mo.NewtonSchulz(compute_dtype="float32", precision="high")
  assert given.on("tpu") == given  # settings given stay as given


def composed(table, sigma):
  """The scalar map σ ← aσ + bσ³ + cσ⁵ of every row, in float64."""
  for a, b, c in np.asarray(table, np.float64):
    sigma = a * sigma + b * sigma**3 + c * sigma**5
  return sigma


def test_deepseek_v4_is_eight_jordan_steps_then_two_that_pin_sigma_at_one():
  # DeepSeek-V4's schedule: 8 × (3.4445, −4.775, 2.0315), then 2 × (2, −1.5, 0.5).
  ns = NS("deepseek_v4")
  assert (ns.num_steps(), ns.preconditioner(), ns.safety()) == (10, "frobenius", 1.0)
  np.testing.assert_array_equal(ns.coefficients(),
                                [[3.4445, -4.775, 2.0315]] * 8 + [[2.0, -1.5, 0.5]] * 2)
  # Its claim: Jordan's steps bring σ into his band, the last two pin it at 1.
  sigma = np.geomspace(1e-4, 1, 100_001)
  assert composed(ns.coefficients()[:8], sigma).min() > 0.68
  out = composed(ns.coefficients(), sigma)
  assert out.min() > 1 - 1e-12 and out.max() < 1.0021, (out.min(), out.max())


def test_cubic5_is_five_cubic_steps_into_muons_loose_band():
  # arXiv 2606.00371: five (a, b) rows with no quintic term.
  ns = NS("cubic5")
  assert (ns.num_steps(), ns.preconditioner(), ns.safety()) == (5, "frobenius", 1.0)
  np.testing.assert_array_equal(ns.coefficients(), [
      [3.3656576, -3.3420992, 0.0], [2.5744352, -1.4957376, 0.0],
      [2.5368962, -1.4312570, 0.0], [2.4418906, -1.2764040, 0.0],
      [2.2230472, -0.9630650, 0.0]])
  # Its band: σ in [1e-2, 1] lands in [0.774, 1.3]; the schedule touches 1.3 and no more.
  out = composed(ns.coefficients(), np.geomspace(1e-2, 1, 100_001))
  assert out.min() > 0.774 and out.max() <= 1.3, (out.min(), out.max())
  assert composed(ns.coefficients(), np.linspace(0, 1, 100_001)).max() > 1.2999


@pytest.mark.parametrize("settings, match", [
    (dict(fp8_steps=4), r"fp8_steps must be a Python int from 0 to steps - 1 \(3\)"),
    (dict(fp8_steps=-1), "fp8_steps must be"),
    (dict(fp8_steps=1.0), "fp8_steps must be"),
    (dict(fp8_steps=True), "fp8_steps must be"),
    (dict(fp8_steps=1, gram=True), "fp8_steps run in the standard iteration"),
    (dict(fp8_steps=1, fn=lambda x: x), r"so \['fp8_steps'\] would be ignored"),
])
def test_float8_steps_are_checked_when_built(settings, match):
  with pytest.raises(ValueError, match=match):
    mo.NewtonSchulz(**settings)


def test_auto_operands_per_platform():
  assert NS().on("gpu").compute_dtype == jnp.bfloat16
  assert NS().on("tpu").compute_dtype == jnp.bfloat16
  assert NS().on("cpu").compute_dtype == jnp.float32
