"""The small nnx GPT the routing tests route: tied or untied head, multi-head attention,
optionally returning its hidden states as transformers models do."""

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
    self.proj = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  def __init__(self, vocab=64, d=16, heads=2, layers=2, seq=8, tied=False, *, rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos_embed = nnx.Embed(seq, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)
    self.lm_head = None if tied else nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

  def __call__(self, ids, hidden_states=False):
    x = self.embed(ids) + self.pos_embed(jnp.arange(ids.shape[-1]))
    hidden = []
    for block in self.blocks:
      x = block(x)
      hidden.append(x)
    x = self.ln_f(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return (logits, tuple(hidden)) if hidden_states else logits
