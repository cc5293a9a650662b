"""Flax NNX pieces for QK-clip: attention that records each head's largest pre-softmax logit.

`muon_optax.nnx` is the only module that imports Flax; `import muon_optax` does not.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from muon_optax._qk_clip import MAX_LOGITS, collect_max_logits

__all__ = ["ClipAttention", "head_max_logits", "max_logit_attention", "max_logits"]


def head_max_logits(query: jax.Array, key: jax.Array, mask: Optional[jax.Array] = None, *,
                    axis_name: Optional[str] = None) -> tuple[jax.Array, jax.Array]:
  """Pre-softmax logits and each head's largest one over every unmasked position.

  logits[..., h, i, j] = q_i^h · k_j^h / √d,  S_h = max over batch, i, j (unmasked) of logits.

  Under `jit` with a batch sharded over a mesh axis the max is already global (XLA
  inserts the all-reduce); inside `shard_map` pass `axis_name` to max-reduce across it.

  Args:
    query, key: (batch..., length, heads, head_dim).
    mask: bool, broadcastable to (batch..., heads, q_length, kv_length); False
      positions are ignored.
    axis_name: mapped axis to max-reduce over, or None.

  Returns:
    (logits of shape (batch..., heads, q_length, kv_length), S of shape (heads,)),
    S in float32.
  """
  if query.shape[-2:] != key.shape[-2:]:
    raise ValueError(
        f"query (…, heads, head_dim) = {query.shape[-2:]} and key {key.shape[-2:]} differ; "
        "per-head max logits need one key head per query head.")
  query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
  logits = jnp.einsum("...qhd,...khd->...hqk", query, key)
  seen = logits if mask is None else jnp.where(mask, logits, -jnp.inf)
  axes = tuple(a for a in range(logits.ndim) if a != logits.ndim - 3)
  s = jnp.max(jax.lax.stop_gradient(seen).astype(jnp.float32), axis=axes)
  if axis_name is not None:
    s = jax.lax.pmax(s, axis_name)
  return logits, s


def max_logit_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                        bias: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                        broadcast_dropout: bool = True, dropout_rng: Optional[jax.Array] = None,
                        dropout_rate: float = 0.0, deterministic: bool = False,
                        dtype: Any = None, precision: Any = None,
                        module: Optional[nnx.Module] = None, is_causal: bool = False,
                        axis_name: Optional[str] = None, **_: Any) -> jax.Array:
  """Dot-product attention that sows each head's max pre-softmax logit into `module`.

  A drop-in `attention_fn` for `nnx.MultiHeadAttention`: the module sows the (heads,)
  array `max_logits` (an `nnx.Intermediate`) when called with `sow_weights=True`.
  The max is taken over q·k/√d before any additive `bias`, since that is the part
  QK-clip controls.

  Examples:
    >>> import jax.numpy as jnp
    >>> from muon_optax.nnx import max_logit_attention
    >>> q = k = v = jnp.ones((2, 5, 4, 8))        # (batch, length, heads, head_dim)
    >>> max_logit_attention(q, k, v).shape
    (2, 5, 4, 8)
  """
  if dtype is not None:
    query, key, value = (x.astype(dtype) for x in (query, key, value))
  if is_causal:
    causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  logits, s = head_max_logits(query, key, mask, axis_name=axis_name)
  if module is not None:
    module.sow(nnx.Intermediate, MAX_LOGITS, s)
  if bias is not None:
    logits = logits + bias
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits, axis=-1)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = (1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * keep.astype(weights.dtype) / keep_prob
  return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


class ClipAttention(nnx.MultiHeadAttention):
  """Causal multi-head self-attention that sows each head's max logit S_h for `qk_clip`.

  An `nnx.MultiHeadAttention` (same parameters: `query`, `key`, `value`, `out`) whose
  forward pass applies a causal mask and sows S_h = max over the batch of q·k/√d, a
  (heads,) float32 array named `max_logits`. Collect it with `nnx.capture` and turn it
  into `qk_clip`'s argument with `max_logits`.

  Args:
    num_heads: as for `nnx.MultiHeadAttention`.
    in_features: as for `nnx.MultiHeadAttention`.
    axis_name: max-reduce S_h over this mapped axis (inside `shard_map` only; under
      `jit` with a sharded batch the max is global already).
    **kwargs: any other `nnx.MultiHeadAttention` option; `decode=False` and
      `attention_fn` are what this module is (it sows the max logits and runs no cache).

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from muon_optax.nnx import ClipAttention, max_logits
    >>> attn = ClipAttention(4, 32, rngs=nnx.Rngs(0))
    >>> y, inter = nnx.capture(attn, nnx.Intermediate)(jnp.ones((2, 10, 32)))
    >>> max_logits(inter)[""].shape
    (4,)

  References:
    Kimi Team 2025, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534.
  """

  def __init__(self, num_heads: int, in_features: int, *, rngs: nnx.Rngs,
               axis_name: Optional[str] = None, **kwargs: Any):
    # Accepted as nnx.MultiHeadAttention takes them, as long as they ask for this module.
    if kwargs.pop("decode", False) or kwargs.pop("attention_fn", None) is not None:
      raise ValueError("ClipAttention takes decode=False and no attention_fn: it sows the max "
                       "logits of its own attention and keeps no cache. Use "
                       "nnx.MultiHeadAttention for decoding or another attention function.")
    fn = functools.partial(max_logit_attention, axis_name=axis_name)
    super().__init__(num_heads, in_features, attention_fn=fn, decode=False, rngs=rngs, **kwargs)

  def __call__(self, x: jax.Array, *, mask: Optional[jax.Array] = None, **kwargs: Any) -> jax.Array:
    causal = nnx.make_causal_mask(jnp.ones(x.shape[:-1], bool))
    mask = causal if mask is None else nnx.combine_masks(causal, mask)
    return super().__call__(x, mask=mask, sow_weights=True, **kwargs)


def max_logits(intermediates: Any) -> dict[str, jax.Array]:
  """{attention module path: S_h} from sown intermediates, the argument of `qk_clip`.

  `intermediates` is the `nnx.Intermediate` state from `nnx.capture` (or `nnx.pop`),
  or any pytree of arrays: a leaf whose path contains `max_logits` belongs to the
  module above that name, any other leaf to its own path. A module that sowed
  several times (called more than once) gets the elementwise max of its entries.

  Examples:
    >>> import jax.numpy as jnp
    >>> from muon_optax.nnx import max_logits
    >>> max_logits({"attn": {"max_logits": (jnp.array([1., 5.]), jnp.array([3., 2.]))}})
    {'attn': Array([3., 5.], dtype=float32)}
  """
  return collect_max_logits(nnx.as_pure(intermediates))
