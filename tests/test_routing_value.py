"""Routing values: the labels of real Flax models, every leaf's label asserted; label trees
as optax.partition takes them, and rules only through `Routing.from_rules`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import float32_bound, rel
from flax import nnx
from gpt_model import GPT

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path


def labels_by_path(params, **kw):
  return dict(leaves_with_path(mo.label_params(params, **kw)))


@pytest.mark.parametrize("tied", [False, True])
def test_nnx_gpt_routing(tied):
  params = nnx.state(GPT(tied=tied, rngs=nnx.Rngs(0)), nnx.Param)
  labels = labels_by_path(params)
  expected = {"embed/embedding": "adam", "pos_embed/embedding": "adam",
              "ln_f/scale": "adam", "ln_f/bias": "adam"}
  if not tied:
    expected["lm_head/kernel"] = "adam"
  for i in range(2):
    b = f"blocks/{i}"
    for proj in ("query", "key", "value", "out"):
      expected[f"{b}/attn/{proj}/kernel"] = "muon"
      expected[f"{b}/attn/{proj}/bias"] = "adam"  # 2-D (heads, head_dim) biases too
    for ln in ("ln1", "ln2"):
      expected[f"{b}/{ln}/scale"] = expected[f"{b}/{ln}/bias"] = "adam"
    for fc in ("fc", "proj"):
      expected[f"{b}/{fc}/kernel"] = "muon"
      expected[f"{b}/{fc}/bias"] = "adam"
  assert labels == expected


def test_per_head_orthogonalization_orthogonalizes_each_head():
  x = {"attn": {"query": {"kernel": jax.random.normal(jax.random.key(1), (16, 2, 8))}}}
  tx = mo.orthogonalize(mo.NewtonSchulz("polar_express", steps=10),
                        routing=mo.Routing.from_rules(per_head=True))
  out, _ = tx.update(x, tx.init(x))
  for h in range(2):
    head = np.asarray(out["attn"]["query"]["kernel"][:, h, :], np.float64)
    np.testing.assert_allclose(head.T @ head, np.eye(8), atol=1e-2)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=True)(x)
    x = nn.Conv(16, (3, 3))(x)
    x = x.mean(axis=(1, 2))
    x = nn.Dense(32)(x)
    return nn.Dense(10, name="classifier")(x)


def test_linen_cnn_routing_and_conv_views():
  variables = CNN().init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
  labels = labels_by_path(variables["params"])
  assert labels == {
      "Conv_0/kernel": "muon", "Conv_0/bias": "adam",
      "BatchNorm_0/scale": "adam", "BatchNorm_0/bias": "adam",
      "Conv_1/kernel": "muon", "Conv_1/bias": "adam",
      "Dense_0/kernel": "muon", "Dense_0/bias": "adam",
      "classifier/kernel": "adam", "classifier/bias": "adam",
  }
  view = mo.default_view("Conv_1/kernel", (3, 3, 8, 16))
  assert view.matrix_shape((3, 3, 8, 16)) == (1, 72, 16)


class ScannedMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    class Body(nn.Module):
      @nn.compact
      def __call__(self, c, _):
        return nn.Dense(16)(c), None

    scanned = nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
    x, _ = scanned(name="layers")(x, None)
    return x


def test_scanned_linen_stack_is_batched():
  params = ScannedMLP().init(jax.random.key(0), jnp.ones((2, 16)))["params"]
  labels = labels_by_path(params)
  assert labels == {"layers/Dense_0/kernel": "muon", "layers/Dense_0/bias": "adam"}
  kernel = params["layers"]["Dense_0"]["kernel"]
  assert kernel.shape == (4, 16, 16)
  tx = mo.orthogonalize()
  out, _ = tx.update(params, tx.init(params))
  for i in range(4):
    # Batched and single matmuls may round differently: within twice the float32 bound.
    assert rel(out["layers"]["Dense_0"]["kernel"][i], mo.newton_schulz(kernel[i])) < (
        2 * float32_bound())


def test_nnx_vmapped_stack_is_batched():
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return nnx.Linear(8, 24, rngs=nnx.Rngs(key))

  stack = make(jax.random.split(jax.random.key(0), 3))
  params = nnx.state(stack, nnx.Param)
  assert labels_by_path(params) == {"kernel": "muon", "bias": "adam"}
  assert "3×(8×24)" in mo.describe(params)


def test_moe_expert_stack_routing_and_views():
  params = {"moe": {"router": {"kernel": jnp.zeros((16, 4))},
                    "experts": {"w_in": jnp.zeros((4, 16, 64)), "w_out": jnp.zeros((4, 64, 16))}}}
  rules = [(r"router", "adam"), *mo.DEFAULT_RULES]
  assert labels_by_path(params, rules=rules) == {
      "moe/router/kernel": "adam", "moe/experts/w_in": "muon", "moe/experts/w_out": "muon"}
  table = mo.describe(params, routing=mo.Routing.from_rules(rules))
  assert "4×(16×64)" in table and "4×(64×16)" in table


def test_label_pytree_must_match_params():
  params = {"a": {"kernel": jnp.zeros((4, 4))}}
  with pytest.raises(ValueError, match="label tree does not match"):
    mo.muon(routing={"b": "muon"}).init(params)


# --- optimizer-contract regressions -----------------------------------------------


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
