"""infer_routing: routing tables read from the computation, asserted leaf by leaf, and
Muon's update on every inferred view checked against a plain Newton–Schulz reference."""

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

V = mo.MatrixView
JORDAN = (3.4445, -4.7750, 2.0315)


def table(routing):
  """path -> (label, view) for every leaf of an inferred Routing."""
  return {p: (d.label, d.view) for p, (_, d) in routing.decisions.items()}


def ns_reference(m, dtype):
  """Jordan's quintic Newton–Schulz on one matrix, in numpy at `dtype`."""
  x = np.asarray(m, dtype)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / np.linalg.norm(x)
  a, b, c = (dtype(v) for v in JORDAN)
  for _ in range(5):
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if tall else x


def assert_muon_update_is_ns_of_each_view(routing, params):
  """With beta=0, no shape scaling and lr=1, Muon's update of a leaf is -NS(its matrices)."""
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params)
  tx = mo.muon(1.0, beta=0.0, nesterov=False, scale=None, ns="jordan",  # 5 steps
               routing=routing)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  checked = 0
  for (path, g), (_, u) in zip(leaves_with_path(grads), leaves_with_path(updates)):
    label, view = table(routing)[path]
    if label != "muon":
      continue
    order = view.batch + view.fan_in + view.fan_out
    count, fan_in, fan_out = view.matrix_shape(g.shape)
    mats = np.transpose(np.asarray(g), order).reshape(count, fan_in, fan_out)
    ref64 = np.stack([ns_reference(m, np.float64) for m in mats])
    permuted = np.transpose(-np.asarray(u, np.float64), order).reshape(count, fan_in, fan_out)
    # Any float32 evaluation (standard or Gram-space) is within the a priori bound.
    assert np.all(rel(permuted, ref64) < float32_bound("jordan")), path
    checked += 1
  assert checked


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


# --- stacks: scan, vmap, MoE --------------------------------------------------------

def test_jax_lax_scan_stack_and_nested_jit_and_checkpoint():
  params = {"embed": jnp.ones((32, 8)), "stack": {"w": jnp.ones((3, 8, 8)), "g": jnp.ones((3, 8))},
            "out": jnp.ones((8, 32))}

  @jax.jit
  def layer(x, w, g):
    return jax.checkpoint(lambda x: jax.nn.gelu(x @ w) * g)(x)

  def f(p, ids):
    x = jnp.take(p["embed"], ids, axis=0)
    x, _ = jax.lax.scan(lambda x, wg: (jax.jit(layer)(x, *wg), None), x,
                        (p["stack"]["w"], p["stack"]["g"]))
    return x @ p["out"]

  routing = mo.infer_routing(f, params, jnp.zeros(4, jnp.int32))
  assert table(routing) == {"embed": ("adam", None), "out": ("adam", None),
                            "stack/w": ("muon", V((0,), (1,), (2,))), "stack/g": ("adam", None)}
  assert "3×(8×8)" in str(routing)
  assert_muon_update_is_ns_of_each_view(routing, params)


def test_fori_loop_over_a_stack_indexes_layers_not_embeddings():
  params = {"w": jnp.ones((3, 8, 16)), "v": jnp.ones((3, 16, 8)), "head": jnp.ones((8, 2))}

  def f(p, x):
    body = lambda i, x: jnp.tanh(x @ p["w"][i]) @ p["v"][i]
    return jax.lax.fori_loop(0, 3, body, x) @ p["head"]

  routing = mo.infer_routing(f, params, jnp.ones((4, 8)))
  assert table(routing) == {"w": ("muon", V((0,), (1,), (2,))), "v": ("muon", V((0,), (1,), (2,))),
                            "head": ("adam", None)}


class ScanStack(nnx.Module):
  def __init__(self, layers, d, *, rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Linear(d, d, rngs=rngs)

    self.layers = make(rngs)
    self.head = nnx.Linear(d, 3, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def step(x, layer):
      return jax.nn.relu(layer(x))

    return self.head(step(x, self.layers))


def test_nnx_scan_over_a_vmapped_stack():
  model = ScanStack(4, 8, rngs=nnx.Rngs(0))
  routing = mo.infer_routing(model, jnp.ones((2, 8)))
  assert table(routing) == {"layers/kernel": ("muon", V((0,), (1,), (2,))),
                            "layers/bias": ("adam", None),
                            "head/kernel": ("adam", None), "head/bias": ("adam", None)}
  assert_muon_update_is_ns_of_each_view(routing, nnx.state(model, nnx.Param))


class Ensemble(nnx.Module):
  def __init__(self, members, d, *, rngs):
    @nnx.split_rngs(splits=members)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Linear(d, 2 * d, rngs=rngs)

    self.members = make(rngs)
    self.head = nnx.Linear(2 * d, 1, rngs=rngs)

  def __call__(self, x, batched):
    forward = nnx.vmap(lambda m, x: jax.nn.relu(m(x)), in_axes=(0, 0 if batched else None))
    return self.head(forward(self.members, x).mean(0))


@pytest.mark.parametrize("batched", [True, False])
def test_nnx_vmap_stack_forward(batched):
  model = Ensemble(3, 8, rngs=nnx.Rngs(0))
  x = jnp.ones((3, 2, 8)) if batched else jnp.ones((2, 8))
  routing = mo.infer_routing(model, x, batched=batched)
  assert table(routing) == {"members/kernel": ("muon", V((0,), (1,), (2,))),
                            "members/bias": ("adam", None),
                            "head/kernel": ("adam", None), "head/bias": ("adam", None)}


def test_moe_einsum_experts():
  params = {"router": jnp.ones((8, 4)), "w_in": jnp.ones((4, 8, 32)),
            "w_out": jnp.ones((4, 32, 8)), "unembed": jnp.ones((8, 16))}

  def f(p, x):
    gates = jax.nn.softmax(x @ p["router"])
    xe = jnp.einsum("be,bd->ebd", gates, x)
    h = jax.nn.gelu(jnp.einsum("ebd,edf->ebf", xe, p["w_in"]))
    y = jnp.einsum("ebf,efd->ebd", h, p["w_out"]).sum(0)  # experts stay a batch axis
    return (x + y) @ p["unembed"]

  routing = mo.infer_routing(f, params, jnp.ones((6, 8)))
  assert table(routing) == {"router": ("muon", V((), (0,), (1,))),
                            "w_in": ("muon", V((0,), (1,), (2,))),
                            "w_out": ("muon", V((0,), (1,), (2,))), "unembed": ("adam", None)}
  assert "4×(8×32)" in str(routing) and "4×(32×8)" in str(routing)
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


# --- bad input --------------------------------------------------------------------

def test_unused_leaf_names_the_path():
  params = {"w": jnp.ones((4, 4)), "spare": jnp.ones((4, 4))}
  with pytest.raises(ValueError, match=r"'spare'.*not used"):
    mo.infer_routing(lambda p, x: x @ p["w"], params, jnp.ones((2, 4)))
  routing = mo.infer_routing(lambda p, x: x @ p["w"], params, jnp.ones((2, 4)),
                             overrides=[("spare", "frozen")])
  assert routing.labels(params)["spare"] == "frozen"


def test_leaf_used_two_ways_names_the_path_and_uses():
  params = {"w": jnp.ones((4, 6)), "k": jnp.ones((3, 3, 4, 6))}
  f = lambda p, x: (x @ p["w"]) @ p["w"].T
  two_ways = r"'w'.*incompatible.*dot_general as 4×6, dot_general as 6×4"
  with pytest.raises(ValueError, match=two_ways):
    mo.infer_routing(f, {"w": params["w"]}, jnp.ones((2, 4)))
  conv = lambda p, img: jax.lax.conv_general_dilated(
      img, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  g = lambda p, x, img: (x @ p["k"][0, 0]).sum() + conv(p, img).sum() + (x @ p["w"]).sum()
  two_ways = r"'k'.*incompatible.*conv 3×3×4→6 → 36×6, dot_general as 9×\(4×6\)"
  with pytest.raises(ValueError, match=two_ways):
    mo.infer_routing(g, params, jnp.ones((2, 4)), jnp.ones((1, 5, 5, 4)))


def test_f_that_fails_to_trace():
  with pytest.raises(ValueError, match="could not trace f"):
    mo.infer_routing(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 4))}, jnp.ones((2, 5)))
  with pytest.raises(ValueError, match="pass the params"):
    mo.infer_routing(lambda p: p)
  with pytest.raises(ValueError, match=r"routing rule \('\(', 'adam'\) has a bad regex"):
    mo.infer_routing(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 4))}, jnp.ones((2, 4)),
                     overrides=[("(", "adam")])


def test_routing_of_other_params_is_an_error_naming_the_path():
  routing = mo.infer_routing(lambda p, x: jnp.tanh(x @ p["w"]) @ p["o"],
                             {"w": jnp.ones((4, 4)), "o": jnp.ones((4, 2))}, jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r"'v'.*not in this Routing"):
    routing.labels({"v": jnp.ones((4, 4))})


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


def test_shard_map_body_is_followed():
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  spec = jax.sharding.PartitionSpec
  params = {"w": jnp.ones((8, 16)), "v": jnp.ones((16, 8)), "head": jnp.ones((8, 3))}

  def f(p, x):
    body = jax.shard_map(lambda x, w, v: jnp.tanh(x @ w) @ v, mesh=mesh,
                         in_specs=(spec("data"), spec(), spec()), out_specs=spec("data"))
    return body(x, p["w"], p["v"]) @ p["head"]

  x = jax.device_put(jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, spec("data")))
  routing = mo.infer_routing(f, params, x)
  assert table(routing) == {"w": ("muon", V((), (0,), (1,))), "v": ("muon", V((), (0,), (1,))),
                            "head": ("adam", None)}


def test_while_loop_and_cond_bodies_are_followed():
  params = {"w": jnp.ones((3, 8, 8)), "a": jnp.ones((8, 8)), "b": jnp.ones((8, 8)),
            "head": jnp.ones((8, 2))}

  def f(p, x, n):
    def body(carry):
      i, x = carry
      x = jax.lax.cond(i % 2 == 0, lambda x: x @ p["a"], lambda x: jnp.tanh(x @ p["b"]), x)
      return i + 1, x @ jax.lax.dynamic_index_in_dim(p["w"], i % 3, keepdims=False)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1] @ p["head"]

  routing = mo.infer_routing(f, params, jnp.ones((2, 8)), jnp.int32(5))
  assert table(routing) == {"w": ("muon", V((0,), (1,), (2,))), "a": ("muon", V((), (0,), (1,))),
                            "b": ("muon", V((), (0,), (1,))), "head": ("adam", None)}


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


def test_a_row_looked_up_by_dynamic_index_is_an_embedding_even_when_multiplied():
  params = {"table": jnp.ones((10, 8)), "w": jnp.ones((8, 8)), "head": jnp.ones((8, 2))}
  f = lambda p, tok: jnp.tanh(jax.lax.dynamic_index_in_dim(p["table"], tok, keepdims=False)
                              @ p["w"]) @ p["head"]
  routing = mo.infer_routing(f, params, jnp.int32(3))
  assert table(routing) == {"table": ("adam", None), "w": ("muon", V((), (0,), (1,))),
                            "head": ("adam", None)}
  assert routing.decisions["table"][1].reason == "dynamic index → embedding"


def test_custom_jvp_and_custom_vjp_bodies_are_followed():
  @jax.custom_vjp
  def matmul(x, w):
    return x @ w

  matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

  @jax.custom_jvp
  def tanh_matmul(x, w):
    return jnp.tanh(x @ w)

  tanh_matmul.defjvp(lambda p, t: (tanh_matmul(*p), t[0] @ p[1]))
  params = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 8)), "head": jnp.ones((8, 2))}
  f = lambda p, x: tanh_matmul(matmul(x, p["a"]), p["b"]) @ p["head"]
  routing = mo.infer_routing(f, params, jnp.ones((2, 4)))
  assert table(routing) == {"a": ("muon", V((), (0,), (1,))), "b": ("muon", V((), (0,), (1,))),
                            "head": ("adam", None)}


class LinenScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    class Body(nn.Module):
      @nn.compact
      def __call__(self, c, _):
        return nn.gelu(nn.Dense(16)(c)), None

    scanned = nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
    x, _ = scanned(name="layers")(x, None)
    return nn.Dense(3, name="Dense_0")(x)


def test_linen_nn_scan_stack():
  x = jnp.ones((2, 16))
  params = LinenScanned().init(jax.random.key(0), x)["params"]
  routing = mo.infer_routing(lambda p, x: LinenScanned().apply({"params": p}, x), params, x)
  assert table(routing) == {"layers/Dense_0/kernel": ("muon", V((0,), (1,), (2,))),
                            "layers/Dense_0/bias": ("adam", None),
                            "Dense_0/kernel": ("adam", None), "Dense_0/bias": ("adam", None)}
  assert_muon_update_is_ns_of_each_view(routing, params)
