"""The Muon leaves of a tree through their matrix views: the one loop every part that
works on matrices shares, and the wide stacks Newton–Schulz sees."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo
from muon_optax._routing.matrix_leaves import MatrixLeaves, from_wide, to_wide, unwide


def test_wide_stacks_round_trip_and_are_wide():
  key = jax.random.key(0)
  cases = [((8, 16), mo.MatrixView((), (0,), (1,))),  # wide
           ((16, 8), mo.MatrixView((), (0,), (1,))),  # tall: transposed
           ((3, 4, 6), mo.MatrixView((0,), (1,), (2,))),  # a stack of layers
           ((4, 12), mo.MatrixView((), (0,), (1,), blocks=3))]  # a fused projection
  for shape, view in cases:
    x = jax.random.normal(key, shape)
    wide = to_wide(x, view)
    assert wide.stack.shape[-2] <= wide.stack.shape[-1], shape
    assert wide.transposed == (view.matrix_shape(shape)[1] > view.matrix_shape(shape)[2])
    np.testing.assert_array_equal(from_wide(wide.stack, wide, shape), x)
    np.testing.assert_array_equal(unwide(wide.stack, wide), view.to_matrices(x))


def test_only_nonempty_unmasked_leaves_are_live_and_put_back_in_place():
  tree = {"a": jnp.ones((4, 8)), "b": optax.MaskedNode(), "c": jnp.ones((0, 8)),
          "d": jnp.full((2, 3, 5), 2.0)}
  leaves = MatrixLeaves.of(tree, mo.Routing.from_rules().view)
  assert [x.shape for x in leaves.arrays()] == [(4, 8), (2, 3, 5)]
  assert leaves.views == (mo.MatrixView((), (0,), (1,)), mo.MatrixView((0,), (1,), (2,)))
  out = leaves.put([-x for x in leaves.arrays()])
  np.testing.assert_array_equal(out["a"], -tree["a"])
  np.testing.assert_array_equal(out["d"], -tree["d"])
  assert isinstance(out["b"], optax.MaskedNode) and out["c"].shape == (0, 8)
  # A state that mirrors the tree: its live leaves are picked, the others kept.
  state = {"a": tree["a"] + 1, "b": optax.MaskedNode(), "c": tree["c"] + 1, "d": tree["d"] + 1}
  picked = leaves.pick(state)
  np.testing.assert_array_equal(picked[1], state["d"])
  kept = leaves.put([jnp.zeros((4, 8)), jnp.zeros((2, 3, 5))], state)
  assert kept["c"] is state["c"] and not np.any(kept["a"])


def test_params_are_picked_only_when_they_fit():
  tree = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 2))}
  leaves = MatrixLeaves.of(tree, mo.Routing.from_rules().view)
  assert [x.shape for x in leaves.pick_like(tree)] == [(4, 8), (8, 2)]
  assert leaves.pick_like(None) is None
  assert leaves.pick_like({"a": jnp.ones((4, 8))}) is None  # another structure
  assert leaves.pick_like({"a": jnp.ones((4, 8)), "b": jnp.ones((2, 8))}) is None


def test_a_leaf_without_a_view_is_named_even_when_empty():
  with pytest.raises(ValueError, match="'bias' of shape \\(0,\\) reached Muon"):
    MatrixLeaves.of({"bias": jnp.ones((0,))}, mo.Routing.from_rules().view)
  with pytest.raises(ValueError, match="'w' reached Muon with dtype int32"):
    MatrixLeaves.of({"w": jnp.ones((2, 2), jnp.int32)}, mo.Routing.from_rules().view)
