"""Scaling of the orthogonalized update: by the shape of each matrix of its view, or by
the dual norm ⟨M, O⟩ of the momentum."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muon_optax as mo
from muon_optax._scaling import shape_factor


def test_the_shape_factors():
  assert shape_factor("jordan", 64, 256) == 2.0 and shape_factor("jordan", 256, 64) == 1.0
  assert shape_factor("moonlight", 64, 256) == pytest.approx(0.2 * 16)
  assert shape_factor(None, 3, 5) == 1.0
  with pytest.raises(ValueError, match="unknown scale"):
    mo.scale_by_shape("rms")


@pytest.mark.parametrize("path, shape, view, factor", [
    ("w", (16, 64), None, 2.0),  # a Dense kernel
    ("stack/kernel", (3, 16, 64), None, 2.0),  # a scanned stack: per layer
    ("conv/kernel", (3, 3, 8, 16), None, 1.0),  # (3·3·8) × 16
    ("qkv", (16, 48), mo.MatrixView((), (0,), (1,), blocks=3), 1.0),  # three 16×16 blocks
])
def test_each_matrix_of_the_view_is_scaled_by_its_own_shape(path, shape, view, factor):
  routing = mo.Routing.from_rules([(".*", "muon")], views=(lambda p, s: view) if view else None)
  tx = mo.scale_by_shape("jordan", routing=routing)
  u, _ = tx.update({path: jnp.ones(shape)}, tx.init(None))
  np.testing.assert_allclose(u[path], factor)


def test_the_dual_norm_multiplies_by_the_inner_product_per_matrix():
  ks = jax.random.split(jax.random.key(0), 2)
  m = {"w": jax.random.normal(ks[0], (2, 8, 16))}
  tx = mo.scale_by_dual_norm(mo.orthogonalize(mo.NewtonSchulz(fn=lambda x: x / math.sqrt(2))))
  u, _ = tx.update(m, tx.init(m))
  for layer in range(2):  # a stack: one inner product per layer
    x = np.asarray(m["w"][layer], np.float64)
    o = x / math.sqrt(2)
    np.testing.assert_allclose(u["w"][layer], np.sum(x * o) * o, rtol=64 * np.finfo(np.float32).eps)
