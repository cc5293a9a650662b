"""newton_schulz against the SVD polar factor U Vᵀ, and its numerical guarantees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import float32_bound, polar, rel, singular_values

import muon_optax as mo
from muon_optax._newton_schulz.iteration import newton_schulz_column_parts
from muon_optax._newton_schulz.plan import newton_schulz_flops, newton_schulz_plan

NS = mo.NewtonSchulz

def well_conditioned(key, shape):
  """Random matrices whose singular values span [0.1, 1]: the regime Muon runs in."""
  *batch, m, n = shape
  k = min(m, n)
  k1, k2 = jax.random.split(key)
  u, _ = jnp.linalg.qr(jax.random.normal(k1, (*batch, m, k)))
  v, _ = jnp.linalg.qr(jax.random.normal(k2, (*batch, n, k)))
  s = jnp.linspace(0.1, 1.0, k)
  return (u * s) @ jnp.swapaxes(v, -1, -2)


@pytest.mark.parametrize("shape", [(32, 32), (16, 48), (48, 16), (3, 16, 24)])
def test_jordan_band_and_alignment_with_polar_factor(shape):
  x = well_conditioned(jax.random.key(0), shape)
  out = jax.jit(lambda x: mo.newton_schulz(x, NS("jordan", steps=5)))(x)
  assert out.shape == x.shape and out.dtype == x.dtype
  for o, g in zip(np.reshape(out, (-1, *shape[-2:])), np.reshape(x, (-1, *shape[-2:]))):
    s = singular_values(o)
    assert s.min() > 0.6 and s.max() < 1.2, s
    # Same singular vectors as U Vᵀ: the output is U diag(f(σ)) Vᵀ with f(σ) ≈ 1.
    p = polar(g)
    assert np.linalg.norm(o - p) / np.linalg.norm(p) < 0.35


def test_polar_express_is_closer_to_polar_factor_than_jordan():
  x = well_conditioned(jax.random.key(1), (64, 128))
  p = polar(x)
  err = {ns: np.linalg.norm(mo.newton_schulz(x, NS(ns, steps=5)) - p) / np.linalg.norm(p)
         for ns in ("jordan", "polar_express")}
  assert err["polar_express"] < 0.5 * err["jordan"], err
  s = {ns: singular_values(mo.newton_schulz(x, NS(ns, steps=5))) for ns in err}
  assert s["polar_express"].min() > 0.85 and s["polar_express"].max() < 1.15, s
  assert np.abs(s["polar_express"] - 1).max() < np.abs(s["jordan"] - 1).max()


def test_polar_express_converges_with_more_steps():
  x = well_conditioned(jax.random.key(2), (32, 64))
  out = mo.newton_schulz(x, NS("polar_express", steps=10))
  np.testing.assert_allclose(out, polar(x), atol=2e-3)


def test_bfloat16_input_gives_bfloat16_output_in_band():
  x = well_conditioned(jax.random.key(3), (32, 64)).astype(jnp.bfloat16)
  out = jax.jit(lambda x: mo.newton_schulz(x, NS(steps=5)))(x)
  assert out.dtype == jnp.bfloat16
  s = singular_values(out.astype(jnp.float32))
  assert s.min() > 0.6 and s.max() < 1.2, s


@pytest.mark.parametrize("ns", ["jordan", "polar_express", "turbo"])
def test_scale_invariance_and_zero(ns):
  x = jax.random.normal(jax.random.key(4), (24, 40))
  f = jax.jit(lambda x: mo.newton_schulz(x, NS(ns, steps=5)))
  ref = f(x)
  for k in (1e-30, 1e-20, 1e-8, 1e8, 1e20, 1e30):
    out = f(x * k)
    assert np.all(np.isfinite(out)), k
    # x·k and the normalization round at relative size eps32: within twice the bound.
    assert rel(out, ref) < 2 * float32_bound(NS(ns, steps=5)), k
  zero = f(jnp.zeros((24, 40)))
  assert np.array_equal(zero, np.zeros((24, 40)))


def test_no_nan_on_degenerate_inputs():
  f = jax.jit(lambda x: mo.newton_schulz(x, NS(steps=5)))
  rank_one = jnp.outer(jnp.arange(1.0, 9.0), jnp.ones(16))
  tiny = jnp.full((8, 16), np.finfo(np.float32).tiny)
  huge = jnp.full((8, 16), np.finfo(np.float32).max)
  for x in (rank_one, tiny, huge, jnp.eye(8, 16)):
    assert np.all(np.isfinite(f(x)))


def test_batched_equals_one_by_one():
  x = jax.random.normal(jax.random.key(5), (4, 16, 24))
  batched = mo.newton_schulz(x)
  for i in range(4):
    # Batched and single matmuls may round differently; each is within the bound.
    assert rel(batched[i], mo.newton_schulz(x[i])) < 2 * float32_bound()


@pytest.mark.parametrize("ns", ["turbo", "jordan", "polar_express"])
@pytest.mark.parametrize("gram", [None, False, True])
def test_column_parts_equal_the_whole_matrix(ns, gram):
  # Four column parts, the sums over columns reduced across a named vmap axis as
  # devices would: each part of the result is that part of the whole result.
  x = well_conditioned(jax.random.key(7), (2, 16, 64))
  reduce = lambda v, op: (jax.lax.psum if op is jnp.add else jax.lax.pmax)(v, "part")
  parts = jnp.stack(jnp.split(x, 4, axis=-1))
  split = jax.vmap(lambda p: newton_schulz_column_parts(p, 4, reduce, NS(ns, gram=gram)),
                   axis_name="part")(parts)
  whole = mo.newton_schulz(x, NS(ns, gram=gram))
  # Only the order of the column sums differs: within the float32 evaluation bound.
  assert np.all(rel(jnp.concatenate(list(split), axis=-1), whole) < 2 * float32_bound(ns))


@pytest.mark.parametrize("gram", [False, True])
def test_row_split_m_by_m_products_equal_the_whole_matrix(gram):
  # Column parts whose m×m products are split by rows too: each part computes its
  # block of rows of every m×m product and gathers the others', as devices would.
  x = well_conditioned(jax.random.key(8), (2, 16, 64))
  reduce = lambda v, op: (jax.lax.psum if op is jnp.add else jax.lax.pmax)(v, "part")

  def rows(product):
    def split(a, b):
      h = a.shape[-2] // 4
      block = jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index("part") * h, h, axis=-2)
      return jax.lax.all_gather(product(block, b), "part", axis=a.ndim - 2, tiled=True)
    return split

  parts = jnp.stack(jnp.split(x, 4, axis=-1))
  split = jax.vmap(lambda p: newton_schulz_column_parts(p, 4, reduce, NS(gram=gram), rows),
                   axis_name="part")(parts)
  whole = mo.newton_schulz(x, NS(gram=gram))
  assert np.all(rel(jnp.concatenate(list(split), axis=-1), whole) < 2 * float32_bound())


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


def test_bad_inputs():
  with pytest.raises(ValueError, match="floating"):
    mo.newton_schulz(jnp.ones((4, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
    mo.newton_schulz(jnp.ones(4))
  with pytest.raises(ValueError, match=r"newton_schulz_plan needs a shape \(\.\.\., m, n\)"):
    mo.newton_schulz_plan((64,))


def test_auto_dtype_and_precision_follow_the_platform():
  cpu = newton_schulz_plan((768, 3072), backend="cpu")
  assert (cpu.variant, cpu.steps, cpu.precondition) == ("gram", 4, "aol")
  assert (cpu.compute_dtype, cpu.precision) == ("float32", "HIGHEST")
  for backend in ("gpu", "tpu"):
    plan = newton_schulz_plan((768, 3072), backend=backend)
    # 16-bit operands keep the standard iteration (see use_gram).
    assert (plan.variant, plan.compute_dtype, plan.precision) == (
        "standard", "bfloat16", "DEFAULT")
    assert plan.flops == newton_schulz_flops(768, 3072, NS(gram=False), backend="cpu")
  explicit = newton_schulz_plan((3072, 768), NS("jordan", compute_dtype="float32",
                                                precision="highest"), backend="gpu")
  assert (explicit.variant, explicit.steps, explicit.precondition) == ("gram", 5, "frobenius")
  assert str(explicit).startswith("gram · 5 steps · frobenius · float32")
  # On this test's CPU backend "auto" is float32: identical to asking for it.
  x = jax.random.normal(jax.random.key(7), (16, 48))
  np.testing.assert_array_equal(mo.newton_schulz(x), mo.newton_schulz(
      x, NS(compute_dtype="float32", precision="highest")))
