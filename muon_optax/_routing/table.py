"""The routing table: per leaf its label, matrix view, the Newton–Schulz that runs and its
flops, and why (`routing_table`, what `describe` and `print(routing)` show), and the
warning for matrix views read from names alone (`warn_guessed_views`)."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Protocol

import numpy as np

from muon_optax._newton_schulz.settings import DEFAULT_NS, NS, as_newton_schulz
from muon_optax._newton_schulz.variant import newton_schulz_plan
from muon_optax._routing.labels import check_leaf
from muon_optax._routing.name_rules import (
  BY_NAME,
  GUESSED_VIEW_NOTE,
  LABELS,
  MUON,
  NAME_RULES_CAVEAT,
)


class RoutingFacts(Protocol):
  """What the table reads of a `Routing`, which prints its own table: its methods and
  fields, by name, so that this module need not import the class."""

  decisions: Any  # None, or how the computation routed each path
  rules: Any  # None, or the name rules it routes by
  views: Any  # None, or the matrix views it was given

  def decide(self, params: Any) -> list[tuple[str, Any, Any]]: ...  # (path, leaf, Decision)

  def view(self, path: str, shape: tuple[int, ...]) -> Any: ...  # a MatrixView or None


def guessed_views(routing: RoutingFacts, params: Any) -> list[str]:
  """Paths of the Muon leaves of rank ≥ 3 whose matrix view comes from their name alone
  (name rules or given labels without views=, or an override the computation gave no
  view for): a (4, 32, 128) kernel is 128×128 or 4 × (32×128) by its name only."""
  if routing.views is not None:
    return []
  return [path for path, leaf, decision in routing.decide(params)
          if decision.label == MUON and np.ndim(leaf) >= 3
          and (routing.decisions is None or decision.reason.endswith(BY_NAME))]


def warn_guessed_views(routing: RoutingFacts, params: Any) -> None:
  """One warning naming the leaves of `guessed_views`, if any."""
  found = guessed_views(routing, params)
  if found:
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    warnings.warn(f"{len(found)} parameter(s) ({shown}): {GUESSED_VIEW_NOTE} "
                  "muon_optax.describe(params, routing=...) shows each view.", stacklevel=3)


def routing_rows(params: Any, routing: RoutingFacts, ns: NS, backend: Optional[str]) -> list[tuple]:
  """(path, shape, label, matrix view, Newton–Schulz plan or None, flops, reason) of
  every leaf; the plan is what `newton_schulz` runs with `ns` on `backend`."""
  ns = as_newton_schulz(ns)
  rows = []
  for path, leaf, decision in routing.decide(params):
    check_leaf(path, leaf, decision.label, routing.view, LABELS)
    shape = tuple(np.shape(leaf))
    view, plan, flops = "", None, 0
    if decision.label == MUON:
      v = routing.view(path, shape)
      count, fan_in, fan_out = v.matrix_shape(shape)
      if ns.fn is None:
        plan = newton_schulz_plan((fan_in, fan_out), ns, backend=backend)
        flops = count * plan.flops
      view = v.describe(shape)
    rows.append((path, shape, decision.label, view, plan, flops, decision.reason))
  return rows


def routing_table(params: Any, routing: RoutingFacts, ns: NS = DEFAULT_NS,
                  backend: Optional[str] = None) -> str:
  """The table `describe` prints, for a `Routing` (see `describe`)."""
  rows, totals = [], {}
  plans = []
  guessed = set(guessed_views(routing, params))
  for path, shape, label, view, plan, flops, why in routing_rows(params, routing, ns, backend):
    if path in guessed:
      why = (why if why.endswith(BY_NAME) else f"{why}, {BY_NAME}") + " (!)"
    n, f = totals.get(label, (0, 0))
    totals[label] = (n + int(np.prod(shape)), f + flops)
    plans += [plan] if plan else []
    variant = plan.variant if plan else ("custom" if view else "")
    rows.append((path, "×".join(map(str, shape)) or "()", label, view, variant,
                 f"{flops:,}" if flops else "", why))
  header = ("path", "shape", "label", "matrix view", "NS", "NS flops", "why")
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  lines = [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
  lines.append("")
  for label, (n, f) in sorted(totals.items()):
    flops = f", {f:,} Newton–Schulz flops per step" if f else ""
    lines.append(f"{label}: {n:,} parameters{flops}")
  if plans:
    p = plans[0]
    lines.append(f"Newton–Schulz: {p.steps} steps, {p.precondition} scaling, "
                 f"{p.compute_dtype} operands with float32 accumulation, precision "
                 f"{p.precision}; NS is the standard or Gram-space iteration per shape.")
  elif as_newton_schulz(ns).fn is not None:
    lines.append("Newton–Schulz: a custom function (NewtonSchulz(fn=...)).")
  if guessed:
    lines.append(f"(!) {GUESSED_VIEW_NOTE}")
  if routing.rules is not None:
    lines.append(NAME_RULES_CAVEAT)
  return "\n".join(lines)
