"""Routing values: the labels and matrix views of real Flax models, every leaf's label
asserted."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
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
