"""Where the 16-bit Gram-space iteration centres Q (`centering`): the weighted mean of
its eigenvalues read from two traces, and what it buys against the standard 16-bit
iteration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import polar, rel

import muon_optax as mo
from muon_optax._newton_schulz.centering import gram_center
from muon_optax._newton_schulz.variant import newton_schulz_plan


def scalar_maps(coeffs, sigma):
  """The grid carried through the steps, in float64: [σ, φ_0(σ), φ_1(φ_0(σ)), …]."""
  out = [np.asarray(sigma, np.float64)]
  for a, b, c in np.asarray(coeffs, np.float64):
    x = out[-1]
    out.append(a * x + b * x ** 3 + c * x ** 5)
  return out


@pytest.mark.parametrize("preset", ["turbo", "jordan", "polar_express"])
def test_each_centre_is_its_weighted_mean_eigenvalue(preset):
  # A symmetric Q whose eigenvalues are a segment's gains at 64 singular values from
  # 1e-6 to 1, as the iteration meets them: from its two traces, an earlier apply's
  # centre must be Σ q² / Σ q and the last one's the mean, computed from the eigenvalues
  # in float64; float32 sums of 64 positive terms round within 64 units.
  ns = mo.NewtonSchulz(preset, gram=True, compute_dtype="bfloat16")
  coeffs, segments = ns.coefficients(), newton_schulz_plan((64, 256), ns).segments
  maps = scalar_maps(coeffs, np.geomspace(1e-6, 1.0, 64))
  basis, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((64, 64)))
  for k, (start, stop) in enumerate(segments):
    q = maps[stop] / maps[start]
    matrix = (basis * q) @ basis.T
    last = k + 1 == len(segments)
    center = gram_center(jnp.float32(np.trace(matrix) / 64),
                         jnp.float32(np.sum(matrix ** 2) / 64), last)
    expected = np.mean(q) if last else np.sum(q * q) / np.sum(q)
    np.testing.assert_allclose(float(center), expected, rtol=64 * 2.0**-24)
    assert q.min() < float(center) < q.max()


def heavy_tailed(key, shape):
  """Student-t (3 degrees of freedom) entries times a column scale log-spaced from 1 to
  1e-3, as the precision table's heavy-tailed class."""
  return jax.random.t(key, 3.0, shape) * jnp.geomspace(1.0, 1e-3, shape[-1])


@pytest.mark.parametrize("kind", ["gaussian", "heavy-tailed"])
@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float16"])
def test_centred_16_bit_gram_space_against_the_standard_iteration(compute_dtype, kind):
  # 32 matrices 64×256, turbo: with bfloat16 operands the Gram-space iteration, centred,
  # lands at least as near U Vᵀ as the standard iteration, and nearer the float64
  # polynomial (far nearer on Gaussian inputs); with float16's, where both are within
  # float16's rounding of float32's result, within a unit roundoff of it.
  shape = (32, 64, 256)
  x = (jax.random.normal(jax.random.key(0), shape) if kind == "gaussian"
       else heavy_tailed(jax.random.key(1), shape))
  run = lambda gram, dtype: np.asarray(jax.jit(lambda x: mo.newton_schulz(
      x, mo.NewtonSchulz("turbo", gram=gram, compute_dtype=dtype)))(x), np.float64)
  with jax.enable_x64(True):
    exact = np.asarray(mo.newton_schulz(jnp.asarray(x, jnp.float64), mo.NewtonSchulz(
        "turbo", gram=False, compute_dtype="float64")))
  gram, standard, p = run(True, compute_dtype), run(False, compute_dtype), polar(x)
  mean = lambda a, b: float(np.mean(rel(a, b)))
  if compute_dtype == "bfloat16":
    assert mean(gram, p) <= mean(standard, p)
    assert mean(gram, exact) < (0.5 if kind == "gaussian" else 1) * mean(standard, exact)
  else:
    assert mean(gram, p) <= mean(standard, p) + 2.0**-11
