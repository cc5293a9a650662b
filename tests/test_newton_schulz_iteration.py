"""newton_schulz against the SVD polar factor U Vᵀ, and its numerical guarantees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import float32_bound, polar, rel, singular_values

import muon_optax as mo
from muon_optax._newton_schulz.iteration import newton_schulz_column_parts
from muon_optax._newton_schulz.row_blocks import RowBlocks

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


@pytest.mark.parametrize("ns", ["turbo", "jordan", "polar_express"])
@pytest.mark.parametrize("gram", [False, True])
def test_row_blocks_equal_the_whole_matrix(ns, gram):
  # Column parts whose m×m matrices are split by rows too: each part keeps its block of
  # rows, Gram sums are reduce-scattered and whole matrices all-gathered, as devices do.
  x = well_conditioned(jax.random.key(8), (2, 16, 64))
  reduce = lambda v, op: (jax.lax.psum if op is jnp.add else jax.lax.pmax)(v, "part")
  rows = lambda v: jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index("part") * (v.shape[-2] // 4),
                                                v.shape[-2] // 4, axis=v.ndim - 2)
  blocks = RowBlocks(
      lambda v: jax.lax.psum_scatter(v, "part", scatter_dimension=v.ndim - 2, tiled=True),
      lambda v: jax.lax.all_gather(v, "part", axis=v.ndim - 2, tiled=True), rows,
      lambda v: jnp.swapaxes(jax.lax.all_to_all(v, "part", v.ndim - 1, v.ndim - 2, tiled=True),
                             -1, -2))
  parts = jnp.stack(jnp.split(x, 4, axis=-1))
  split = jax.vmap(lambda p: newton_schulz_column_parts(p, 4, reduce, NS(ns, gram=gram), blocks),
                   axis_name="part")(parts)
  whole = mo.newton_schulz(x, NS(ns, gram=gram))
  assert np.all(rel(jnp.concatenate(list(split), axis=-1), whole) < 2 * float32_bound(ns))


def test_bad_inputs():
  with pytest.raises(ValueError, match="floating"):
    mo.newton_schulz(jnp.ones((4, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
    mo.newton_schulz(jnp.ones(4))




# Matrices with σ (after the preset's scaling) spread over the interval each schedule
# claims, and the band it claims they land in (tests/test_newton_schulz_settings.py
# checks the same claims on the scalar map).
CLAIMED = {"deepseek_v4": (1e-4, 1.0 - 1e-12, 1.0021), "cubic5": (1e-2, 0.774, 1.3)}


@pytest.mark.parametrize("ns", sorted(CLAIMED))
@pytest.mark.parametrize("gram", [False, True])
def test_new_presets_land_in_their_claimed_band(ns, gram):
  floor, low, high = CLAIMED[ns]
  rng = np.random.default_rng(0)
  m, n = 32, 96
  u, _ = np.linalg.qr(rng.standard_normal((m, m)))
  v, _ = np.linalg.qr(rng.standard_normal((n, m)))
  # ‖σ‖₂ = 1, so that Frobenius scaling keeps them: [floor, 0.3] and one near 1.
  sigma = np.geomspace(floor, 0.3, m - 1)
  sigma = np.concatenate([[np.sqrt(1 - np.sum(sigma**2))], sigma])
  x = jnp.asarray(7.0 * (u * sigma) @ v.T, jnp.float32)
  out = jax.jit(lambda x: mo.newton_schulz(x, NS(ns, gram=gram)))(x)
  # The float64 polynomial on the float32 input: in the claimed band; float32 within
  # the a priori bound of it.
  exact = u @ np.diag(sigma) @ v.T
  for a, b, c in NS(ns).coefficients():
    g = exact @ exact.T
    exact = a * exact + (b * g + c * g @ g) @ exact
  s = singular_values(exact)
  assert s.min() > low and s.max() < high, (s.min(), s.max())
  assert rel(out, exact) < float32_bound(ns), rel(out, exact)


# Not turbo: its first step's b R + c R² cancels to about 1 from terms near 21 and 14,
# so float8's 2^-4 rounding of R² is of the size of the result
# (benchmarks/results/newton_schulz_precision.txt has its polar error).
@pytest.mark.parametrize("ns", ["jordan"])
def test_float8_steps_read_float8_and_later_steps_keep_the_band(ns):
  x = well_conditioned(jax.random.key(4), (32, 96))
  settings = NS(ns, fp8_steps=2)
  f = jax.jit(lambda x: mo.newton_schulz(x, settings))
  assert "f8_e4m3fn" in str(jax.make_jaxpr(f)(x))
  out = f(x)
  assert out.dtype == x.dtype and np.all(np.isfinite(out))
  # The last steps run in float32 on whatever the float8 ones left: σ cannot exceed the
  # largest value their scalar map takes on [0, 1.25] (float64).
  sigma = np.linspace(0, 1.25, 100_001)
  for a, b, c in np.asarray(NS(ns).coefficients())[2:]:
    sigma = a * sigma + b * sigma**3 + c * sigma**5
  assert singular_values(out).max() <= sigma.max() + float32_bound(ns)
  # Same singular vectors as U Vᵀ, up to e4m3's rounding (unit roundoff 2^-4) of the
  # early iterates, which the band then bounds.
  assert rel(out, polar(x)) < rel(mo.newton_schulz(x, NS(ns)), polar(x)) + 2.0**-4 * 4
  np.testing.assert_array_equal(mo.newton_schulz(x, NS(ns, fp8_steps=0)),
                                mo.newton_schulz(x, NS(ns)))


def test_float8_steps_scale_invariant_zero_and_finite():
  f = jax.jit(lambda x: mo.newton_schulz(x, NS("jordan", fp8_steps=3)))
  x = jax.random.normal(jax.random.key(5), (2, 12, 40))
  ref = f(x)
  for k in (1e-30, 1e-8, 1e8, 1e30):  # powers-of-two scaling: exact
    assert np.all(np.isfinite(f(x * k)))
    assert np.all(rel(f(x * k), ref) < 0.05), k
  assert np.array_equal(f(jnp.zeros((2, 12, 40))), np.zeros((2, 12, 40)))
  assert np.all(np.isfinite(f(jnp.full((12, 40), np.finfo(np.float32).max))))
