"""QK-clip: exact per-head logit cap, untouched heads, sharding, composition, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo

D, H, HD, L, B = 16, 4, 8, 6, 8


def attn_params(seed, *, fused=False, bias=True):
  """{'attn': {'query'|'key': {'kernel', 'bias'}}} in nnx (d, H, hd) or fused (d, H·hd) layout."""
  rng = np.random.default_rng(seed)
  shape = (D, H * HD) if fused else (D, H, HD)
  head_scale = np.array([0.2, 1.0, 3.0, 6.0], np.float32)  # heads of very different logit size
  col = np.repeat(head_scale, HD) if fused else head_scale[:, None]
  out = {}
  for name in ("query", "key"):
    out[name] = {"kernel": (rng.standard_normal(shape) * col).astype(np.float32)}
    if bias:
      out[name]["bias"] = (0.1 * rng.standard_normal(shape[1:])).astype(np.float32)
  return {"attn": out}


def small_update(params):
  return jax.tree.map(lambda p: (0.05 * np.cos(p)).astype(np.float32), params)


def add(params, updates):  # what optax.apply_updates computes, in float32
  return jax.tree.map(lambda p, u: np.asarray(p) + np.asarray(u), params, updates)


def inputs(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@jax.jit
def max_logits_of(params, x):
  """S_h of the causal attention of `params` on x: (heads,)."""
  def project(p):
    y = jnp.einsum("bld,d...->bl...", x, p["kernel"]) + p.get("bias", 0.0)
    return y.reshape(y.shape[:2] + (H, HD))
  a = params["attn"]
  q, k = project(a["query"]), project(a["key"])
  logits = jnp.einsum("bqhd,bkhd->hbqk", q, k) / np.sqrt(HD)
  causal = np.tril(np.ones((L, L), bool))
  return jnp.max(jnp.where(causal, logits, -jnp.inf), axis=(1, 2, 3))


def apply(tx, params, updates, **extra):
  u, _ = jax.jit(tx.update)(updates, tx.init(params), params, **extra)
  return u


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_clipped_heads_capped_exactly_and_others_bit_identical(fused, bias):
  params = attn_params(0, fused=fused, bias=bias)
  updates = small_update(params)
  x = inputs(1, (B, L, D))
  # S_h of the weights the step produces, p + u, so the cap is exact.
  s = max_logits_of(add(params, updates), x)
  tau = float(np.sort(s)[1]) * 1.01  # two heads above τ, two below
  clipped = np.asarray(s > tau)
  assert clipped.sum() == 2

  new_u = apply(mo.qk_clip(tau), params, updates, max_logits={"attn": s})
  new_s = max_logits_of(add(params, new_u), x)

  np.testing.assert_array_less(new_s[clipped], tau * (1 + 1e-5))
  np.testing.assert_allclose(new_s[clipped], tau, rtol=1e-5)
  np.testing.assert_array_equal(new_s[~clipped], s[~clipped])
  for name in ("query", "key"):
    for leaf in new_u["attn"][name]:
      u, v = updates["attn"][name][leaf], new_u["attn"][name][leaf]
      heads = lambda a: a.reshape(a.shape[:-1] + (H, HD)) if fused else a
      np.testing.assert_array_equal(heads(v)[..., ~clipped, :], heads(u)[..., ~clipped, :])
      assert not np.array_equal(heads(v)[..., clipped, :], heads(u)[..., clipped, :])


def test_alpha_splits_the_rescaling_between_query_and_key():
  params = attn_params(0, bias=False)
  zeros = jax.tree.map(np.zeros_like, params)
  s = np.array([1.0, 1.0, 1.0, 400.0])
  u = apply(mo.qk_clip(100.0, alpha=0.25), params, zeros, max_logits={"attn": s})
  new = add(params, u)["attn"]
  q, k = params["attn"]["query"]["kernel"], params["attn"]["key"]["kernel"]
  np.testing.assert_allclose(new["query"]["kernel"][:, 3], 0.25 ** 0.25 * q[:, 3], rtol=1e-6)
  np.testing.assert_allclose(new["key"]["kernel"][:, 3], 0.25 ** 0.75 * k[:, 3], rtol=1e-6)


def test_all_heads_below_tau_is_a_no_op():
  params = attn_params(0)
  updates = jax.tree.map(np.sin, params)
  u = apply(mo.qk_clip(100.0), params, updates, max_logits={"attn": np.array([1.0, 50.0, 99.0, 100.0])})
  jax.tree.map(np.testing.assert_array_equal, u, updates)


def test_stacked_layers_take_per_layer_max_logits():
  one = attn_params(0, bias=False)
  params = jax.tree.map(lambda a: np.stack([a, 2 * a]), one)  # (layers=2, d, H, hd)
  zeros = jax.tree.map(np.zeros_like, params)
  s = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 400.0]])
  new = add(params, apply(mo.qk_clip(100.0), params, zeros, max_logits={"attn": s}))
  q = new["attn"]["query"]["kernel"]
  np.testing.assert_array_equal(q[0], params["attn"]["query"]["kernel"][0])
  np.testing.assert_allclose(q[1, :, 3], 0.5 * params["attn"]["query"]["kernel"][1, :, 3], rtol=1e-6)


def test_fsdp_sharded_kernels_match_single_device():
  mesh = jax.make_mesh((8,), ("data",))
  params = attn_params(0)
  updates = small_update(params)
  s = {"attn": np.array([1.0, 150.0, 20.0, 900.0])}
  tx = optax.chain(optax.identity(), mo.qk_clip(100.0))
  expected = apply(tx, params, updates, max_logits=s)

  # FSDP: kernels split along d_model, biases replicated.
  shard = lambda a: jax.device_put(
      a, NamedSharding(mesh, P("data") if a.shape[0] == D else P()))
  sp, su = jax.tree.map(shard, params), jax.tree.map(shard, updates)
  with jax.set_mesh(mesh):
    got = apply(tx, sp, su, max_logits=s)
  assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)
  assert got["attn"]["query"]["kernel"].sharding.spec[0] == "data"


def test_inside_an_optax_partition_branch():
  params = attn_params(0, bias=False)
  params["mlp"] = {"kernel": np.ones((D, D), np.float32)}
  labels = {"attn": {"query": {"kernel": "qk"}, "key": {"kernel": "qk"}}, "mlp": {"kernel": "other"}}
  tx = optax.partition({"qk": optax.chain(optax.sgd(0.1), mo.qk_clip(100.0)),
                        "other": optax.sgd(0.1)}, labels)
  grads = jax.tree.map(np.ones_like, params)
  s = {"attn": np.array([1.0, 1.0, 1.0, 400.0])}
  u = apply(tx, params, grads, max_logits=s)
  plain = apply(optax.sgd(0.1), params, grads)
  np.testing.assert_array_equal(u["mlp"]["kernel"], plain["mlp"]["kernel"])
  new_q = (params["attn"]["query"]["kernel"] + plain["attn"]["query"]["kernel"])
  np.testing.assert_allclose(add(params, u)["attn"]["query"]["kernel"][:, 3],
                             0.5 * new_q[:, 3], rtol=1e-6)


def test_injected_tau():
  params = attn_params(0, bias=False)
  zeros = jax.tree.map(np.zeros_like, params)
  tx = optax.inject_hyperparams(mo.qk_clip)(tau=200.0)
  u = apply(tx, params, zeros, max_logits={"attn": np.array([1.0, 1.0, 1.0, 400.0])})
  np.testing.assert_allclose(u["attn"]["query"]["kernel"][:, 3],
                             (0.5 ** 0.5 - 1) * params["attn"]["query"]["kernel"][:, 3], rtol=1e-5)


@pytest.mark.parametrize("tau", [-1.0, 0.0])
def test_bad_tau(tau):
  with pytest.raises(ValueError, match="tau must be in"):
    mo.qk_clip(tau)
  with pytest.raises(ValueError, match="alpha must be in"):
    mo.qk_clip(100.0, alpha=1.5)


def test_bad_inputs_name_the_problem():
  params = attn_params(0)
  tx = mo.qk_clip(100.0)
  state = tx.init(params)
  s = np.ones(H, np.float32)
  cases = [
      (dict(), "needs the per-head max logits"),
      (dict(max_logits={"attn": np.ones(H + 1, np.float32)}), "head-count mismatch: 'attn/query/kernel'"),
      (dict(max_logits={"atn": s}), "entry 'atn' but no attention module"),
      (dict(max_logits={}), "no max_logits entry for attention module 'attn'"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      tx.update(params, state, params, **kwargs)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, state, max_logits={"attn": s})

  mlp = {"mlp": {"kernel": np.ones((D, D), np.float32)}}
  with pytest.raises(ValueError, match="found no query/key kernel pair"):
    tx.update(mlp, state, mlp, max_logits={"attn": s})

  no_key = {"attn": {"query": params["attn"]["query"]}}
  with pytest.raises(ValueError, match="'attn/query/kernel' has no key kernel: 'attn/key/kernel'"):
    tx.update(no_key, state, no_key, max_logits={"attn": s})

  gqa = jax.tree.map(lambda a: a, params)
  gqa["attn"]["key"] = {"kernel": np.ones((D, 2, HD), np.float32)}
  with pytest.raises(ValueError, match="head-count mismatch: 'attn/key/kernel'"):
    tx.update(gqa, state, gqa, max_logits={"attn": s})

  labels = {"attn": {n: {"kernel": "qk", "bias": "other"} for n in ("query", "key")}}
  split = optax.partition({"qk": mo.qk_clip(100.0), "other": optax.identity()}, labels)
  with pytest.raises(ValueError, match="bias 'attn/(query|key)/bias' .* another optax.partition"):
    split.update(params, split.init(params), params, max_logits={"attn": s})
