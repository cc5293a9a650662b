"""A Llama-style decoder in Flax Linen, written as trainers write it: layers under
`nn.scan` with `nn.remat`, every parameter named by logical axes
(`nn.with_logical_partitioning`; `nn.logical_axis_rules` map them to a mesh), bfloat16
compute on float32 params, RMSNorm, RoPE, grouped-query attention, a SwiGLU MLP or a
mixture of experts (top-k routing with a capacity, experts stacked on an "exp" axis and
applied as one einsum), and a cross-entropy computed a chunk of the sequence at a time so
that a chunk's logits, never the whole sequence's, are live.

Logical axes: params "vocab", "embed", "heads", "kv_heads", "mlp", "exp", "norm" (and
"layers", the scanned axis); activations "batch", "length", "act_embed", "act_heads",
"act_mlp", "act_vocab", "act_exp", "exp_batch".
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

INIT = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model shape. `experts` > 0 makes every MLP a mixture of that many SwiGLU experts,
  each token sent to `top_k` of them, each expert taking at most `capacity` × its fair
  share of a sequence's tokens. `loss_chunks`: the sequence's logits are formed in this
  many chunks. `dtype`: compute dtype (params stay float32)."""

  layers: int
  d_model: int
  heads: int
  kv_heads: int
  ffn: int
  vocab: int
  experts: int = 0
  top_k: int = 2
  capacity: float = 1.25
  rope: bool = True
  loss_chunks: int = 1
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.d_model % self.heads or self.heads % self.kv_heads:
      raise ValueError(f"d_model={self.d_model}, heads={self.heads}, kv_heads={self.kv_heads}: "
                       "heads must divide d_model and kv_heads must divide heads.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


# Llama-3-8B, and Mixtral-8x7B (its own 32000-token vocabulary, top-2 of 8 experts).
LLAMA3_8B = LlamaConfig(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
MIXTRAL_8X7B = LlamaConfig(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336,
                           vocab=32000, experts=8)


def matmul_params(cfg: LlamaConfig) -> int:
  """Weights each token multiplies by, per step: attention, the MLP (the router and its
  top_k experts for a MoE), the LM head; the embedding is a lookup."""
  attn = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.kv_heads * cfg.head_dim
  mlp = 3 * cfg.d_model * cfg.ffn * (cfg.top_k if cfg.experts else 1)
  router = cfg.d_model * cfg.experts
  return cfg.layers * (attn + mlp + router) + cfg.d_model * cfg.vocab


def model_flops(cfg: LlamaConfig, tokens: int, seq_len: int) -> float:
  """A training step's model flops (PaLM's convention, arXiv 2204.02311 App. B):
  6 per token per weight it multiplies by, plus attention's 12 · layers · seq_len ·
  d_model per token; remat's recomputation is not counted."""
  return tokens * (6 * matmul_params(cfg) + 12 * cfg.layers * seq_len * cfg.d_model)


def _dense(features: int, axes: tuple, cfg: LlamaConfig, name: str) -> nn.Dense:
  return nn.Dense(features, use_bias=False, dtype=cfg.dtype, param_dtype=jnp.float32,
                  kernel_init=nn.with_logical_partitioning(INIT, axes), name=name)


def _norm(cfg: LlamaConfig, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name=name,
                    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)))


def wide(dtype) -> jnp.dtype:
  """The dtype sensitive sums run in: float32, or the compute dtype if wider (float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def rope(x: jax.Array, base: float = 500000.0) -> jax.Array:
  """Rotary position embedding of (batch, length, heads, head_dim), Llama-3's base."""
  half, dtype = x.shape[-1] // 2, wide(x.dtype)
  freq = base ** (-jnp.arange(half, dtype=dtype) / half)
  angle = jnp.arange(x.shape[1], dtype=dtype)[:, None] * freq  # (length, half)
  cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
  a, b = x[..., :half].astype(dtype), x[..., half:].astype(dtype)
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


class Attention(nn.Module):
  """Causal grouped-query attention: q (d, heads·head_dim), k and v (d, kv_heads·head_dim)."""

  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, (b, t, _) = self.cfg, x.shape
    split = lambda y, h: nn.with_logical_constraint(
        y.reshape(b, t, h, cfg.head_dim), ("batch", "length", "act_heads", None))
    q = split(_dense(cfg.heads * cfg.head_dim, ("embed", "heads"), cfg, "q")(x), cfg.heads)
    k = split(_dense(cfg.kv_heads * cfg.head_dim, ("embed", "kv_heads"), cfg, "k")(x),
              cfg.kv_heads)
    v = split(_dense(cfg.kv_heads * cfg.head_dim, ("embed", "kv_heads"), cfg, "v")(x),
              cfg.kv_heads)
    if cfg.rope:
      q, k = rope(q), rope(k)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, -1)
    return _dense(cfg.d_model, ("heads", "embed"), cfg, "o")(out)


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) · up(x))."""

  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    h = (nn.silu(_dense(cfg.ffn, ("embed", "mlp"), cfg, "gate")(x))
         * _dense(cfg.ffn, ("embed", "mlp"), cfg, "up")(x))
    h = nn.with_logical_constraint(h, ("batch", "length", "act_mlp"))
    return _dense(cfg.d_model, ("mlp", "embed"), cfg, "down")(h)


def dispatch_masks(probs: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """GShard's dispatch and combine tensors (batch, length, experts, capacity) of router
  probabilities (batch, length, experts): each token goes to its top_k experts, to the
  next free slot; first choices take slots before second ones, a full expert drops it."""
  weight, expert = jax.lax.top_k(probs, top_k)  # (b, t, k)
  chosen = jax.nn.one_hot(expert, probs.shape[-1], dtype=jnp.int32)  # (b, t, k, e)
  b, t, k, e = chosen.shape
  by_rank = chosen.transpose(0, 2, 1, 3).reshape(b, k * t, e)
  slot = (jnp.cumsum(by_rank, axis=1) * by_rank - 1).reshape(b, k, t, e).transpose(0, 2, 1, 3)
  kept = (slot >= 0) & (slot < capacity)  # (b, t, k, e)
  onehot = jax.nn.one_hot(jnp.where(kept, slot, -1), capacity, dtype=probs.dtype)
  dispatch = onehot.sum(2)  # (b, t, e, c): a token takes one slot at most per expert
  combine = (onehot * weight[..., None, None]).sum(2)
  return dispatch, combine


class MoE(nn.Module):
  """Experts stacked (experts, d, ffn) and applied as one einsum over an "exp" axis."""

  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, (_, t, d) = self.cfg, x.shape
    stacked = lambda name, shape, axes: self.param(
        name, nn.with_logical_partitioning(INIT, axes), (cfg.experts, *shape), jnp.float32
    ).astype(cfg.dtype)
    router = _dense(cfg.experts, ("embed", None), cfg, "router")
    probs = jax.nn.softmax(router(x).astype(wide(cfg.dtype)), axis=-1)
    capacity = math.ceil(cfg.capacity * cfg.top_k * t / cfg.experts)
    dispatch, combine = dispatch_masks(probs, cfg.top_k, capacity)
    per_expert = ("act_exp", "exp_batch", None, "act_embed")
    xe = nn.with_logical_constraint(
        jnp.einsum("btec,btd->ebcd", dispatch.astype(cfg.dtype), x), per_expert)
    gate = jnp.einsum("ebcd,edf->ebcf", xe, stacked("gate", (d, cfg.ffn), ("exp", "embed", "mlp")))
    up = jnp.einsum("ebcd,edf->ebcf", xe, stacked("up", (d, cfg.ffn), ("exp", "embed", "mlp")))
    h = nn.with_logical_constraint(nn.silu(gate) * up, ("act_exp", "exp_batch", None, "act_mlp"))
    y = jnp.einsum("ebcf,efd->ebcd", h, stacked("down", (cfg.ffn, d), ("exp", "mlp", "embed")))
    y = nn.with_logical_constraint(y, per_expert)
    return jnp.einsum("btec,ebcd->btd", combine.astype(cfg.dtype), y)


class Block(nn.Module):
  """x + attn(norm(x)), then x + mlp(norm(x)); a scan body: (carry, _) -> (carry, None)."""

  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    x = x + Attention(self.cfg, name="attn")(_norm(self.cfg, "attn_norm")(x))
    mlp = MoE if self.cfg.experts else Mlp
    return x + mlp(self.cfg, name="mlp")(_norm(self.cfg, "mlp_norm")(x)), None


def chunked_cross_entropy(x: jax.Array, head: jax.Array, targets: jax.Array,
                          chunks: int) -> jax.Array:
  """Mean next-token cross-entropy of hidden states (batch, length, d) through the head
  (d, vocab), `chunks` pieces of the sequence at a time (each rematerialized in the
  backward pass), logits in float32 (or the compute dtype if wider)."""
  b, t, d = x.shape
  if t % chunks:
    raise ValueError(f"loss_chunks={chunks} must divide the sequence length {t}.")
  xs = x.reshape(b, chunks, t // chunks, d).swapaxes(0, 1)
  ts = targets.reshape(b, chunks, t // chunks).swapaxes(0, 1)

  @jax.checkpoint
  def chunk(total, piece):
    xc, tc = piece
    logits = jnp.einsum("btd,dv->btv", xc, head.astype(x.dtype), preferred_element_type=wide(x.dtype))
    logits = nn.with_logical_constraint(logits, ("batch", "length", "act_vocab"))
    picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
    return total + (jax.nn.logsumexp(logits, axis=-1) - picked).sum(), None

  total, _ = jax.lax.scan(chunk, jnp.zeros((), wide(x.dtype)), (xs, ts))
  return total / (b * t)


class Llama(nn.Module):
  """(inputs, targets) int (batch, length) -> mean next-token loss."""

  cfg: LlamaConfig

  @nn.compact
  def __call__(self, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, param_dtype=jnp.float32, name="embed",
                 embedding_init=nn.with_logical_partitioning(INIT, ("vocab", "embed")))(inputs)
    layers = nn.scan(nn.remat(Block, prevent_cse=False), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=cfg.layers,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = layers(cfg, name="layers")(x, None)
    x = _norm(cfg, "final_norm")(x)
    head = self.param("lm_head", nn.with_logical_partitioning(INIT, ("embed", "vocab")),
                      (cfg.d_model, cfg.vocab), jnp.float32)
    return chunked_cross_entropy(x, head, targets, cfg.loss_chunks)
