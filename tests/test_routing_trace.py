"""infer_routing on models as people write them (nnx, Linen auto names, convolutions,
names that fool the rules, plain dicts), asserted leaf by leaf, with Muon's update on
every inferred view checked against a plain Newton–Schulz reference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gpt_model import GPT
from routing_case import V, assert_muon_update_is_ns_of_each_view, table

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path

# --- an nnx GPT, tied and untied --------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_nnx_gpt(tied, per_head):
  model = GPT(tied=tied, rngs=nnx.Rngs(0))
  routing = mo.infer_routing(model, jnp.zeros((2, 8), jnp.int32), per_head=per_head)
  expected = {"embed/embedding": ("adam", None), "pos_embed/embedding": ("adam", None),
              "ln_f/scale": ("adam", None), "ln_f/bias": ("adam", None)}
  if not tied:
    expected["lm_head/kernel"] = ("adam", None)
  qkv = V((1,), (0,), (2,)) if per_head else V((), (0,), (1, 2))  # (d, h, k)
  out = V((0,), (1,), (2,)) if per_head else V((), (0, 1), (2,))  # (h, k, d)
  for i in range(2):
    b = f"blocks/{i}"
    for proj in ("query", "key", "value"):
      expected[f"{b}/attn/{proj}/kernel"] = ("muon", qkv)
      expected[f"{b}/attn/{proj}/bias"] = ("adam", None)
    expected[f"{b}/attn/out/kernel"] = ("muon", out)
    expected[f"{b}/attn/out/bias"] = ("adam", None)
    for ln in ("ln1", "ln2"):
      expected[f"{b}/{ln}/scale"] = expected[f"{b}/{ln}/bias"] = ("adam", None)
    expected[f"{b}/fc/kernel"] = expected[f"{b}/proj/kernel"] = ("muon", V((), (0,), (1,)))
    expected[f"{b}/fc/bias"] = expected[f"{b}/proj/bias"] = ("adam", None)
  assert table(routing) == expected
  text = mo.describe(nnx.state(model, nnx.Param), routing=routing)
  assert "gather → embedding" in text and "dot_general → 16×64" in text
  assert ("tied: also the output projection" in text) == tied
  assert ("feeds the output → head" in text) != tied
  assert_muon_update_is_ns_of_each_view(routing, nnx.state(model, nnx.Param))


# --- Linen MLP classifier with auto names ----------------------------------------

class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(10)(x)


def test_linen_mlp_classifier_head_is_found_where_names_cannot():
  x = jnp.ones((4, 8))
  params = MLP().init(jax.random.key(0), x)
  routing = mo.infer_routing(MLP().apply, params, x)
  assert table(routing) == {
      "params/Dense_0/kernel": ("muon", V((), (0,), (1,))), "params/Dense_0/bias": ("adam", None),
      "params/Dense_1/kernel": ("muon", V((), (0,), (1,))), "params/Dense_1/bias": ("adam", None),
      "params/Dense_2/kernel": ("adam", None), "params/Dense_2/bias": ("adam", None)}
  assert routing.labels(params["params"]) == {  # the Routing serves variables["params"] too
      f"Dense_{i}": {"kernel": "adam" if i == 2 else "muon", "bias": "adam"} for i in range(3)}
  assert mo.label_params(params)["params"]["Dense_2"]["kernel"] == "muon"  # what names say
  assert "Dense_2" in mo.describe(params) and "infer_routing" in mo.describe(params)
  assert_muon_update_is_ns_of_each_view(routing, params)


# --- convolutions ------------------------------------------------------------------

def test_nnx_sequential_cnn_without_conv_in_any_name():
  rngs = nnx.Rngs(0)
  model = nnx.Sequential(nnx.Conv(3, 8, (3, 3), rngs=rngs), nnx.relu,
                         nnx.Conv(8, 16, (3, 3), rngs=rngs), nnx.relu,
                         lambda x: x.mean(axis=(1, 2)), nnx.Linear(16, 10, rngs=rngs))
  routing = mo.infer_routing(model, jnp.ones((2, 8, 8, 3)))
  conv = V((), (0, 1, 2), (3,))
  assert table(routing) == {
      "layers/0/kernel": ("muon", conv), "layers/0/bias": ("adam", None),
      "layers/2/kernel": ("muon", conv), "layers/2/bias": ("adam", None),
      "layers/5/kernel": ("adam", None), "layers/5/bias": ("adam", None)}
  text = str(routing)
  assert "conv 3×3×3→8 → 27×8" in text and "conv 3×3×8→16 → 72×16" in text
  assert_muon_update_is_ns_of_each_view(routing, nnx.state(model, nnx.Param))


class ResNetBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Conv(16, (3, 3), use_bias=False, name="stem")(x)
    y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
    y = nn.Conv(16, (3, 3), feature_group_count=16, use_bias=False, name="depthwise")(y)
    y = nn.Conv(16, (1, 1), use_bias=False, name="pointwise")(y)
    y = y + nn.Conv(16, (1, 1), use_bias=False, name="shortcut")(x)
    return nn.Dense(5, name="Dense_0")(nn.relu(y).mean(axis=(1, 2)))


def test_resnet_block_with_shortcut_and_depthwise_conv():
  x = jnp.ones((2, 8, 8, 4))
  variables = ResNetBlock().init(jax.random.key(0), x)
  f = lambda p, x: ResNetBlock().apply({**variables, "params": p}, x)
  routing = mo.infer_routing(f, variables["params"], x)
  conv = V((), (0, 1, 2), (3,))
  assert table(routing) == {
      "stem/kernel": ("muon", conv), "depthwise/kernel": ("adam", None),
      "pointwise/kernel": ("muon", conv), "shortcut/kernel": ("muon", conv),
      "BatchNorm_0/scale": ("adam", None), "BatchNorm_0/bias": ("adam", None),
      "Dense_0/kernel": ("adam", None), "Dense_0/bias": ("adam", None)}
  text = str(routing)
  assert "grouped conv (16 groups)" in text and "conv 1×1×4→16 → 4×16" in text
  assert_muon_update_is_ns_of_each_view(routing, variables["params"])


def test_conv_layouts_1d_and_3d_from_dimension_numbers():
  x1, x3 = jnp.ones((2, 5, 8)), jnp.ones((1, 3, 6, 6, 6))
  params = {"a": jnp.ones((12, 8, 3)), "b": jnp.ones((4, 3, 2, 2, 2)), "w": jnp.ones((12, 2))}

  def f(p, x1, x3):
    y1 = jax.lax.conv_general_dilated(x1, p["a"], (1,), "SAME",
                                      dimension_numbers=("NWC", "OIW", "NWC"))  # (out, in, w)
    y3 = jax.lax.conv_general_dilated(x3, p["b"], (1, 1, 1), "SAME")  # NCDHW / OIDHW
    return (y1.sum((0, 1)) + y3.sum()) @ p["w"]

  routing = mo.infer_routing(f, params, x1, x3)
  assert table(routing)["a"] == ("muon", V((), (1, 2), (0,)))
  assert table(routing)["b"] == ("muon", V((), (1, 2, 3, 4), (0,)))
  assert routing.view("a", (12, 8, 3)).matrix_shape((12, 8, 3)) == (1, 24, 12)
  assert_muon_update_is_ns_of_each_view(routing, params)


# --- names that fool the name rules; plain dicts ------------------------------------

def test_names_that_fool_the_name_rules():
  k = lambda *s: {"kernel": jnp.ones(s)}
  params = {"ensemble": {"layers_0": k(8, 8)}, "member_mlp": k(8, 8),
            "normalizing_flow": {"coupling_0": k(8, 8)}, "tok_mixing": {"Dense_0": k(8, 8)},
            "time_embed": {"dense_1": k(8, 8)}, "stem": k(3, 3, 2, 8), "out": k(8, 5)}

  def f(p, x, img):
    for name in ("member_mlp", "tok_mixing"):
      x = jnp.tanh(x @ (p[name] if name == "member_mlp" else p[name]["Dense_0"])["kernel"])
    x = x @ p["ensemble"]["layers_0"]["kernel"] @ p["normalizing_flow"]["coupling_0"]["kernel"]
    x = x @ p["time_embed"]["dense_1"]["kernel"]
    s = jax.lax.conv_general_dilated(img, p["stem"]["kernel"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return (x + s.mean((1, 2))) @ p["out"]["kernel"]

  routing = mo.infer_routing(f, params, jnp.ones((2, 8)), jnp.ones((2, 4, 4, 2)))
  labels = dict(leaves_with_path(routing.labels(params)))
  assert labels == {"ensemble/layers_0/kernel": "muon", "member_mlp/kernel": "muon",
                    "normalizing_flow/coupling_0/kernel": "muon",
                    "tok_mixing/Dense_0/kernel": "muon", "time_embed/dense_1/kernel": "muon",
                    "stem/kernel": "muon", "out/kernel": "adam"}
  by_name = dict(leaves_with_path(mo.label_params(params)))
  assert by_name["out/kernel"] == "muon"  # names cannot see the head
  assert {p: l for p, l in by_name.items() if p != "out/kernel"} == {
      p: l for p, l in labels.items() if p != "out/kernel"}  # anchored name rules agree
  assert table(routing)["stem/kernel"][1] == V((), (0, 1, 2), (3,))


def test_plain_dict_params_and_rules_and_overrides():
  params = {"emb": jnp.ones((10, 4)), "w": jnp.ones((4, 4)), "b": jnp.ones(4),
            "scale": jnp.ones((4, 4)), "out": jnp.ones((4, 10))}
  f = lambda p, ids: ((p["emb"][ids] * p["scale"][0]) @ p["w"] + p["b"]) @ p["out"]
  routing = mo.infer_routing(f, params, jnp.zeros(3, jnp.int32))
  assert routing.labels(params) == {"emb": "adam", "w": "muon", "b": "adam", "scale": "adam",
                                    "out": "adam"}
  reasons = {p: d.reason for p, (_, d) in routing.decisions.items()}
  assert reasons == {"emb": "gather → embedding", "w": "dot_general → 4×4", "b": "rank < 2",
                     "scale": "elementwise only", "out": "feeds the output → head"}
  forced = mo.infer_routing(f, params, jnp.zeros(3, jnp.int32), overrides=[(r"^out$", "muon")])
  assert table(forced)["out"] == ("muon", V((), (0,), (1,)))


def test_checkpointer_takes_the_routing(tmp_path):
  params = {"w": jnp.ones((4, 4)), "o": jnp.ones((4, 2))}
  routing = mo.infer_routing(lambda p, x: jnp.tanh(x @ p["w"]) @ p["o"], params, jnp.ones((2, 4)))
  tx = mo.muon(0.02, routing=routing, adam=mo.AuxAdam(3e-4, backend="optax"))
  state = tx.init(params)
  with mo.checkpoint.Checkpointer(tmp_path, routing=routing, async_save=False) as ckpt:
    record = ckpt.record(params, state)["routing"]
  assert record["o"]["label"] == "adam" and record["w"]["label"] == "muon"
  converted = mo.convert_adam_state(state, params, "reference")
  reference = mo.muon(0.02, routing=routing, adam=mo.AuxAdam(3e-4, backend="reference"))
  u, _ = reference.update(params, converted, params)
  assert jax.tree.structure(u) == jax.tree.structure(params)


def test_given_views_replace_inferred_ones():
  params = {"stack": jnp.ones((3, 16, 8)), "head": jnp.ones((16, 2))}
  f = lambda p, x: jax.vmap(lambda w: x @ w.T, out_axes=0)(p["stack"]).mean(0) @ p["head"]
  inferred = mo.infer_routing(f, params, jnp.ones((4, 8)))
  assert table(inferred)["stack"] == ("muon", V((), (2,), (0, 1)))  # one wide matrix
  stacked = V((0,), (2,), (1,))
  given = mo.infer_routing(f, params, jnp.ones((4, 8)),
                           views=lambda path, shape: stacked if path == "stack" else None)
  assert table(given)["stack"] == ("muon", stacked)
  assert_muon_update_is_ns_of_each_view(given, params)


class Trainable(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(self.bn(self.l1(x))))


def test_nnx_model_in_training_mode_is_left_as_it_was_and_trains_with_the_routing():
  model = Trainable(nnx.Rngs(0))
  as_np = lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x)
  before = jax.tree.map(as_np, nnx.state(model, nnx.Not(nnx.Param)))
  routing = mo.infer_routing(model, jnp.ones((3, 4)))
  after = jax.tree.map(as_np, nnx.state(model, nnx.Not(nnx.Param)))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  labels = dict(leaves_with_path(routing.labels(nnx.state(model, nnx.Param))))
  assert labels == {"l1/kernel": "muon", "l1/bias": "adam", "bn/scale": "adam",
                    "bn/bias": "adam", "l2/kernel": "adam", "l2/bias": "adam"}
  optimizer = nnx.Optimizer(model, mo.muon(0.02, routing=routing), wrt=nnx.Param)
  kernel = np.asarray(model.l1.kernel[...])
  grads = nnx.grad(lambda m: (m(jnp.ones((3, 4))) ** 2).mean())(model)
  optimizer.update(model, grads)
  assert not np.allclose(model.l1.kernel[...], kernel)
