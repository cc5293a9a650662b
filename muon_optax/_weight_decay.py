"""Decoupled weight decay, everywhere or cautiously: only where the update and the
parameter agree in sign, so that the decay never pulls against the step."""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
import optax

from muon_optax._util import tree_fit, validate
from muon_optax._util.types import Mask, ScalarOrSchedule


@dataclasses.dataclass(frozen=True)
class WeightDecay:
  """Weight decay as one value, where the aliases take `weight_decay=`: its rate (a
  number or a schedule) and whether it is cautious (see `add_decayed_weights`).

  Examples:
    >>> import muon_optax as mo
    >>> tx = mo.muon(0.02, weight_decay=mo.WeightDecay(0.1, cautious=True))
  """

  rate: ScalarOrSchedule = 0.0
  cautious: bool = False

  def __post_init__(self):
    validate.weight_decay("weight_decay", self.rate)
    if not isinstance(self.cautious, bool):
      raise ValueError(f"cautious must be True or False, got {self.cautious!r}.")


def as_weight_decay(value: Union[WeightDecay, ScalarOrSchedule]) -> WeightDecay:
  return value if isinstance(value, WeightDecay) else WeightDecay(value)


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0, mask: Mask = None, *,
                        cautious: bool = False) -> optax.GradientTransformation:
  """Adds `weight_decay`·p to each update u (decoupled decay, before the learning rate).

  cautious=True decays only where u·p ≥ 0, where the step and the decay move the
  parameter the same way (Chen et al. 2025): p ← p − lr·(u + λ·𝕀(u ⊙ p ≥ 0) ⊙ p).
  Otherwise as `optax.add_decayed_weights`, whose state it keeps.

  Args:
    weight_decay: the rate λ ≥ 0, or a schedule of the step.
    mask: where it applies: a tree of bools or a callable params -> such a tree.
    cautious: decay only where update and parameter agree in sign.

  Returns:
    An `optax.GradientTransformation`; its update needs the params.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.add_decayed_weights(0.5, cautious=True)
    >>> p = {"w": jnp.array([1.0, 1.0])}
    >>> u, _ = tx.update({"w": jnp.array([1.0, -1.0])}, tx.init(p), p)
    >>> u["w"].tolist()  # decayed where u and p agree, untouched where they do not
    [1.5, -1.0]

  References:
    Chen et al. 2025, "Cautious Weight Decay", arXiv 2510.12402.
  """
  validate.weight_decay("weight_decay", weight_decay)
  if not cautious:
    return optax.add_decayed_weights(weight_decay, mask)
  plain = optax.add_decayed_weights(weight_decay, mask)

  def update_fn(updates, state, params=None):
    decayed, state = plain.update(updates, state, params)

    def gate(u, d, p):  # d − u is λ·p where the mask applies, 0 elsewhere
      agree = (u * p) >= 0
      return jnp.where(agree, d, u).astype(u.dtype)

    return jax.tree.map(gate, updates, decayed, params), state

  return optax.GradientTransformation(plain.init, update_fn)


def decay_part(weight_decay: Union[WeightDecay, ScalarOrSchedule], mask: Mask) -> Any:
  """The decay of a family branch, `mask` over the full params."""
  decay = as_weight_decay(weight_decay)
  return add_decayed_weights(decay.rate, tree_fit.branch_mask(mask), cautious=decay.cautious)
