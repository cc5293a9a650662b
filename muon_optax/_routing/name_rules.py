"""Name rules: routing by the '/'-joined tree path, the fallback when the computation
is not traced (see `infer_routing`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax.numpy as jnp
import numpy as np

from muon_optax._util import paths

MUON, ADAM, FROZEN = "muon", "adam", "frozen"
LABELS = (MUON, ADAM, FROZEN)

# A rule is a (regex, label) pair matched with re.search on the '/'-joined path, or a
# callable (path, leaf) -> label | None. The first rule that gives a label wins.
Rule = Union[tuple[str, str], Callable[[str, Any], Optional[str]]]

# Name rules match whole path components, and only the leaf's own name or its module's
# name: `time_embed/dense_1/kernel` is a hidden Dense inside an embedding block.
_BIAS = re.compile(r"(?:^|/)(bias|b)$", re.I)
_NORM = re.compile(
    r"(?:^|/)((?:\w*_)?(?:layer|rms|batch|group|instance)?norm(?:_?\d+|_f|_\w{1,3})?"
    r"|ln(?:_?\d+|_[a-z]\d*)?|bn\d*)(?:/[^/]+)?$|(?:^|/)scale$", re.I)
_EMBED = re.compile(
    r"(?:^|/)(embed|embeds|embedding|embeddings|embed_\d+|wte|wpe|embed_tokens|embed_positions"
    r"|(?:tok|token|pos|position|word|patch)_?embed(?:ding)?s?)(?:/[^/]+)?$", re.I)
_HEAD = re.compile(
    r"(?:^|/)(lm_head|head|out_head|output_head|unembed\w*|classifier|logits|readout)(?:/|$)", re.I)
_WEIGHT = re.compile(r"(?:^|/)(kernel|weights?|w\w*)$", re.I)
# The mark, in a reason, of a Muon leaf whose matrix view comes from its name alone (an
# override, where the computation gave none), and what `describe` and the warning say of
# those of rank ≥ 3, where a name can mislead.
BY_NAME = "view by name"
GUESSED_VIEW_NOTE = (
    "the matrix view of a leaf of rank ≥ 3 is guessed from its name alone; if the name "
    "misleads, Muon orthogonalizes other matrices than the model multiplies by. "
    "muon_optax.infer_routing reads the views from the computation; or give views=.")
NAME_RULES_CAVEAT = (
    "Name rules cannot tell an output head named like a hidden layer (Dense_2, out) from a "
    "hidden layer; muon_optax.infer_routing reads it from the computation.")


def rule_reason(path: str, leaf: Any) -> tuple[Optional[str], str]:
  """The default name rule's (label, reason) for one leaf; label None if no rule fits."""
  dtype = jnp.result_type(leaf)
  if not jnp.issubdtype(dtype, jnp.inexact):  # a counter or an index: no step updates it
    return FROZEN, f"{dtype} → frozen"
  if np.ndim(leaf) < 2:
    return ADAM, "rank < 2"
  for pattern, why in ((_BIAS, "bias"), (_NORM, "norm"), (_EMBED, "embedding"), (_HEAD, "head")):
    if pattern.search(path):
      return ADAM, f"name → {why}"
  if _WEIGHT.search(path):
    return MUON, "name → weight"
  return None, "no rule"


def default_rule(path: str, leaf: Any) -> Optional[str]:
  """The default routing by name: integer and bool leaves → "frozen"; rank < 2, biases,
  norms (scale, norm, ln_f, LayerNorm_0, ...), embeddings (embedding, wte, tok_embeddings,
  ...) and heads (lm_head, head, classifier, unembed, ...) → "adam"; kernel / weight / w* of
  rank ≥ 2 → "muon"; else None, so that a surprise is an error. Whole path components of the
  leaf or its module are matched. A head named like a hidden layer (Dense_2, out) goes to
  Muon: use `infer_routing`, which sees it."""
  return rule_reason(path, leaf)[0]


DEFAULT_RULES: tuple[Rule, ...] = (default_rule,)


def check_rules(rules: Sequence[Rule]) -> tuple[Rule, ...]:
  """The rules as a tuple; a ValueError naming a malformed rule or a bad regex."""
  if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
    raise ValueError(f"rules must be a list of (regex, label) pairs or callables, got {rules!r}.")
  for rule in rules:
    if callable(rule):
      continue
    if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ValueError(f"routing rule {rule!r} must be a (regex, label) pair or a callable "
                       "(path, leaf) -> label | None.")
    try:
      re.compile(rule[0])
    except re.error as e:
      raise ValueError(f"routing rule {rule!r} has a bad regex: {e}.") from None
  return tuple(rules)


def first_match(rules: Sequence[Rule], path: str, leaf: Any) -> Optional[tuple[str, str]]:
  """(label, reason) from the first rule that places the leaf, or None."""
  for rule in rules:
    if rule is default_rule:
      label, why = rule_reason(path, leaf)
    elif callable(rule):
      label, why = rule(path, leaf), f"rule {getattr(rule, '__name__', 'callable')}"
    else:
      label, why = (rule[1] if re.search(rule[0], path) else None), f"rule {rule[0]!r}"
    if label is not None:
      return label, why
  return None


def apply_rules(rules: Sequence[Rule], path: str, leaf: Any) -> tuple[str, str]:
  found = first_match(rules, path, leaf)
  if found is not None:
    return found
  raise ValueError(
      f"no routing rule places parameter {path!r} (shape {np.shape(leaf)}). Add a rule "
      "such as (r'<regex>', 'muon' | 'adam' | 'frozen'), end your rules with "
      "*muon_optax.DEFAULT_RULES, or use muon_optax.infer_routing.")


def label_params(params: Any, rules: Optional[Sequence[Rule]] = None) -> Any:
  """Labels every leaf of `params` "muon", "adam" or "frozen" by its tree path.

  Args:
    params: any pytree of arrays: a dict, Flax Linen params or an `nnx.State`.
    rules: (regex, label) pairs or callables (path, leaf) -> label | None, first
      match wins; None means `DEFAULT_RULES`.

  Returns:
    A pytree of label strings with the structure of `params`.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> mo.label_params({"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}})
    {'mlp': {'bias': 'adam', 'kernel': 'muon'}}
  """
  rules = DEFAULT_RULES if rules is None else check_rules(rules)
  return paths.map_with_path(lambda p, x: apply_rules(rules, p, x)[0], params)
