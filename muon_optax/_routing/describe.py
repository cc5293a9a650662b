"""`describe` and `newton_schulz_cost`: the routing table and the Newton–Schulz work it
implies, for the `routing=` and `ns=` given to `muon`."""

from __future__ import annotations

from typing import Any, Optional

from muon_optax._newton_schulz.settings import DEFAULT_NS, NS
from muon_optax._routing.table import routing_rows, routing_table
from muon_optax._routing.value import as_routing


def newton_schulz_cost(params: Any, *, routing: Any = None, ns: NS = DEFAULT_NS,
                       backend: Optional[str] = None) -> int:
  """Newton–Schulz matmul flops of one Muon update of `params` (the total `describe`
  prints), with the `routing=` and `ns=` given to `muon`, on `backend` (default: jax's).

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> mo.newton_schulz_cost({"w": jnp.ones((4, 8))}, ns=mo.NewtonSchulz("jordan", gram=False))
    3200
  """
  return sum(row[5] for row in routing_rows(params, as_routing(routing), ns, backend))


def describe(params: Any, *, routing: Any = None, ns: NS = DEFAULT_NS,
             backend: Optional[str] = None) -> str:
  """The routing table: path, shape, label, matrix view, the Newton–Schulz variant that
  will run and its flops, and why, per leaf; then totals and the Newton–Schulz settings.

  Args:
    params: the params pytree (arrays or `jax.ShapeDtypeStruct`s).
    routing: as given to `muon`.
    ns: as given to `muon`.
    backend: "cpu", "gpu" or "tpu", to resolve "auto" settings for; default: jax's.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> print(mo.describe({"w": jnp.ones((4, 8)), "b": jnp.ones(8)}, backend="cpu"))
    path  shape  label  matrix view  NS    NS flops  why
    ----  -----  -----  -----------  ----  --------  -------------
    b     8      adam                                rank < 2
    w     4×8    muon   4×8          gram  2,176     name → weight
    <BLANKLINE>
    adam: 8 parameters
    muon: 32 parameters, 2,176 Newton–Schulz flops per step
    Newton–Schulz: 4 steps, aol scaling, float32 operands with float32 accumulation, ...
  """
  return routing_table(params, as_routing(routing), ns, backend)
