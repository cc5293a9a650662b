"""Routing: which leaves Muon updates, which go to AdamW, how each is a matrix, and why."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np

from muon_optax import _paths
from muon_optax._matrix_view import MatrixView, ViewFn, view_fn
from muon_optax._name_rules import (  # noqa: F401  (ADAM, FROZEN: for `_routing.X` users)
    ADAM, DEFAULT_RULES, FROZEN, LABELS, MUON, NAME_RULES_CAVEAT, Rule, apply_rules,
    check_rules)
from muon_optax._ns_plan import newton_schulz_plan

Labels = Any  # None, a label pytree (or a prefix of one), a callable params -> labels, a Routing


def expand_labels(label_tree: Any, params: Any) -> Any:
  """A label tree that is `params`' structure or a prefix of it (as `optax.partition`
  takes), spread to one label per leaf."""
  def spread(label, subtree):
    return jax.tree.map(lambda _: label, subtree, is_leaf=_paths.is_masked)

  try:
    return jax.tree.map(spread, label_tree, params)
  except (ValueError, TypeError) as e:
    hint = ""
    if isinstance(label_tree, (list, tuple)) and any(
        callable(r) or (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
                        and r[1] in LABELS and r[0] not in LABELS) for r in label_tree):
      hint = (" It looks like routing rules: pass them as rules=[...] or "
              "routing=muon_optax.Routing.from_rules([...]).")
    raise ValueError("the label tree does not match the params tree (it must have the params' "
                     f"structure or a prefix of it, as in optax.partition): {e}.{hint}") from None


class Decision(NamedTuple):
  """How one leaf is updated: its label, its matrix view (Muon leaves) and why."""
  label: str
  view: Optional[MatrixView]
  reason: str


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
  """Labels, matrix views and a reason per leaf: one value for `muon`, `describe`,
  `Checkpointer` and `convert_adam_state`.

  Build it with `infer_routing` (from the computation), `Routing.from_rules` (by
  name) or `Routing.from_labels` (a label pytree or a callable params -> labels).

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"w": jnp.ones((4, 8)), "out": jnp.ones((8, 2))}
    >>> routing = mo.infer_routing(lambda p, x: (x @ p["w"]) @ p["out"], params, jnp.ones((3, 4)))
    >>> routing.labels(params)
    {'out': 'adam', 'w': 'muon'}
    >>> tx = mo.muon(0.02, routing=routing)
  """
  decisions: Optional[Mapping[str, tuple[tuple[int, ...], Decision]]] = None
  rules: Optional[tuple[Rule, ...]] = None
  label_source: Any = None  # a label tree or a callable params -> labels
  views: Optional[ViewFn] = None
  per_head: bool = False

  @classmethod
  def from_rules(cls, rules: Optional[Sequence[Rule]] = None, *, views: Optional[ViewFn] = None,
                 per_head: bool = False) -> "Routing":
    """Name rules ((regex, label) pairs or callables, first match wins; None: `DEFAULT_RULES`)."""
    return cls(rules=DEFAULT_RULES if rules is None else check_rules(rules), views=views,
               per_head=per_head)

  @classmethod
  def from_labels(cls, labels: Any, *, views: Optional[ViewFn] = None,
                  per_head: bool = False) -> "Routing":
    """A label pytree (or a prefix of one), or a callable params -> label pytree."""
    return cls(label_source=labels, views=views, per_head=per_head)

  def _find(self, path: str, shape: tuple[int, ...]) -> Optional[Decision]:
    """The decision for `path`, or for the one inferred path that ends with it (a
    Routing inferred from Linen `variables` serves `variables["params"]` too)."""
    found = self.decisions.get(path)
    if found is None:
      matches = [v for k, v in self.decisions.items() if k.endswith("/" + path)]
      found = matches[0] if len(matches) == 1 else None
    return found[1] if found is not None and found[0] == shape else None

  def _decision(self, path: str, leaf: Any) -> Decision:
    shape = tuple(np.shape(leaf))
    decision = self._find(path, shape)
    if decision is None:
      raise ValueError(
          f"parameter {path!r} of shape {shape} is not in this Routing (inferred for "
          f"{list(self.decisions)[:3]}, ...); infer it again from these params.")
    return decision

  def _given(self, params: Any) -> Any:
    source = self.label_source
    return expand_labels(source(params) if callable(source) else source, params)

  def decide(self, params: Any) -> list[tuple[str, Any, Decision]]:
    """(path, leaf, Decision) of every leaf of `params`, in tree order."""
    pairs = _paths.leaves_with_path(params)
    if self.decisions is not None:
      return [(p, x, self._decision(p, x)) for p, x in pairs]
    if self.rules is not None:
      found = [apply_rules(self.rules, p, x) for p, x in pairs]
    else:
      found = [(l, "given label") for _, l in _paths.leaves_with_path(self._given(params))]
    views = view_fn(self.views, self.per_head)
    return [(p, x, Decision(l, views(p, tuple(np.shape(x))) if l == MUON else None, why))
            for (p, x), (l, why) in zip(pairs, found)]

  def labels(self, params: Any) -> Any:
    """The label pytree of `params` ("muon", "adam" or "frozen" per leaf)."""
    if self.decisions is not None:
      return _paths.map_with_path(lambda p, x: self._decision(p, x).label, params)
    if self.rules is not None:
      return _paths.map_with_path(lambda p, x: apply_rules(self.rules, p, x)[0], params)
    return self._given(params)

  def view(self, path: str, shape: tuple[int, ...]) -> Optional[MatrixView]:
    """The matrix view of the leaf at `path` with logical `shape` (a `ViewFn`)."""
    decision = None if self.decisions is None else self._find(path, tuple(shape))
    if decision is not None and decision.view is not None:
      return decision.view
    return view_fn(self.views, self.per_head)(path, tuple(shape))

  def __str__(self) -> str:
    if self.decisions is None:
      return repr(self)
    shapes = {p: jax.ShapeDtypeStruct(s, np.float32) for p, (s, _) in self.decisions.items()}
    return describe(shapes, routing=self)


def as_routing(*, routing: Optional[Routing] = None, labels: Labels = None,
               rules: Optional[Sequence[Rule]] = None, views: Optional[ViewFn] = None,
               per_head: bool = False) -> Routing:
  """The one Routing meant by the `routing=` / `labels=` / `rules=` / `views=` shorthands."""
  if isinstance(labels, Routing):
    routing, labels = labels, None
  given = [n for n, v in (("routing", routing), ("labels", labels), ("rules", rules))
           if v is not None]
  if len(given) > 1:
    raise ValueError(f"pass only one of routing=, labels= and rules=, got {given}.")
  if routing is not None:
    if views is not None or per_head:
      raise ValueError("views= and per_head= are part of a Routing; pass them when building it.")
    return routing
  if labels is not None:
    return Routing.from_labels(labels, views=views, per_head=per_head)
  return Routing.from_rules(rules, views=views, per_head=per_head)


def resolve_labels(labels: Labels, params: Any) -> Any:
  """The full label pytree for `params` from None (default rules), a Routing, a callable
  or a label pytree (or prefix). Rules go through `rules=` or `Routing.from_rules`."""
  return as_routing(labels=labels).labels(params)


def check_leaf(path: str, leaf: Any, label: Any, views: ViewFn, known: Sequence[str]) -> None:
  """A ValueError naming `path` if the leaf cannot be updated as labelled."""
  if label not in known:
    raise ValueError(f"parameter {path!r} has label {label!r}, which has no transform; use "
                     f"one of {list(known)}.")
  if label != MUON:
    return
  shape, dtype = np.shape(leaf), jax.numpy.result_type(leaf)
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    raise ValueError(f"parameter {path!r} is labelled 'muon' but has dtype {dtype}; Muon needs "
                     "real floating weights. Label it 'adam' or 'frozen'.")
  if views(path, shape) is None:
    raise ValueError(f"parameter {path!r} of shape {shape} is labelled 'muon' but has no matrix "
                     "view (rank < 2). Label it 'adam', or pass views= to say how it is a matrix.")


def check_labels(label_tree: Any, params: Any, views: ViewFn, known: Sequence[str]) -> None:
  """Raises a ValueError naming the path of the first leaf that cannot be updated as labelled."""
  label_tree = expand_labels(label_tree, params)
  _paths.map_with_path(lambda p, x, l: check_leaf(p, x, l, views, known), params, label_tree)


def _rows(params: Any, routing: Routing, ns_options: dict) -> list[tuple]:
  """(path, shape, label, matrix view, Newton–Schulz plan or None, flops, reason) of
  every leaf; the plan is what `newton_schulz` runs with `ns_options` on this machine."""
  rows = []
  for path, leaf, decision in routing.decide(params):
    check_leaf(path, leaf, decision.label, routing.view, LABELS)
    shape = tuple(np.shape(leaf))
    view, plan, flops = "", None, 0
    if decision.label == MUON:
      v = routing.view(path, shape)
      count, fan_in, fan_out = v.matrix_shape(shape)
      plan = newton_schulz_plan((fan_in, fan_out), **ns_options)
      view, flops = v.describe(shape), count * plan.flops
    rows.append((path, shape, decision.label, view, plan, flops, decision.reason))
  return rows


def newton_schulz_cost(params: Any, labels: Labels = None, *, views: Optional[ViewFn] = None,
                       per_head: bool = False, routing: Optional[Routing] = None,
                       rules: Optional[Sequence[Rule]] = None, **ns_options) -> int:
  """Newton–Schulz matmul flops of one Muon update of `params` (the total `describe`
  prints). `ns_options` (ns, steps, gram, compute_dtype, precondition) are those given
  to `muon` / `newton_schulz`, with `steps` for `muon`'s ns_steps.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> mo.newton_schulz_cost({"w": jnp.ones((4, 8))}, ns="jordan", steps=5, gram=False)
    3200
  """
  routing = as_routing(routing=routing, labels=labels, rules=rules, views=views, per_head=per_head)
  return sum(row[5] for row in _rows(params, routing, ns_options))


def describe(params: Any, labels: Labels = None, *, views: Optional[ViewFn] = None,
             per_head: bool = False, routing: Optional[Routing] = None,
             rules: Optional[Sequence[Rule]] = None, **ns_options) -> str:
  """The routing table: path, shape, label, matrix view, the Newton–Schulz variant that
  will run and its flops, and why, per leaf; then totals and the Newton–Schulz settings.

  Args:
    params: the params pytree (arrays or `jax.ShapeDtypeStruct`s).
    labels, rules, views, per_head, routing: the routing, as given to `muon`.
    **ns_options: ns, steps, gram, compute_dtype, precision, precondition, as given to
      `newton_schulz` (`muon`'s ns_steps is `steps`); "auto" settings are resolved for
      `jax.default_backend()`, or for `backend=` ("cpu", "gpu", "tpu").

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> print(mo.describe({"w": jnp.ones((4, 8)), "b": jnp.ones(8)}, backend="cpu"))
    path  shape  label  matrix view  NS    NS flops  why
    ----  -----  -----  -----------  ----  --------  -------------
    b     8      adam                                rank < 2
    w     4×8    muon   4×8          gram  2,304     name → weight
    <BLANKLINE>
    adam: 8 parameters
    muon: 32 parameters, 2,304 Newton–Schulz flops per step
    Newton–Schulz: 4 steps, aol scaling, float32 operands with float32 accumulation, ...
  """
  routing = as_routing(routing=routing, labels=labels, rules=rules, views=views, per_head=per_head)
  rows, totals = [], {}
  plans = []
  for path, shape, label, view, plan, flops, why in _rows(params, routing, ns_options):
    n, f = totals.get(label, (0, 0))
    totals[label] = (n + int(np.prod(shape)), f + flops)
    plans += [plan] if plan else []
    rows.append((path, "×".join(map(str, shape)) or "()", label, view,
                 plan.variant if plan else "", f"{flops:,}" if flops else "", why))
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
  if routing.rules is not None:
    lines.append(NAME_RULES_CAVEAT)
  return "\n".join(lines)
