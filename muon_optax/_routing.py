"""Routing: which leaves Muon updates, which go to AdamW, and the table that shows it."""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from muon_optax import _paths
from muon_optax._matrix_view import ViewFn, view_fn
from muon_optax._newton_schulz import newton_schulz_flops

MUON, ADAM, FROZEN = "muon", "adam", "frozen"
LABELS = (MUON, ADAM, FROZEN)

# A rule is a (regex, label) pair matched with re.search on the '/'-joined path, or a
# callable (path, leaf) -> label | None. The first rule that gives a label wins.
Rule = Union[tuple[str, str], Callable[[str, Any], Optional[str]]]
Labels = Union[None, Sequence[Rule], Callable[[Any], Any], Any]

_BIAS = re.compile(r"(?:^|/)(bias|b)$", re.I)
_NORM = re.compile(r"norm|(?:^|/)ln(?:_?\w+)?/|(?:^|/)scale$", re.I)
_EMBED = re.compile(r"emb|(?:^|/)(wte|wpe|tok|pos)(?:_\w+)?(?:/|$)", re.I)
_HEAD = re.compile(
    r"(?:^|/)(lm_head|head|out_head|output_head|unembed\w*|classifier|logits|readout)(?:/|$)", re.I)
_WEIGHT = re.compile(r"(?:^|/)(kernel|weights?|w\w*)$", re.I)


def default_rule(path: str, leaf: Any) -> Optional[str]:
  """The default routing: hidden weight matrices to Muon, everything else to AdamW.

  Scalars and 1-D leaves, biases (2-D ones too), norm parameters, token/position
  embeddings and the output head (lm_head, head, classifier, unembed, ...) go to
  "adam"; a leaf of rank ≥ 2 named kernel / weight / w* goes to "muon". Anything
  else is left unplaced, so that a surprise is an error rather than a guess.
  """
  if np.ndim(leaf) < 2 or _BIAS.search(path) or _NORM.search(path):
    return ADAM
  if _EMBED.search(path) or _HEAD.search(path):
    return ADAM
  if _WEIGHT.search(path):
    return MUON
  return None


DEFAULT_RULES: tuple[Rule, ...] = (default_rule,)


def _apply_rules(rules: Sequence[Rule], path: str, leaf: Any) -> str:
  for rule in rules:
    if callable(rule):
      label = rule(path, leaf)
    else:
      pattern, label = rule
      label = label if re.search(pattern, path) else None
    if label is not None:
      return label
  raise ValueError(
      f"no routing rule places parameter {path!r} (shape {np.shape(leaf)}). Add a rule "
      "such as (r'<regex>', 'muon' | 'adam' | 'frozen'), or end your rules with "
      "*muon_optax.DEFAULT_RULES."
  )


def label_params(params: Any, rules: Optional[Sequence[Rule]] = None) -> Any:
  """Labels every leaf of `params` "muon", "adam" or "frozen" by its tree path.

  Args:
    params: any pytree of arrays: a dict, Flax Linen params or an `nnx.State`.
    rules: (regex, label) pairs or callables (path, leaf) -> label | None, first
      match wins; None means `DEFAULT_RULES`.

  Returns:
    A pytree of label strings with the structure of `params`.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> mo.label_params({"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}})
    {'mlp': {'bias': 'adam', 'kernel': 'muon'}}
  """
  rules = DEFAULT_RULES if rules is None else tuple(rules)
  return _paths.map_with_path(lambda p, x: _apply_rules(rules, p, x), params)


def resolve_labels(labels: Labels, params: Any) -> Any:
  """The label pytree for `params` from None, rules, a callable or a label pytree."""
  if labels is None:
    return label_params(params)
  if callable(labels):
    return labels(params)
  if isinstance(labels, (list, tuple)) and labels and (
      callable(labels[0]) or (isinstance(labels[0], tuple) and len(labels[0]) == 2
                              and isinstance(labels[0][0], str))):
    return label_params(params, labels)
  return labels


def check_labels(label_tree: Any, params: Any, views: ViewFn, known: Sequence[str]) -> None:
  """Raises a ValueError naming the path of the first leaf that cannot be updated as labelled."""
  def check(path: str, leaf: Any, label: Any) -> None:
    if label not in known:
      raise ValueError(
          f"parameter {path!r} has label {label!r}, which has no transform; use one "
          f"of {list(known)}.")
    if label != MUON:
      return
    shape, dtype = np.shape(leaf), jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f"parameter {path!r} is labelled 'muon' but has dtype {dtype}; Muon needs real "
          "floating weights. Label it 'adam' or 'frozen'.")
    if views(path, shape) is None:
      raise ValueError(
          f"parameter {path!r} of shape {shape} is labelled 'muon' but has no matrix view "
          "(rank < 2). Label it 'adam', or pass views= to say how it is a matrix.")

  try:
    jax.tree.map(lambda l, x: None, label_tree, params, is_leaf=_paths.is_masked)
  except ValueError as e:
    raise ValueError(f"the label tree does not match the params tree: {e}") from None
  _paths.map_with_path(lambda p, x, l: check(p, x, l), params, label_tree)


def _rows(params: Any, labels: Labels, views: Optional[ViewFn], per_head: bool,
          ns_steps: int) -> list[tuple[str, tuple[int, ...], str, str, int]]:
  """(path, shape, label, matrix view, Newton–Schulz flops) of every leaf."""
  views = view_fn(views, per_head)
  label_tree = resolve_labels(labels, params)
  check_labels(label_tree, params, views, LABELS)
  rows = []
  for (path, leaf), (_, label) in zip(_paths.leaves_with_path(params),
                                       _paths.leaves_with_path(label_tree)):
    shape = tuple(np.shape(leaf))
    view, flops = "", 0
    if label == MUON:
      v = views(path, shape)
      count, fan_in, fan_out = v.matrix_shape(shape)
      view, flops = v.describe(shape), count * newton_schulz_flops(fan_in, fan_out, ns_steps)
    rows.append((path, shape, label, view, flops))
  return rows


def newton_schulz_cost(params: Any, labels: Labels = None, *, views: Optional[ViewFn] = None,
                       per_head: bool = False, ns_steps: int = 5) -> int:
  """Newton–Schulz flops of one Muon update of `params` (the total `describe` prints).

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> mo.newton_schulz_cost({"w": jnp.ones((4, 8))}) == mo.newton_schulz_flops(4, 8, 5)
    True
  """
  return sum(row[-1] for row in _rows(params, labels, views, per_head, ns_steps))


def describe(params: Any, labels: Labels = None, *, views: Optional[ViewFn] = None,
             per_head: bool = False, ns_steps: int = 5) -> str:
  """The routing table: path, shape, label, matrix view and Newton–Schulz flops per leaf.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> print(mo.describe({"w": jnp.ones((4, 8)), "b": jnp.ones(8)}))  # doctest: +SKIP
  """
  rows, totals = [], {}
  for path, shape, label, view, flops in _rows(params, labels, views, per_head, ns_steps):
    n, f = totals.get(label, (0, 0))
    totals[label] = (n + int(np.prod(shape)), f + flops)
    rows.append((path, "×".join(map(str, shape)) or "()", label, view, f"{flops:,}" if flops else ""))
  header = ("path", "shape", "label", "matrix view", f"NS flops ({ns_steps} steps)")
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
  fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  lines = [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
  lines.append("")
  for label, (n, f) in sorted(totals.items()):
    lines.append(f"{label}: {n:,} parameters" + (f", {f:,} Newton–Schulz flops per step" if f else ""))
  return "\n".join(lines)
