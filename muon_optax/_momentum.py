"""The Muon momentum step: an EMA of gradients with an optional Nesterov look-ahead."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import optax
from jax.typing import ArrayLike

from muon_optax._util import validate


class MuonMomentumState(NamedTuple):
  mu: optax.Updates  # EMA of gradients, params' shapes, dtype mu_dtype or the params'.


def scale_by_muon_momentum(
    beta: ArrayLike = 0.95,
    *,
    nesterov: bool = True,
    mu_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
  """Muon's momentum: m ← β m + (1 − β) g; outputs (1 − β) g + β m if Nesterov, else m.

  Keller Jordan's reference and torch.optim.Muon use m ← β m + g; the two differ by
  a constant factor that Newton–Schulz's normalization removes.

  Args:
    beta: momentum decay β.
    nesterov: output the Nesterov look-ahead.
    mu_dtype: floating dtype of the momentum buffer (e.g. jnp.bfloat16); None keeps the
      params'.

  Returns:
    An `optax.GradientTransformation`; updates keep the gradients' dtype.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.scale_by_muon_momentum(0.9)
    >>> g = {"w": jnp.ones((2, 2))}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> round(float(u["w"][0, 0]), 6)  # 0.1 + 0.9 * 0.1
    0.19
  """
  validate.decay_rate("beta", beta)
  mu_dtype = validate.floating_dtype("mu_dtype", mu_dtype)

  def init_fn(params):
    return MuonMomentumState(mu=optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    if nesterov:
      out = optax.tree.update_moment(updates, mu, beta, 1)
    else:
      out = mu
    out = jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates)
    # Keep the buffer's dtype even when an injected (float32 array) beta promotes it.
    return out, MuonMomentumState(mu=optax.tree.cast_like(mu, state.mu))

  return optax.GradientTransformation(init_fn, update_fn)
