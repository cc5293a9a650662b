"""Label trees as `optax.partition` takes them: spread to one label per leaf
(`expand_labels`), and checked against the leaves they label (`check_leaf`,
`check_labels`), each error naming the parameter's path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from muon_optax._routing.matrix_view import ViewFn
from muon_optax._routing.name_rules import FROZEN, LABELS, MUON
from muon_optax._util import paths


def expand_labels(label_tree: Any, params: Any) -> Any:
  """A label tree that is `params`' structure or a prefix of it (as `optax.partition`
  takes), spread to one label per leaf."""
  def spread(label, subtree):
    return jax.tree.map(lambda _: label, subtree, is_leaf=paths.is_masked)

  try:
    return jax.tree.map(spread, label_tree, params)
  except (ValueError, TypeError) as e:
    hint = ""
    if isinstance(label_tree, (list, tuple)) and any(
        callable(r) or (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
                        and r[1] in LABELS and r[0] not in LABELS) for r in label_tree):
      hint = (" It looks like routing rules: pass "
              "routing=muon_optax.Routing.from_rules([...]).")
    raise ValueError("the label tree does not match the params tree (it must have the params' "
                     f"structure or a prefix of it, as in optax.partition): {e}.{hint}") from None


def check_leaf(path: str, leaf: Any, label: Any, views: ViewFn, known: Sequence[str]) -> None:
  """A ValueError naming `path` if the leaf cannot be updated as labelled."""
  if label not in known:
    raise ValueError(f"parameter {path!r} has label {label!r}, which has no transform; use "
                     f"one of {list(known)}.")
  if label == FROZEN:
    return
  shape, dtype = np.shape(leaf), jax.numpy.result_type(leaf)
  if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
    raise ValueError(f"parameter {path!r} is labelled {label!r} but has dtype {dtype}, which "
                     "no optimizer step can update; label it 'frozen'.")
  if label != MUON:
    return
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    raise ValueError(f"parameter {path!r} is labelled 'muon' but has dtype {dtype}; Muon needs "
                     "real floating weights. Label it 'adam' or 'frozen'.")
  if views(path, shape) is None:
    raise ValueError(f"parameter {path!r} of shape {shape} is labelled 'muon' but has no matrix "
                     "view (rank < 2). Label it 'adam', or give its view with "
                     "Routing.from_rules(views=...) or infer_routing(views=...).")


def check_labels(label_tree: Any, params: Any, views: ViewFn, known: Sequence[str]) -> None:
  """Raises a ValueError naming the path of the first leaf that cannot be updated as labelled."""
  label_tree = expand_labels(label_tree, params)
  paths.map_with_path(lambda p, x, l: check_leaf(p, x, l, views, known), params, label_tree)
