"""Name rules: routing by tree path, anchored on whole path components."""

import jax
import jax.numpy as jnp
import linen_lm_case
import numpy as np
import optax
import pytest

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path


def labels_by_path(params, **kw):
  return dict(leaves_with_path(mo.label_params(params, **kw)))


def test_user_rules_first_match_wins_and_callable_labels():
  params = {"a": {"kernel": jnp.zeros((4, 4))}, "b": {"kernel": jnp.zeros((4, 4))}}
  assert labels_by_path(params, rules=[(r"^a/", "frozen"), (r".*", "muon")]) == {
      "a/kernel": "frozen", "b/kernel": "muon"}
  tx = mo.muon(0.1, routing=lambda p: jax.tree.map(lambda _: "adam", p))
  u, _ = tx.update(params, tx.init(params), params)
  adam = optax.adamw(3e-4)
  ua, _ = adam.update(params, adam.init(params), params)
  np.testing.assert_allclose(u["a"]["kernel"], ua["a"]["kernel"])


def test_unplaced_leaf_under_default_rules_is_an_error():
  with pytest.raises(ValueError, match="no routing rule places parameter 'mystery/table'"):
    mo.label_params({"mystery": {"table": jnp.zeros((4, 4))}})


@pytest.mark.parametrize("path, label", [
    ("embed/embedding", "adam"), ("wte/embedding", "adam"), ("tok_embeddings/weight", "adam"),
    ("Embed_0/embedding", "adam"), ("model/embed_tokens/weight", "adam"),
    ("ensemble/layers_0/kernel", "muon"), ("member_mlp/kernel", "muon"),
    ("tok_mixing/Dense_0/kernel", "muon"), ("time_embed/dense_1/kernel", "muon"),
    ("normalizing_flow/coupling_0/kernel", "muon"),
    ("norm/weight", "adam"), ("ln_f/weight", "adam"), ("layernorm/weight", "adam"),
    ("rmsnorm/weight", "adam"), ("LayerNorm_0/scale", "adam"), ("BatchNorm_0/kernel", "adam"),
    ("blocks/0/post_attention_layernorm/weight", "adam"), ("lnx/kernel", "muon"),
])
def test_name_rules_match_whole_path_components(path, label):
  assert mo.DEFAULT_RULES[0](path, jnp.zeros((4, 4))) == label


def test_integer_and_bool_leaves_are_frozen_and_say_why():
  params = {"step": jnp.zeros((), jnp.int32), "mask": {"kernel": jnp.ones((4, 4), bool)},
            "ids": {"weight": jnp.arange(8).reshape(2, 4)}, "mlp": {"kernel": jnp.ones((4, 4))}}
  assert labels_by_path(params) == {"step": "frozen", "mask/kernel": "frozen",
                                    "ids/weight": "frozen", "mlp/kernel": "muon"}
  table = mo.describe(params)
  assert "int32 → frozen" in table and "bool → frozen" in table
  tx = mo.muon(0.1)
  u, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  new = optax.apply_updates(params, u)
  for path in ("step", "mask/kernel", "ids/weight"):
    got = dict(leaves_with_path(new))[path]
    want = dict(leaves_with_path(params))[path]
    assert got.dtype == want.dtype and np.array_equal(got, want), path


def test_name_rules_see_any_rank_4_leaf_as_a_conv_kernel():
  view = mo.default_view("layers/0/kernel", (3, 3, 8, 16))
  assert view == mo.MatrixView((), (0, 1, 2), (3,))
  assert "72×16" in mo.describe({"layers": {"0": {"kernel": jnp.zeros((3, 3, 8, 16))}}})


def test_a_bad_regex_names_the_rule():
  with pytest.raises(ValueError, match=r"routing rule \('\[', 'adam'\) has a bad regex"):
    mo.Routing.from_rules([("[", "adam")])
  with pytest.raises(ValueError, match=r"routing rule 'adam' must be"):
    mo.label_params({"w": jnp.zeros((2, 2))}, rules=["adam"])


@pytest.mark.parametrize("path", [
    "blocks_0/CausalAttn_0/attn_out_proj/kernel", "attn/out_proj/kernel",
    "self_attn/o_proj/kernel", "attention/wo/kernel", "attn_output/kernel", "mha/out/kernel"])
def test_an_output_projection_of_heads_is_one_matrix(path):
  """(heads, head_dim, d_model) under an output projection's common names: (heads·head_dim)
  × d_model, as its inputs q, k, v are d_model × (heads·head_dim); a stacked MLP kernel
  stays a stack."""
  assert mo.default_view(path, (4, 32, 128)) == mo.MatrixView((), (0, 1), (2,))
  assert mo.default_view(path, (2, 4, 32, 128)) == mo.MatrixView((0,), (1, 2), (3,))
  assert mo.default_view("mlp/Dense_1/kernel", (4, 32, 128)) == mo.MatrixView((0,), (1,), (2,))


def test_a_linen_lm_named_as_nanodo_names_it():
  """The name rules see nanodo's attention as the computation does: each projection one
  128×128 matrix (its q, k, v, and attn_out_proj, which was 4 × (32×128))."""
  model, params, tokens = linen_lm_case.model_and_params()
  by_name = mo.Routing.from_rules()
  inferred = mo.infer_routing(model.apply, {"params": params}, tokens)
  for path, leaf in leaves_with_path(params):
    if by_name.labels({path: leaf})[path] == "muon":
      view = by_name.view(path, leaf.shape)
      assert view.matrix_shape(leaf.shape) == inferred.view(path, leaf.shape).matrix_shape(
          leaf.shape), path
  out_proj = by_name.view("blocks_0/CausalAttn_0/attn_out_proj/kernel", (4, 32, 128))
  assert out_proj.matrix_shape((4, 32, 128)) == (1, 128, 128)
