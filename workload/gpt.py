"""A small GPT in Flax nnx: token + position embeddings, pre-LayerNorm blocks of causal
`nnx.MultiHeadAttention` and a GELU MLP, and an lm_head (untied by default).

Parameter names follow the conventions `muon_optax.label_params` knows: `embed` and
`pos_embed` (embeddings) and `lm_head` go to AdamW, the attention and MLP kernels to
Muon, LayerNorm scales and biases to AdamW. Check with `mo.describe(nnx.state(model,
nnx.Param))`.

`GPTConfig(attention="clip")` uses `mo.nnx.ClipAttention`, which sows every head's max
attention logit for `mo.qk_clip` (see `examples/qk_clip.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import muon_optax as mo

ATTENTION = ("mha", "clip", "fused")


class FusedAttention(nnx.Module):
  """Causal attention with q, k and v in one kernel, as GPT-2 and nanoGPT write it: the
  (d, 3d) product is split into q, k and v, then heads."""

  def __init__(self, heads: int, d: int, *, use_bias: bool, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(d, 3 * d, use_bias=use_bias, rngs=rngs)
    self.out = nnx.Linear(d, d, use_bias=use_bias, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    *lead, d = x.shape
    heads = lambda y: y.reshape(*lead, self.heads, d // self.heads)
    q, k, v = (heads(y) for y in jnp.split(self.qkv(x), 3, axis=-1))
    return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(*lead, d))


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model shape. `vocab_size=256` is byte level; `tie_embeddings` reuses `embed` as the head.

  `attention`: "mha" (causal `nnx.MultiHeadAttention`), "clip" (causal
  `mo.nnx.ClipAttention`, same parameters, sows max logits) or "fused" (`FusedAttention`:
  one (d, 3d) q/k/v kernel whose product is split in three); `attn_bias`: q/k/v/out biases.
  """

  vocab_size: int = 256
  seq_len: int = 128
  d_model: int = 128
  layers: int = 4
  heads: int = 4
  mlp_ratio: int = 4
  tie_embeddings: bool = False
  attention: str = "mha"
  attn_bias: bool = True

  def __post_init__(self):
    if self.attention not in ATTENTION:
      raise ValueError(f"attention={self.attention!r}; use one of {ATTENTION}.")
    if self.d_model % self.heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads}.")


class Block(nnx.Module):
  """x + attn(ln1(x)), then x + mlp(ln2(x))."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    # `attn` in the path tells the default matrix view that `out` is an attention output.
    # keep_rngs=False: no dropout, so the module holds no RNG state.
    self.causal = cfg.attention == "mha"  # the others always apply a causal mask
    if cfg.attention == "fused":
      self.attn = FusedAttention(cfg.heads, d, use_bias=cfg.attn_bias, rngs=rngs)
    else:
      attention = nnx.MultiHeadAttention if cfg.attention == "mha" else mo.nnx.ClipAttention
      self.attn = attention(cfg.heads, d, use_bias=cfg.attn_bias, keep_rngs=False, rngs=rngs,
                            **({"decode": False} if self.causal else {}))
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if isinstance(self.attn, FusedAttention):
      x = x + self.attn(self.ln1(x))
    else:
      causal = {"is_causal": True} if self.causal else {}
      x = x + self.attn(self.ln1(x), deterministic=True, **causal)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))


class GPT(nnx.Module):
  """tokens (batch, time) int -> logits (batch, time, vocab_size)."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs)
    self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, embedding_init=init, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
    self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                kernel_init=init, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[-1]
    if t > self.cfg.seq_len:
      raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}.")
    x = self.embed(tokens) + self.pos_embed(jnp.arange(t))
    for block in self.blocks:
      x = block(x)
    x = self.ln_f(x)
    return self.embed.attend(x) if self.cfg.tie_embeddings else self.lm_head(x)


def num_params(model: nnx.Module) -> int:
  """Number of trainable scalars."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def loss_fn(model: GPT, batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) of a (batch, seq_len + 1) block of tokens."""
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = model(inputs).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
