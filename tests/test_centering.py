"""Where the 16-bit Gram-space iteration centres Q (`centering`): the minimax of the
weighted gains, and what it buys against the standard 16-bit iteration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import polar, rel

import muon_optax as mo
from muon_optax._newton_schulz.centering import gram_centers
from muon_optax._newton_schulz.variant import newton_schulz_plan


def scalar_maps(coeffs, sigma):
  """The grid carried through the steps, in float64: [σ, φ_0(σ), φ_1(φ_0(σ)), …]."""
  out = [np.asarray(sigma, np.float64)]
  for a, b, c in np.asarray(coeffs, np.float64):
    x = out[-1]
    out.append(a * x + b * x ** 3 + c * x ** 5)
  return out


@pytest.mark.parametrize("preset", ["turbo", "jordan", "polar_express"])
@pytest.mark.parametrize("smallest", [1e-7, 0.3])
def test_each_centre_is_the_minimax_of_the_weighted_gains(preset, smallest):
  # Against a brute force in float64 over 20001 candidate centres: the centre's largest
  # weighted deviation, |q − c| · later gain / √σ over the singular values from
  # `smallest` to 1, is the least any centre reaches, up to float32's rounding of the
  # gains (a few units in the last place a step, 64 in all) times the largest weight.
  # The bound sits 1e-5 above the smallest singular value's gain, so that float32 and
  # float64 keep the same singular values.
  ns = mo.NewtonSchulz(preset, gram=True, compute_dtype="bfloat16")
  coeffs, segments = ns.coefficients(), newton_schulz_plan((64, 256), ns).segments
  sigma = np.geomspace(1e-7, 1.0, 1024)
  maps = scalar_maps(coeffs, sigma)
  first = maps[segments[0][1]] / maps[segments[0][0]]
  bound = first[np.searchsorted(sigma, smallest)] * (1 + 1e-5)
  centers = gram_centers(coeffs, segments, jnp.full((1, 1), bound, jnp.float32))
  valid = (first <= bound) | (first == first.min())
  for (start, stop), c in zip(segments, centers):
    gain, weight = maps[stop] / maps[start], maps[-1] / maps[stop] / np.sqrt(sigma)
    gain, weight = gain[valid], weight[valid]
    worst = lambda c: np.max(np.abs(gain - c) * weight)
    best = min(worst(k) for k in np.linspace(gain.min(), gain.max(), 20001))
    assert worst(float(c[0, 0])) <= best + 64 * 2.0**-24 * gain.max() * weight.max()


def test_a_well_conditioned_spectrum_moves_the_centre_off_the_largest_gain():
  # With every singular value above 0.3 the gains the iteration meets stop well short of
  # ∏a = q(0), where a bound at q(0) (singular values down to 0) keeps the centre.
  ns = mo.NewtonSchulz("turbo", gram=True, compute_dtype="bfloat16")
  coeffs, segments = ns.coefficients(), newton_schulz_plan((64, 256), ns).segments
  q0 = float(np.prod(np.asarray(coeffs)[segments[0][0]:segments[0][1], 0]))
  whole = gram_centers(coeffs, segments, jnp.full((1, 1), 2 * q0, jnp.float32))[0]
  sigma = np.geomspace(1e-7, 1.0, 1024)
  maps = scalar_maps(coeffs, sigma)
  first = maps[segments[0][1]] / maps[segments[0][0]]
  tight = gram_centers(coeffs, segments,
                       jnp.full((1, 1), first[np.searchsorted(sigma, 0.3)], jnp.float32))[0]
  assert float(tight[0, 0]) < 0.5 * float(whole[0, 0]) < q0


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float16"])
def test_centred_16_bit_gram_space_against_the_standard_iteration_on_gaussian_inputs(
    compute_dtype):
  # Gaussian 64×256 matrices, turbo: with bfloat16 operands the Gram-space iteration,
  # centred, lands nearer U Vᵀ than the standard iteration, and far nearer the float64
  # polynomial; with float16's, where both are within float16's rounding of float32's
  # result, within a unit roundoff of it.
  x = jax.random.normal(jax.random.key(0), (8, 64, 256))
  run = lambda gram, dtype: np.asarray(jax.jit(lambda x: mo.newton_schulz(
      x, mo.NewtonSchulz("turbo", gram=gram, compute_dtype=dtype)))(x), np.float64)
  with jax.enable_x64(True):
    exact = np.asarray(mo.newton_schulz(jnp.asarray(x, jnp.float64), mo.NewtonSchulz(
        "turbo", gram=False, compute_dtype="float64")))
  gram, standard, p = run(True, compute_dtype), run(False, compute_dtype), polar(x)
  mean = lambda a, b: float(np.mean(rel(a, b)))
  if compute_dtype == "bfloat16":
    assert mean(gram, p) <= mean(standard, p)
    assert mean(gram, exact) < 0.5 * mean(standard, exact)
  else:
    assert mean(gram, p) <= mean(standard, p) + 2.0**-11
