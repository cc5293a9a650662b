"""`Kernel`: what runs Newton–Schulz where matrices are dealt over devices, built once
from a `NewtonSchulz` and handed whole to the mesh's solver."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp

from muon_optax._newton_schulz.iteration import (
  newton_schulz,
  newton_schulz_column_parts,
  newton_schulz_whole_products,
)
from muon_optax._newton_schulz.settings import NewtonSchulz

# A custom `fn` is priced, where a mesh balances the work, as Jordan's standard quintic:
# its own flops are unknown.
CUSTOM_FN_PRICE = NewtonSchulz("jordan", gram=False)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """What runs Newton–Schulz where matrices are dealt over devices, one value built from
  a `NewtonSchulz` (`Kernel.of`) that travels whole.

  Attributes:
    whole: a (count, m, n) stack of wide matrices -> its orthogonalization.
    column_parts: `newton_schulz_column_parts` with the same settings: runs matrices
      split by columns over several devices, `(x, parts, reduce, rows=)`; None where
      matrices must be orthogonalized whole (a custom `fn`, a selection around it).
    priced: the settings whose flops and traffic the mesh's cost model weighs.
    operands: the dtype the iteration rounds its matmul operands to; None where that is
      unknown (a custom `fn`).
  """

  whole: Callable[[jax.Array], jax.Array]
  column_parts: Optional[Callable[..., jax.Array]]
  priced: NewtonSchulz
  operands: Optional[jnp.dtype] = None

  @classmethod
  def of(cls, ns: NewtonSchulz, whole_products: bool = False) -> Kernel:
    """The built-in iteration with `ns`'s settings, or `ns.fn` on whole matrices only;
    `whole_products`: every product formed whole, as a mesh forms them
    (`newton_schulz_whole_products`)."""
    if ns.fn is not None:
      return cls(ns.fn, None, CUSTOM_FN_PRICE)
    whole = newton_schulz_whole_products if whole_products else newton_schulz
    return cls(functools.partial(whole, ns=ns),
               functools.partial(newton_schulz_column_parts, ns=ns), ns, jnp.dtype(ns.dtype()))

  def around(self, wrap: Callable[[Callable], Callable]) -> Kernel:
    """Whole stacks go through `wrap(whole)` instead (a selection around Newton–Schulz);
    such stacks are never split."""
    return Kernel(wrap(self.whole), None, self.priced, self.operands)
