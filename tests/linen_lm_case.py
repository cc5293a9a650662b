"""A decoder-only Linen LM laid out as google-deepmind/nanodo lays out its params: the
names and shapes users of that trainer hand to muon_optax.

    embed/embedding (V, D), pos_embed/embedding (L, D), out_ln/scale (D,)
    blocks_<i>/LayerNorm_0/scale, blocks_<i>/LayerNorm_1/scale (D,)
    blocks_<i>/CausalAttn_0/{query,key,value}/kernel (D, H, D/H)   DenseGeneral D -> (H, D/H)
    blocks_<i>/CausalAttn_0/attn_out_proj/kernel (H, D/H, D)       DenseGeneral (H, D/H) -> D
    blocks_<i>/Mlp_0/Dense_0/kernel (D, F), blocks_<i>/Mlp_0/Dense_1/kernel (F, D)

No biases; the output head is the token embedding (`Embed.attend`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

D, H, F, V, L, N = 128, 4, 256, 64, 16, 2


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    project = lambda name: nn.DenseGeneral((H, D // H), use_bias=False, name=name)(x)
    q, k, v = project("query"), project("key"), project("value")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // H) ** 0.5
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    heads = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, name="attn_out_proj")(heads)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden = jax.nn.gelu(nn.Dense(F, use_bias=False)(x))
    return nn.Dense(D, use_bias=False)(hidden)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + Attention(name="CausalAttn_0")(nn.LayerNorm(use_bias=False)(x))
    return x + Mlp(name="Mlp_0")(nn.LayerNorm(use_bias=False)(x))


class DecoderLM(nn.Module):
  def setup(self):
    self.embed = nn.Embed(V, D)
    self.pos_embed = nn.Embed(L, D)
    self.blocks = [Block() for _ in range(N)]
    self.out_ln = nn.LayerNorm(use_bias=False)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1])[None])
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.out_ln(x))


def model_and_params():
  """(the model, its params: `variables["params"]`, what the trainer's optimizer sees)."""
  model = DecoderLM()
  tokens = jnp.zeros((2, L), jnp.int32)
  return model, model.init(jax.random.key(0), tokens)["params"], tokens
