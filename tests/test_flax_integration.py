"""muon inside nnx.Optimizer under nnx.jit, and inside a Linen TrainState."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _helpers import assert_trees_close
from flax import nnx
from flax.training import train_state

import muon_optax as mo


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.hidden = nnx.Linear(16, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)
    self.head = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.norm(jax.nn.gelu(self.hidden(self.embed(tokens)))))


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_nnx_optimizer_trains_and_matches_functional_update():
  model = MLP(nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 32)
  tx = mo.muon(0.02, adam=mo.AuxAdam(learning_rate=3e-3))
  params0 = nnx.as_pure(nnx.state(model, nnx.Param))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss

  # The same first step, functionally on pure arrays.
  grads = nnx.as_pure(nnx.state(nnx.grad(loss_fn)(model, tokens), nnx.Param))
  u, _ = tx.update(grads, tx.init(params0), params0)
  expected = optax.apply_updates(params0, u)

  losses = [float(step(model, optimizer, tokens))]
  assert_trees_close(nnx.as_pure(nnx.state(model, nnx.Param)), expected, rtol=0, atol=1e-6)
  for _ in range(20):
    losses.append(float(step(model, optimizer, tokens)))
  assert losses[-1] < 0.7 * losses[0]


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(1, name="head")(x)


def test_linen_train_state():
  model = LinenMLP()
  x = jax.random.normal(jax.random.key(0), (64, 8))
  y = jnp.sin(x.sum(-1, keepdims=True))
  params = model.init(jax.random.key(1), x)["params"]
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=mo.muon(0.02, adam=mo.AuxAdam(1e-2)))

  @jax.jit
  def step(state):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss

  state, first = step(state)
  for _ in range(50):
    state, loss = step(state)
  assert loss < 0.5 * first
