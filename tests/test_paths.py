"""Tree paths: the '/'-joined names every routing and view decision is made on."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from muon_optax._util import paths


def test_names_join_dict_keys_sequence_indices_and_attributes():
  tree = {"blocks": [{"kernel": 1}, {"kernel": 2}], "head": (3,)}
  assert [p for p, _ in paths.leaves_with_path(tree)] == [
      "blocks/0/kernel", "blocks/1/kernel", "head/0"]


def test_an_nnx_variables_value_is_not_a_name():
  state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Param)
  assert sorted(p for p, _ in paths.leaves_with_path(state)) == ["bias", "kernel"]


def test_masked_placeholders_are_skipped_and_passed_through():
  tree = {"a": jnp.ones(2), "b": optax.MaskedNode()}
  assert [p for p, _ in paths.leaves_with_path(tree)] == ["a"]
  doubled = paths.map_with_path(lambda path, x: (path, x * 2), tree)
  assert doubled["b"] == optax.MaskedNode() and doubled["a"][0] == "a"
  assert paths.is_masked(tree["b"]) and not paths.is_masked(tree["a"])


def test_map_with_path_zips_further_trees():
  out = paths.map_with_path(lambda path, x, y: x + y, {"w": 1.0}, {"w": 2.0})
  assert out == {"w": 3.0}
  assert jax.tree.structure(out) == jax.tree.structure({"w": 0})
