"""Label trees as `optax.partition` takes them (`labels`): the params' structure or a
prefix of it, one label for all, never rules; and every leaf checked against its label."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo
from muon_optax._routing.labels import check_labels, expand_labels
from muon_optax._routing.name_rules import LABELS


def test_label_pytree_must_match_params():
  params = {"a": {"kernel": jnp.zeros((4, 4))}}
  with pytest.raises(ValueError, match="label tree does not match"):
    mo.muon(routing={"b": "muon"}).init(params)


def test_label_tree_of_tuples_is_a_label_tree_not_rules():
  params = [(jnp.ones((4, 3)), jnp.ones(3)), (jnp.ones((3, 2)), jnp.ones(2))]
  tx = mo.muon(1.0, routing=[("muon", "adam"), ("adam", "adam")])
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  u, _ = tx.update(grads, tx.init(params), params)
  adam = optax.adamw(3e-4, weight_decay=0.0)
  ua, _ = adam.update(grads, adam.init(params), params)
  np.testing.assert_allclose(u[1][0], ua[1][0])
  assert not np.allclose(u[0][0], ua[0][0])  # the Muon leaf


def test_label_tree_may_be_a_prefix_of_params_as_in_optax_partition():
  params = {"w1": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}, "w2": jnp.ones((4, 4))}
  labels = {"w1": "adam", "w2": "muon"}
  tx = mo.muon(0.1, routing=labels)
  u, _ = tx.update(params, tx.init(params), params)
  adamw = optax.adamw(3e-4, weight_decay=0.0)
  ref = optax.partition({"adam": adamw, "muon": optax.set_to_zero()}, labels)
  ur, _ = ref.update(params, ref.init(params), params)
  np.testing.assert_allclose(u["w1"]["kernel"], ur["w1"]["kernel"])
  assert "given label" in mo.describe(params, routing=labels)


def test_tree_map_params_works_on_a_single_label():
  params = {"w": jnp.ones((4, 4)), "v": jnp.ones((4, 2))}
  tx = mo.muon(routing="muon")
  state = tx.init(params)
  mapped = optax.tree.map_params(tx, lambda v: v + 1, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)


def test_rules_go_through_routing_from_rules_never_labels():
  params = {"mlp": {"kernel": jnp.zeros((4, 4))}}
  rules = [("mlp", "adam"), *mo.DEFAULT_RULES]
  with pytest.raises(ValueError, match=r"looks like routing rules: pass routing=muon_optax"
                     r"\.Routing\.from_rules"):
    mo.muon(routing=rules).init(params)
  assert mo.Routing.from_rules(rules).labels(params) == {"mlp": {"kernel": "adam"}}
  mo.muon(routing=mo.Routing.from_rules(rules)).init(params)


def test_labels_spread_to_each_leaf_and_every_check_names_the_path():
  params = {"w": jnp.ones((4, 4)), "step": jnp.zeros((), jnp.int32), "b": jnp.ones(4)}
  assert expand_labels({"w": "muon", "step": "frozen", "b": "adam"}, params) == {
      "w": "muon", "step": "frozen", "b": "adam"}
  views = mo.Routing.from_rules().view
  check_labels({"w": "muon", "step": "frozen", "b": "adam"}, params, views, LABELS)
  for labels, match in [({"w": "sgd", "step": "frozen", "b": "adam"}, "'w' has label 'sgd'"),
                        ({"w": "muon", "step": "adam", "b": "adam"}, "'step' is labelled 'adam'"),
                        ({"w": "muon", "step": "frozen", "b": "muon"}, "'b' of shape \\(4,\\)")]:
    with pytest.raises(ValueError, match=match):
      check_labels(labels, params, views, LABELS)
