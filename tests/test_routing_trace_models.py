"""infer_routing on models as users write them: Linen variables with reused names, conv
heads, models returning hidden states or output dicts, equinox and haiku, and the errors
for what is not a pytree of arrays."""

import equinox as eqx
import flax.linen as nn
import flax.struct
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gpt_model import GPT
from gpt_model import Block as GPTBlock

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path

V = mo.MatrixView


def table(routing):
  """path -> (label, view) for every leaf of an inferred Routing."""
  return {p: (d.label, d.view) for p, (_, d) in routing.decisions.items()}


def reasons(routing):
  return {p: d.reason for p, (_, d) in routing.decisions.items()}


# --- Linen variables: names reused inside submodules --------------------------------

class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(16)(nn.relu(nn.BatchNorm(use_running_average=True)(x)))


class ResidualNet(nn.Module):  # Dense_0 / BatchNorm_0 at the top and inside Block_0
  @nn.compact
  def __call__(self, x):
    x = nn.BatchNorm(use_running_average=True)(nn.Dense(16)(x))
    return nn.Dense(3)(Block()(x))


def test_routing_from_linen_variables_serves_their_params_despite_reused_names():
  x = jnp.ones((2, 8))
  variables = ResidualNet().init(jax.random.key(0), x)
  routing = mo.infer_routing(ResidualNet().apply, variables, x)
  params = variables["params"]
  labels = dict(leaves_with_path(routing.labels(params)))
  assert labels == {"BatchNorm_0/bias": "adam", "BatchNorm_0/scale": "adam",
                    "Block_0/BatchNorm_0/bias": "adam", "Block_0/BatchNorm_0/scale": "adam",
                    "Block_0/Dense_0/bias": "adam", "Block_0/Dense_0/kernel": "muon",
                    "Dense_0/bias": "adam", "Dense_0/kernel": "muon",
                    "Dense_1/bias": "adam", "Dense_1/kernel": "adam"}
  assert routing.labels(variables)["batch_stats"]["BatchNorm_0"]["mean"] == "adam"
  text = mo.describe(params, routing=routing)
  assert "feeds the output → head" in text and "dot_general → 8×16" in text
  tx = mo.muon(0.02, routing=routing)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_paths_match_whole_and_errors_show_what_exists():
  w = jnp.ones((4, 4))
  f = lambda p, x: jnp.tanh(x @ p["a"]["w"]) @ p["b"]["w"]
  routing = mo.infer_routing(f, {"a": {"w": w}, "b": {"w": w}}, jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r"'w' matches \['a/w', 'b/w'\]"):
    routing.labels({"w": w})
  with pytest.raises(ValueError, match=r"'a/v'.*not in this Routing.*nearest.*'a/w'"):
    routing.labels({"a": {"v": w}, "b": {"w": w}})
  with pytest.raises(ValueError, match=r"'a/w' has shape \(4, 8\), but \(4, 4\)"):
    routing.labels({"a": {"w": jnp.ones((4, 8))}, "b": {"w": w}})


# --- a convolution that is the output: segmentation classifiers, U-Nets -------------

class SegNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    return nn.Conv(5, (1, 1), name="classifier")(x)  # per-pixel class logits


def test_linen_segmentation_net_1x1_conv_classifier_is_the_head():
  x = jnp.ones((1, 8, 8, 3))
  params = SegNet().init(jax.random.key(0), x)["params"]
  routing = mo.infer_routing(lambda p, x: SegNet().apply({"params": p}, x), params, x)
  labels = {p: l for p, (l, _) in table(routing).items() if p.endswith("kernel")}
  assert labels == {"Conv_0/kernel": "muon", "Conv_1/kernel": "muon",
                    "classifier/kernel": "adam"}
  assert reasons(routing)["classifier/kernel"] == "feeds the output → head"


class UNet(nnx.Module):
  def __init__(self, rngs):
    self.down = nnx.Conv(3, 8, (3, 3), strides=2, rngs=rngs)
    self.up = nnx.ConvTranspose(8, 8, (3, 3), strides=2, rngs=rngs)
    self.out = nnx.Conv(11, 2, (1, 1), rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.up(nnx.relu(self.down(x))))
    return self.out(jnp.concatenate([h, x], axis=-1))


def test_nnx_unet_last_conv_is_the_head():
  model = UNet(nnx.Rngs(0))
  routing = mo.infer_routing(model, jnp.ones((1, 8, 8, 3)))
  conv = V((), (0, 1, 2), (3,))
  assert {p: v for p, v in table(routing).items() if p.endswith("kernel")} == {
      "down/kernel": ("muon", conv), "up/kernel": ("muon", conv), "out/kernel": ("adam", None)}
  text = mo.describe(nnx.state(model, nnx.Param), routing=routing)
  assert "conv 3×3×3→8 → 27×8" in text and "feeds the output → head" in text
  method = mo.infer_routing(model.__call__, jnp.ones((1, 8, 8, 3)))  # a method routes its model
  assert table(method) == table(routing)


# --- residual streams and recurrences: a projection that feeds another is no head -----

class Encoder(nnx.Module):  # like a T5 encoder: its output is the normed residual stream
  def __init__(self, rngs):
    self.embed = nnx.Embed(64, 16, rngs=rngs)
    self.blocks = nnx.List([GPTBlock(16, 2, rngs) for _ in range(3)])
    self.norm = nnx.LayerNorm(16, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    for block in self.blocks:
      x = block(x)
    return self.norm(x)


def test_headless_encoder_only_its_last_projection_is_a_head():
  model = Encoder(nnx.Rngs(0))
  routing = mo.infer_routing(model, jnp.zeros((2, 8), jnp.int32))
  kernels = {p: l for p, (l, _) in table(routing).items()
             if p.endswith("kernel") and p.startswith("blocks")}
  # Every projection feeds a later block, or the MLP after it, but the last MLP's.
  assert kernels == {p: "adam" if p == "blocks/2/proj/kernel" else "muon" for p in kernels}
  assert len(kernels) == 18


def test_rnn_weights_feed_the_next_step_so_are_not_heads():
  params = {"w_xh": jnp.ones((4, 8)), "w_hh": jnp.ones((8, 8))}

  def rnn(p, xs):  # its output is the last hidden state
    step = lambda h, x: (jnp.tanh(h @ p["w_hh"] + x @ p["w_xh"]), None)
    return jax.lax.scan(step, jnp.zeros(8), xs)[0]

  routing = mo.infer_routing(rnn, params, jnp.ones((5, 4)))
  assert routing.labels(params) == {"w_xh": "muon", "w_hh": "muon"}


# --- several outputs: logits and hidden states, output dicts -------------------------

def mlp(p, x):
  h1 = jnp.tanh(x @ p["w1"])
  h2 = jnp.tanh(h1 @ p["w2"])
  return h2 @ p["head"], (h1, h2)


PARAMS = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 8)), "head": jnp.ones((8, 3))}


def test_logits_and_hidden_states_need_output_to_say_which_is_the_output():
  with pytest.raises(ValueError) as e:
    mo.infer_routing(mlp, PARAMS, jnp.ones((2, 4)))
  message = str(e.value)
  assert "f returns 3 arrays (out[0], out[1][0], out[1][1])" in message
  assert "'head' is a head (→ adam) only if the output is out[0]" in message
  assert "'w1'" not in message and "'w2'" not in message  # they feed the next layer
  assert "output=lambda out: out[0]" in message
  routing = mo.infer_routing(mlp, PARAMS, jnp.ones((2, 4)), output=lambda out: out[0])
  assert routing.labels(PARAMS) == {"w1": "muon", "w2": "muon", "head": "adam"}
  # Outputs that agree on the routing need no output=.
  probs = lambda p, x: (lambda y: (y, jax.nn.softmax(y)))(mlp(p, x)[0])
  assert mo.infer_routing(probs, PARAMS, jnp.ones((2, 4))).labels(PARAMS) == routing.labels(PARAMS)


@flax.struct.dataclass
class Output:  # like the output classes of transformers' and flaxmodels' Flax models
  logits: jax.Array
  hidden_states: tuple


def test_output_dicts_and_output_objects():
  as_dict = lambda p, x: (lambda y, h: {"hidden": h, "logits": y})(*mlp(p, x))
  with pytest.raises(ValueError, match=r"out\['hidden'\]\[0\].*output=lambda out: out\['logits'\]"):
    mo.infer_routing(as_dict, PARAMS, jnp.ones((2, 4)))
  routing = mo.infer_routing(as_dict, PARAMS, jnp.ones((2, 4)), output=lambda out: out["logits"])
  assert routing.labels(PARAMS) == {"w1": "muon", "w2": "muon", "head": "adam"}
  as_object = lambda p, x: Output(*mlp(p, x))
  with pytest.raises(ValueError, match=r"output=lambda out: out\.logits"):
    mo.infer_routing(as_object, PARAMS, jnp.ones((2, 4)))
  routing = mo.infer_routing(as_object, PARAMS, jnp.ones((2, 4)), output=lambda out: out.logits)
  assert routing.labels(PARAMS) == {"w1": "muon", "w2": "muon", "head": "adam"}
  with pytest.raises(ValueError, match="output= picked no array"):
    mo.infer_routing(as_object, PARAMS, jnp.ones((2, 4)), output=lambda out: None)


def test_nnx_gpt_returning_hidden_states():
  model, ids = GPT(rngs=nnx.Rngs(0)), jnp.zeros((2, 8), jnp.int32)
  only_lm_head = r"output: 'lm_head/kernel' is a head \(→ adam\) only if the output is out\[0\]\."
  with pytest.raises(ValueError, match=only_lm_head):
    mo.infer_routing(model, ids, hidden_states=True)
  routing = mo.infer_routing(model, ids, hidden_states=True, output=lambda out: out[0])
  params = nnx.state(model, nnx.Param)
  assert routing.labels(params) == mo.infer_routing(model, ids).labels(params)


def test_linen_train_mode_batch_stats_are_not_the_output():
  class ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x))
      return nn.Dense(2)(nn.relu(x).mean((1, 2)))

  x = jnp.ones((2, 6, 6, 3))
  variables = ConvBN().init(jax.random.key(0), x)
  apply = lambda v, x: ConvBN().apply(v, x, mutable=["batch_stats"])
  stats_or_logits = r"out\[1\]\['batch_stats'\].*'params/Dense_0/kernel' is a head"
  with pytest.raises(ValueError, match=stats_or_logits):
    mo.infer_routing(apply, variables, x)
  routing = mo.infer_routing(apply, variables, x, output=lambda out: out[0])
  assert routing.labels(variables["params"])["Conv_0"]["kernel"] == "muon"


# --- equinox and haiku ---------------------------------------------------------------

def test_equinox_mlp_routes_and_trains_on_its_filtered_params():
  model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
  x, y = jnp.ones(4), jnp.zeros(3)
  routing = mo.infer_routing(model, x)
  out_in = V((), (1,), (0,))  # eqx.nn.Linear's weight is (out, in)
  assert table(routing) == {
      "layers/0/weight": ("muon", out_in), "layers/0/bias": ("adam", None),
      "layers/1/weight": ("muon", out_in), "layers/1/bias": ("adam", None),
      "layers/2/weight": ("adam", None), "layers/2/bias": ("adam", None)}
  params = eqx.filter(model, eqx.is_inexact_array)
  assert "feeds the output → head" in mo.describe(params, routing=routing)
  tx = mo.muon(0.02, routing=routing)
  state = tx.init(params)
  grads = eqx.filter_grad(lambda m: jnp.sum((m(x) - y) ** 2))(model)
  updates, state = tx.update(grads, state, params)
  trained = eqx.apply_updates(model, updates)
  assert not np.allclose(trained.layers[0].weight, model.layers[0].weight)


class ScannedStack(eqx.Module):
  layers: eqx.nn.Linear  # 3 layers stacked on a leading axis
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 4)
    self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys[:3])
    self.head = eqx.nn.Linear(8, 2, key=keys[3])

  def __call__(self, x):
    dynamic, static = eqx.partition(self.layers, eqx.is_array)
    step = lambda x, layer: (jax.nn.relu(eqx.combine(layer, static)(x)), None)
    return self.head(jax.lax.scan(step, x, dynamic)[0])


def test_equinox_scanned_stack():
  model = ScannedStack(jax.random.key(0))
  routing = mo.infer_routing(model, jnp.ones(8))
  assert table(routing) == {"layers/weight": ("muon", V((0,), (2,), (1,))),
                            "layers/bias": ("adam", None),
                            "head/weight": ("adam", None), "head/bias": ("adam", None)}
  assert "3×(8×8)" in str(routing)
  assert table(mo.infer_routing(model.__call__, jnp.ones(8))) == table(routing)  # a method
  params = eqx.filter(model, eqx.is_inexact_array)
  tx = mo.muon(0.02, routing=routing)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert updates.layers.weight.shape == (3, 8, 8)


def test_haiku_mlp():
  model = hk.transform(lambda x: hk.nets.MLP([16, 16, 3])(x))
  x = jnp.ones((2, 4))
  params = model.init(jax.random.key(0), x)
  routing = mo.infer_routing(lambda p, x: model.apply(p, None, x), params, x)
  assert {p: l for p, (l, _) in table(routing).items() if p.endswith("/w")} == {
      "mlp/~/linear_0/w": "muon", "mlp/~/linear_1/w": "muon", "mlp/~/linear_2/w": "adam"}
  tx = mo.muon(0.02, routing=routing)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)


# --- what is not a pytree of arrays ----------------------------------------------------

def test_a_module_with_a_custom_jvp_inside_as_params_names_the_leaf():
  model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))  # its activation is jax.nn.relu
  with pytest.raises(ValueError, match=r"leaf at 'activation' is a custom_jvp.*"
                     r"infer_routing\(model, \*args\)") as e:
    mo.infer_routing(lambda m, x: m(x), model, jnp.ones(4))
  assert "Cannot determine dtype" not in str(e.value)


def test_a_first_argument_that_is_not_a_function_of_a_pytree_of_arrays():
  x = jnp.ones((2, 4))
  variables = SegNet().init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
  with pytest.raises(ValueError, match=r"Linen Module.*infer_routing\(model.apply, variables"):
    mo.infer_routing(SegNet(), variables, x)
  with pytest.raises(ValueError, match=r"Linen Module class.*infer_routing\(model.apply, "):
    mo.infer_routing(SegNet, variables, x)  # the class, not an instance
  with pytest.raises(ValueError, match=r"f holds arrays of its own.*params/Conv_0/bias"):
    mo.infer_routing(jax.tree_util.Partial(SegNet().apply, variables), x)
  transformed = hk.transform(lambda x: hk.Linear(3)(x))
  with pytest.raises(ValueError, match=r"callable, got a Transformed.*model.apply\(p, None"):
    mo.infer_routing(transformed, transformed.init(jax.random.key(0), x), x)
  with pytest.raises(ValueError, match=r"params itself is a str"):
    mo.infer_routing(lambda p, x: x, "params", x)
  with pytest.raises(ValueError, match=r"no arrays in the params"):
    mo.infer_routing(lambda p, x: x, {}, x)



def test_integer_leaves_are_frozen_with_their_reason():
  params = {"w": jnp.ones((4, 8)), "out": jnp.ones((8, 3)), "step": jnp.zeros((), jnp.int32),
            "table": jnp.arange(12).reshape(4, 3)}
  f = lambda p, x: (x @ p["w"]) @ p["out"] + p["table"][p["step"]]
  routing = mo.infer_routing(f, params, jnp.ones((2, 4)))
  assert routing.labels(params) == {"out": "adam", "step": "frozen", "table": "frozen",
                                    "w": "muon"}
  assert "int32 → frozen" in mo.describe(params, routing=routing)
  tx = mo.muon(0.1, routing=routing)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert not updates["step"] and not jnp.any(updates["table"])
