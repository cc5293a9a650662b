"""Host offload: the same numbers as on the device, with the state in pinned_host memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from adamw_case import HIDDEN, D, adam_state, arm, hundred_steps, make_params

import muon_optax as mo


def test_offloaded_muon_momentum_matches_reference():
  _, states, losses = hundred_steps()
  np.testing.assert_allclose(losses[:, arm("offload", True)], losses[:, arm("reference")],
                             rtol=0, atol=1e-5)
  state = states[arm("offload", True)]
  momentum = state.inner_states["muon"].inner_state[0][0].mu["mlp_in"]["kernel"]
  assert momentum.sharding.memory_kind == "pinned_host"
  assert momentum.shape == (D, HIDDEN)  # whole matrices, orthogonalized as such
  for leaf in jax.tree.leaves(adam_state(state).mu):
    assert leaf.sharding.memory_kind == "pinned_host"


def test_offload_state_wraps_any_transform_bit_for_bit():
  """Only where the state lives changes: optax.adam's updates and state, bit for bit."""
  params = make_params()
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  outer = mo.offload_state(inner)
  step_in, step_out = jax.jit(inner.update), jax.jit(outer.update)
  s_in, s_out = inner.init(params), outer.init(params)
  for _ in range(3):
    u_in, s_in = step_in(grads, s_in, params)
    u_out, s_out = step_out(grads, s_out, params)
    assert jax.tree.structure(s_out) == jax.tree.structure(s_in)
    for a, b in zip(jax.tree.leaves((u_out, s_out)), jax.tree.leaves((u_in, s_in))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for leaf in jax.tree.leaves(s_out):  # moments on the host, the step count on the device
      assert leaf.sharding.memory_kind == ("pinned_host" if leaf.ndim else "device")
  assert step_out._cache_size() == 1  # the state from init and from a step compile alike


def test_offload_keeps_the_state_sharding():
  """ZeRO-style sharded params: the offloaded moments stay sharded, in host memory."""
  mesh = jax.make_mesh((8,), ("data",))
  params = jax.device_put({"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones(16)},
                          jax.sharding.NamedSharding(mesh, jax.P("data")))
  tx = mo.AuxAdam(1e-2, backend="offload").transform()
  step = jax.jit(tx.update)
  state = tx.init(params)
  for _ in range(2):
    _, state = step(params, state, params)
    for leaf in jax.tree.leaves((state.mu, state.nu)):
      assert leaf.sharding.memory_kind == "pinned_host"
      assert leaf.sharding.spec[0] == "data"
  assert step._cache_size() == 1

