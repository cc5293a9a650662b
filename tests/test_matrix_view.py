"""Matrix views: how a leaf of any rank is a batch of (fan_in, fan_out) matrices."""


import jax
import numpy as np
import optax
import pytest

import muon_optax as mo


def test_attention_views_whole_and_per_head():
  q = mo.default_view("blocks/0/attn/query/kernel", (16, 2, 8))
  assert q.matrix_shape((16, 2, 8)) == (1, 16, 16)
  q = mo.default_view("blocks/0/attn/query/kernel", (16, 2, 8), per_head=True)
  assert q.matrix_shape((16, 2, 8)) == (2, 16, 8)
  o = mo.default_view("blocks/0/attn/out/kernel", (2, 8, 16))
  assert o.matrix_shape((2, 8, 16)) == (1, 16, 16)
  o = mo.default_view("blocks/0/attn/out/kernel", (2, 8, 16), per_head=True)
  assert o.matrix_shape((2, 8, 16)) == (2, 8, 16)
  # Scanned attention: a leading layer axis is a batch axis.
  assert mo.default_view("layers/attn/key/kernel", (4, 16, 2, 8)).matrix_shape(
      (4, 16, 2, 8)) == (4, 16, 16)


def test_view_round_trip_and_per_head_matrices_are_the_heads():
  x = jax.random.normal(jax.random.key(0), (3, 16, 2, 8))
  for per_head in (False, True):
    view = mo.default_view("layers/attn/query/kernel", x.shape, per_head=per_head)
    m = view.to_matrices(x)
    np.testing.assert_array_equal(view.from_matrices(m, x.shape), x)
  view = mo.default_view("attn/query/kernel", (16, 2, 8), per_head=True)
  m = view.to_matrices(x[0])
  np.testing.assert_array_equal(m[1], x[0][:, 1, :])


def test_attention_out_kernel_is_recognized_wherever_the_module_sits():
  view = mo.default_view("encoder/sa/out/kernel", (2, 8, 16))
  assert view.matrix_shape((2, 8, 16)) == (1, 16, 16)


# --- anchored name rules ------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 4), (3, 3, 3)])
def test_negative_view_axes(shape):
  x = jax.random.normal(jax.random.key(0), shape)
  negative = mo.MatrixView((-3,), (-1,), (-2,))
  positive = mo.MatrixView((0,), (2,), (1,))
  m = negative.to_matrices(x)
  np.testing.assert_array_equal(m, np.transpose(np.asarray(x), (0, 2, 1)))
  np.testing.assert_array_equal(negative.from_matrices(m, shape), x)
  routing = lambda view: mo.Routing.from_rules([(".*", "muon")], views=lambda p, s: view)
  a, _ = mo.orthogonalize(routing=routing(negative)).update({"w": x}, optax.EmptyState())
  b, _ = mo.orthogonalize(routing=routing(positive)).update({"w": x}, optax.EmptyState())
  np.testing.assert_array_equal(a["w"], b["w"])
  with pytest.raises(ValueError, match="exactly once"):
    mo.MatrixView((0,), (-1,), (2,)).matrix_shape(shape)
