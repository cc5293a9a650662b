"""The second moment of the orthogonalized update: its statistic's shape, the
normalization and the rescaling, against their equations; the selected-only update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muon_optax as mo

EPS32 = np.finfo(np.float32).eps


def test_the_statistic_is_one_per_output_neuron_or_per_element():
  params = {"w": jnp.ones((8, 16)), "stack": jnp.ones((3, 8, 16)), "conv": jnp.ones((3, 3, 4, 16))}
  routing = mo.Routing.from_rules([(".*", "muon")])
  neurons = mo.scale_by_second_moment("neurons", routing=routing).init(params).nu
  assert {k: v.shape for k, v in neurons.items()} == {
      "w": (1, 16), "stack": (3, 1, 16), "conv": (1, 1, 1, 16)}
  elements = mo.scale_by_second_moment("elements", routing=routing).init(params).nu
  assert elements["w"].shape == (8, 16) and elements["w"].dtype == jnp.float32


@pytest.mark.parametrize("over, rescale", [("neurons", "norm"), ("elements", "rms")])
def test_two_steps_against_the_equations(over, rescale):
  b2, eps = 0.9, 1e-8
  o = [jax.random.normal(jax.random.key(i), (8, 16)) for i in range(2)]
  tx = mo.scale_by_second_moment(over, b2=b2, eps=eps, rescale=rescale)
  state, v = tx.init({"w": o[0]}), 0.0
  for t, x in enumerate(o, start=1):
    u, state = tx.update({"w": x}, state)
    x = np.asarray(x, np.float64)
    square = np.mean(x * x, axis=0, keepdims=True) if over == "neurons" else x * x
    v = b2 * v + (1 - b2) * square
    normalized = x / (np.sqrt(v / (1 - b2**t)) + eps)
    target = np.linalg.norm(x) if rescale == "norm" else np.sqrt(8)
    want = normalized * target / np.linalg.norm(normalized)
    np.testing.assert_allclose(u["w"], want, rtol=0, atol=64 * EPS32 * np.abs(want).max())


def test_selected_only_keeps_the_statistic_of_neurons_left_out():
  x = jax.random.normal(jax.random.key(0), (8, 16))
  chosen = x.at[:, 4:].set(0.0)  # neurons 4..15 not selected this step
  tx = mo.scale_by_second_moment("neurons", selected_only=True)
  state = tx.init({"w": x})
  _, state = tx.update({"w": x}, state)
  before = np.asarray(state.nu["w"])
  u, state = tx.update({"w": chosen}, state)
  after = np.asarray(state.nu["w"])
  np.testing.assert_array_equal(after[:, 4:], before[:, 4:])
  assert np.all(after[:, :4] != before[:, :4]) and not np.any(np.asarray(u["w"])[:, 4:])


def test_a_fused_view_rescales_each_block_to_its_own_norm():
  routing = mo.Routing.from_rules([(".*", "muon")],
                                  views=lambda p, s: mo.MatrixView((), (0,), (1,), blocks=2))
  x = jnp.concatenate([jnp.ones((4, 4)), 3 * jnp.ones((4, 4))], axis=1)
  tx = mo.scale_by_second_moment("elements", rescale="rms", routing=routing)
  u, _ = tx.update({"w": x}, tx.init({"w": x}))
  for block in (u["w"][:, :4], u["w"][:, 4:]):  # each a 4×4 matrix of norm √4
    np.testing.assert_allclose(jnp.linalg.norm(block), 2.0, rtol=16 * EPS32)
