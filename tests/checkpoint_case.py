"""The small model, optimizer and helpers the checkpoint tests share (and the processes
they kill import)."""

import functools
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo
from muon_optax.checkpoint import Checkpointer, abstract_target  # noqa: F401  (for scripts)

VOCAB, D, HIDDEN, BATCH = 32, 16, 32, 16


def make_params(hidden=HIDDEN):
  rng = np.random.default_rng(0)  # numpy: no per-shape compiles for a few random arrays
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) / shape[0]**0.5)
  return {
      "embed": {"embedding": normal(VOCAB, D)},
      "mlp_in": {"kernel": normal(D, hidden), "bias": jnp.zeros(hidden)},
      "mlp_out": {"kernel": normal(hidden, D)},
      "lm_head": {"kernel": normal(D, VOCAB)},
  }


def loss_fn(params, step):
  """Next-token cross-entropy of a one-block model on a batch fixed by `step`."""
  x = jax.random.randint(jax.random.fold_in(jax.random.key(1), step), (BATCH,), 0, VOCAB)
  h = params["embed"]["embedding"][x]
  mlp_in, mlp_out = params["mlp_in"], params["mlp_out"]
  h = h + jnp.tanh(h @ mlp_in["kernel"] + mlp_in["bias"]) @ mlp_out["kernel"]
  logits = h @ params["lm_head"]["kernel"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, (3 * x + 1) % VOCAB).mean()


def make_tx(mesh=None, adam_backend="reference", labels=None, **kw):
  adam = mo.AuxAdam(3e-3, weight_decay=0.1, backend=adam_backend)
  return mo.muon(0.02, weight_decay=0.01, adam=adam, mesh=mesh, routing=labels, **kw)


def make_mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@functools.cache
def trainer(n):
  """(tx, target, jitted step) on an n-device mesh: params replicated, state sharded."""
  mesh = make_mesh(n)
  tx = make_tx(mesh)
  target = abstract_target(tx, make_params(), mesh)
  shardings = jax.tree.map(lambda x: x.sharding, target)

  @functools.partial(jax.jit, in_shardings=(*shardings, None), out_shardings=shardings)
  def step(params, state, i):
    grads = jax.grad(loss_fn)(params, i)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, target, step


def run(n, params, state, start, stop):
  step = trainer(n)[2]
  for i in range(start, stop):
    params, state = step(params, state, jnp.int32(i))
  return params, state


def fill(tree, seed):
  """Random non-negative values (a valid second moment) of each leaf's shape and dtype."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(np.abs(rng.standard_normal(x.shape)) * 100, x.dtype), tree)


def tree_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def saved_at(step, params, state_target):
  """What a killed saver writes as `step`: params + step and a state filled from it."""
  return jax.tree.map(lambda x: x + step, params), fill(state_target, step)


def kill_when_marked(proc, marker, log, pause=0.0, timeout=240):
  """SIGKILLs `proc` `pause` seconds after it creates `marker`; fails with the end of its
  `log` file if it exits first or never gets there."""
  try:
    deadline = time.monotonic() + timeout
    while not marker.exists():
      if proc.poll() is not None:
        log.seek(0)
        pytest.fail("the process exited before the kill point:\n" + log.read()[-3000:])
      assert time.monotonic() < deadline, "the process never reached the kill point"
      time.sleep(0.05)
    time.sleep(pause)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=60)
