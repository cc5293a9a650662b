"""Routing: which leaves Muon updates, which go to AdamW, how each is a matrix, and why."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import numpy as np

from muon_optax._routing.labels import expand_labels
from muon_optax._routing.matrix_view import MatrixView, ViewFn, view_fn
from muon_optax._routing.name_rules import (
  DEFAULT_RULES,
  MUON,
  Rule,
  apply_rules,
  check_rules,
)
from muon_optax._routing.table import routing_table
from muon_optax._util import paths


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

  Examples:
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
                 per_head: bool = False) -> Routing:
    """Name rules ((regex, label) pairs or callables, first match wins; None: `DEFAULT_RULES`)."""
    return cls(rules=DEFAULT_RULES if rules is None else check_rules(rules), views=views,
               per_head=per_head)

  @classmethod
  def from_labels(cls, labels: Any, *, views: Optional[ViewFn] = None,
                  per_head: bool = False) -> Routing:
    """A label pytree (or a prefix of one), or a callable params -> label pytree."""
    return cls(label_source=labels, views=views, per_head=per_head)

  def _key(self, path: str) -> Optional[str]:
    """The inferred path serving `path`: itself, else `path` under the one top-level
    collection that has it (a Routing inferred from Linen `variables` serves
    `variables["params"]`). Paths match whole, never by suffix."""
    if path in self.decisions:
      return path
    found = [k for k in (f"{c}/{path}" for c in self._collections) if k in self.decisions]
    if len(found) > 1:
      raise ValueError(f"parameter {path!r} matches {found} in this Routing; route the "
                       "whole tree it was inferred from, or infer it from these params.")
    return found[0] if found else None

  @functools.cached_property
  def _collections(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k.split("/", 1)[0] for k in self.decisions if "/" in k))

  def _find(self, path: str, shape: tuple[int, ...]) -> Optional[Decision]:
    key = self._key(path)
    found = None if key is None else self.decisions[key]
    return found[1] if found is not None and found[0] == shape else None

  def _decision(self, path: str, leaf: Any) -> Decision:
    shape = tuple(np.shape(leaf))
    key = self._key(path)
    if key is None:
      near = difflib.get_close_matches(path, list(self.decisions), n=3, cutoff=0.5)
      near = f"; nearest inferred paths: {near}" if near else ""
      raise ValueError(f"parameter {path!r} of shape {shape} is not in this Routing "
                       f"({len(self.decisions)} inferred paths{near}); infer it again from "
                       "these params.")
    inferred = self.decisions[key][0]
    if inferred != shape:
      raise ValueError(f"parameter {path!r} has shape {shape}, but {inferred} in this "
                       "Routing; infer it again from these params.")
    return self.decisions[key][1]

  def _given(self, params: Any) -> Any:
    source = self.label_source
    return expand_labels(source(params) if callable(source) else source, params)

  def decide(self, params: Any) -> list[tuple[str, Any, Decision]]:
    """(path, leaf, Decision) of every leaf of `params`, in tree order."""
    pairs = paths.leaves_with_path(params)
    if self.decisions is not None:
      return [(p, x, self._decision(p, x)) for p, x in pairs]
    if self.rules is not None:
      found = [apply_rules(self.rules, p, x) for p, x in pairs]
    else:
      found = [(l, "given label") for _, l in paths.leaves_with_path(self._given(params))]
    views = view_fn(self.views, self.per_head)
    return [(p, x, Decision(l, views(p, tuple(np.shape(x))) if l == MUON else None, why))
            for (p, x), (l, why) in zip(pairs, found)]

  def labels(self, params: Any) -> Any:
    """The label pytree of `params` ("muon", "adam" or "frozen" per leaf)."""
    if self.decisions is not None:
      return paths.map_with_path(lambda p, x: self._decision(p, x).label, params)
    if self.rules is not None:
      return paths.map_with_path(lambda p, x: apply_rules(self.rules, p, x)[0], params)
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
    return routing_table(shapes, self)


# Labels as `optax.partition` takes them: a label pytree ("muon" / "adam" / "frozen" per
# leaf), a prefix of the params tree, or a callable params -> such a tree.
LabelTree = Any
# What a `routing=` argument may be; `as_routing` makes it a `Routing` (None: the default
# name rules). The aliases do that once, and hand their parts the `Routing`.
RoutingLike = Union[Routing, LabelTree, Callable[[Any], LabelTree], None]


def as_routing(routing: RoutingLike = None) -> Routing:
  """The `Routing` meant by a `routing=` argument: a `Routing` as it is; None, the default
  name rules (`DEFAULT_RULES`); anything else, labels as `optax.partition` takes them (a
  label pytree, a prefix of the params tree, or a callable params -> labels)."""
  if isinstance(routing, Routing):
    return routing
  if routing is None:
    return Routing.from_rules()
  return Routing.from_labels(routing)
