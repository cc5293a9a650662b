"""infer_routing follows the computation wherever it goes: scanned, looped and vmapped
stacks, MoE einsums, shard_map, while and cond bodies, custom derivatives, dynamic
indexing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from routing_case import V, assert_muon_update_is_ns_of_each_view, table

import muon_optax as mo

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
