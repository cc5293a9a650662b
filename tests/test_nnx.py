"""muon_optax.nnx: per-head max logits, ClipAttention under nnx.Optimizer, Flax kept optional."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from muon_optax.nnx import ClipAttention, head_max_logits, max_logit_attention, max_logits

D, H, HD, L, B = 16, 4, 8, 6, 8


def inputs(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_import_muon_optax_imports_no_flax():
  code = ("import sys, muon_optax as mo; assert 'flax' not in sys.modules, 'flax'; "
          "mo.nnx.ClipAttention; assert 'flax' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)


def test_head_max_logits_against_float64():
  q, k = (inputs(i, (2, 3, L, H, HD)).astype(np.float64) for i in (0, 1))
  mask = np.tril(np.ones((L, L), bool))
  logits = np.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(HD)
  expected = np.where(mask, logits, -np.inf).max(axis=(0, 1, 3, 4))
  got_logits, s = head_max_logits(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), mask)
  assert s.shape == (H,) and s.dtype == jnp.float32
  # A float32 dot product of HD terms errs by at most HD·eps·Σ|q_i k_i|; the 1/√d scale, one more.
  bound = np.einsum("...qhd,...khd->...hqk", np.abs(q), np.abs(k)) / np.sqrt(HD)
  atol = (HD + 1) * np.finfo(np.float32).eps * bound.max()
  np.testing.assert_allclose(s, expected, rtol=0, atol=atol)
  np.testing.assert_allclose(got_logits, logits, rtol=0, atol=atol)


def test_max_logit_attention_is_softmax_attention_and_sows():
  q, k, v = (inputs(i, (2, L, H, HD)) for i in range(3))
  want = nnx.dot_product_attention(q, k, v, mask=np.tril(np.ones((L, L), bool)))
  got = max_logit_attention(q, k, v, is_causal=True)
  atol = 16 * np.finfo(np.float32).eps * np.abs(v).max()  # softmax weights sum to 1
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)
  attn = ClipAttention(H, D, qkv_features=H * HD, rngs=nnx.Rngs(0))
  _, inter = nnx.capture(attn, nnx.Intermediate)(inputs(3, (B, L, D)))
  assert max_logits(inter)[""].shape == (H,)


def test_clip_attention_takes_the_usual_multi_head_attention_arguments():
  # decode=False is what ClipAttention is, so it may be said; decode=True may not.
  attn = ClipAttention(H, D, qkv_features=H * HD, decode=False, dropout_rate=0.0,
                       rngs=nnx.Rngs(0))
  assert attn(inputs(3, (B, L, D))).shape == (B, L, D)
  with pytest.raises(ValueError, match="decode=False and no attention_fn"):
    ClipAttention(H, D, decode=True, rngs=nnx.Rngs(0))


def test_max_logits_takes_the_max_over_repeated_calls():
  sown = (jnp.array([1., 5.]), jnp.array([3., 2.]))  # two calls of one module
  got = max_logits({"blocks": {"0": {"attn": {"max_logits": sown}}}, "other": jnp.array([7.0])})
  assert set(got) == {"blocks/0/attn", "other"}
  np.testing.assert_array_equal(got["blocks/0/attn"], [3.0, 5.0])


def test_max_logits_are_global_over_a_sharded_batch():
  mesh = jax.make_mesh((8,), ("data",))
  q, k = inputs(0, (2, B, L, H, HD))
  # The largest logits sit on the last shard.
  q = q * np.arange(1, B + 1, dtype=np.float32)[:, None, None, None]
  mask = np.tril(np.ones((L, L), bool))
  expected = head_max_logits(q, k, mask)[1]

  sharded = NamedSharding(mesh, P("data"))
  f = jax.jit(lambda q, k: head_max_logits(q, k, mask)[1])
  q, k = jax.device_put(q, sharded), jax.device_put(k, sharded)
  got = f(q, k)
  np.testing.assert_array_equal(got, expected)
  assert got.sharding.is_fully_replicated

  per_shard = jax.shard_map(
      lambda q, k: head_max_logits(q, k, mask, axis_name="data")[1],
      mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
  np.testing.assert_array_equal(jax.jit(per_shard)(q, k), expected)


class TinyModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, D, rngs=rngs)
    self.attn = ClipAttention(H, D, qkv_features=H * HD, rngs=rngs)
    self.lm_head = nnx.Linear(D, 32, rngs=rngs)

  def __call__(self, tokens):
    return self.lm_head(self.attn(self.embed(tokens)))


def test_nnx_optimizer_with_muon_and_clip_attention():
  model = nnx.jit(lambda: TinyModel(nnx.Rngs(0)))()
  table = mo.describe(nnx.as_pure(nnx.state(model, nnx.Param)))
  rows = {r.split()[0]: r.split()[2] for r in table.splitlines()[2:] if r.count("  ") > 1}
  assert all(rows[f"attn/{n}/kernel"] == "muon" for n in ("query", "key", "value", "out")), table
  tokens = np.random.default_rng(1).integers(0, 32, (B, L))

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(model):
      logits, inter = nnx.capture(model, nnx.Intermediate)(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(), inter
    (_, inter), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads, max_logits=max_logits(inter))
    return max_logits(inter)["attn"]

  # One tx (τ injected) for both runs, so the step compiles once.
  tx = optax.chain(mo.muon(0.05, adam=mo.AuxAdam(0.01)),
                   optax.inject_hyperparams(mo.qk_clip)(tau=np.inf))
  clipped = nnx.clone(model)
  s = np.asarray(step(model, nnx.Optimizer(model, tx, wrt=nnx.Param), tokens))  # τ = ∞: Muon
  tau = float(np.sort(s)[1]) * 1.01  # two heads above τ
  opt = nnx.Optimizer(clipped, tx, wrt=nnx.Param)
  opt.opt_state[1].hyperparams["tau"][...] = tau
  np.testing.assert_array_equal(step(clipped, opt, tokens), s)

  gamma = np.where(s > tau, tau / s, 1.0)[:, None]
  for name in ("query", "key"):
    for leaf in ("kernel", "bias"):
      got = getattr(getattr(clipped.attn, name), leaf)[...]
      want = getattr(getattr(model.attn, name), leaf)[...]
      assert_trees_close(got, want * np.sqrt(gamma), rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(clipped.attn.value.kernel[...], model.attn.value.kernel[...])
