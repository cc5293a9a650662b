"""A one-block model trained by muon(...) under every AdamW backend, side by side.

Every arm runs in one jitted step, so the AdamW, offload and conversion tests compile
the model and optimizer once per session.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import muon_optax as mo

VOCAB, D, HIDDEN, BATCH = 32, 16, 32, 16


def commit(tree):
  """Arrays committed to the default device, as a step returns them: jit specializes on
  committed vs not once some state lives in host memory."""
  return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, jax.devices()[0]), tree)


def make_params():
  k = jax.random.split(jax.random.key(0), 5)
  return commit({
      "embed": {"embedding": jax.random.normal(k[0], (VOCAB, D))},
      "mlp_in": {"kernel": jax.random.normal(k[1], (D, HIDDEN)) / D**0.5, "bias": jnp.zeros(HIDDEN)},
      "mlp_out": {"kernel": jax.random.normal(k[2], (HIDDEN, D)) / HIDDEN**0.5},
      "norm": {"scale": jnp.ones(D)},
      "lm_head": {"kernel": jax.random.normal(k[3], (D, VOCAB)) / D**0.5},
  })


def loss_fn(params, step):
  """Next-token cross-entropy of a one-block model on a batch fixed by `step`."""
  x = jax.random.randint(jax.random.fold_in(jax.random.key(1), step), (BATCH,), 0, VOCAB)
  y = (3 * x + 1) % VOCAB  # a rule to learn
  h = params["embed"]["embedding"][x] * params["norm"]["scale"]
  h = h + jnp.tanh(h @ params["mlp_in"]["kernel"] + params["mlp_in"]["bias"]) @ params["mlp_out"]["kernel"]
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["lm_head"]["kernel"], y).mean()


# Weight decay on everything but the norm scale and the bias; schedules for lr and decay.
MASK = {"embed": {"embedding": True}, "mlp_in": {"kernel": True, "bias": False},
        "mlp_out": {"kernel": True}, "norm": {"scale": False}, "lm_head": {"kernel": True}}


def make_tx(backend, *, nesterov=True, offload_momentum=False):
  adam = mo.AuxAdam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 100), weight_decay=
                    optax.linear_schedule(0.1, 0.01, 100), mask=MASK, nesterov=nesterov,
                    backend=backend)
  return mo.muon(0.02, weight_decay=0.01, adam=adam, offload_momentum=offload_momentum)


# Every arm: (backend, offload_momentum).
ARMS = tuple((b, False) for b in mo.BACKENDS) + (("offload", True),)


def arm(backend, offload_momentum=False):
  return ARMS.index((backend, offload_momentum))


@functools.cache
def arms_step():
  txs = tuple(make_tx(b, offload_momentum=o) for b, o in ARMS)

  @jax.jit
  def step(params, states, i):
    out = []
    for tx, p, s in zip(txs, params, states):
      loss, grads = jax.value_and_grad(loss_fn)(p, i)
      updates, s = tx.update(grads, s, p)
      out.append((optax.apply_updates(p, updates), s, loss))
    return tuple(zip(*out))

  return txs, step


def run_arms(steps, params=None, states=None, start=0):
  """`steps` training steps of every arm -> (params, states, losses of shape (steps, arms))."""
  txs, step = arms_step()
  params = tuple(make_params() for _ in ARMS) if params is None else tuple(params)
  states = tuple(commit(tx.init(p)) for tx, p in zip(txs, params)) if states is None else tuple(states)
  losses = []
  for i in range(start, start + steps):
    params, states, loss = step(params, states, i)
    losses.append(loss)
  return params, states, np.array(losses)


@functools.cache
def hundred_steps():
  return run_arms(100)


@functools.cache
def three_steps():
  return run_arms(3)


def adam_state(state):
  return state.inner_states["adam"].inner_state
