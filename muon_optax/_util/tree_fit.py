"""Whether a tree given with the params fits them (a mask, the gradients), and if not, an
error that names the first path where they part."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from muon_optax._util import paths


def _leaf_paths(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=paths.is_masked)
  return [(tuple(paths.key_name(k) for k in path), x) for path, x in flat]


def _show(path: tuple[str, ...]) -> str:
  return repr("/".join(path)) if path else "the root"


def prefix_mismatch(prefix: Any, params: Any) -> Optional[str]:
  """None if `prefix` has the params' structure or a prefix of it (as optax masks and
  `optax.partition` labels may), else which path differs first."""
  covered = {path for path, _ in _leaf_paths(prefix)}
  params_paths = [path for path, _ in _leaf_paths(params)]
  for path in params_paths:
    if not any(path[:k] in covered for k in range(len(path) + 1)):
      return f"the params have {_show(path)}, which it does not cover"
  present = {path[:k] for path in params_paths for k in range(len(path) + 1)}
  for path in sorted(covered - present):
    return f"it has {_show(path)}, which is not in the params"
  return None


def branch_mask(mask: Any) -> Any:
  """A mask over the full params (a tree of bools), made usable inside an
  `optax.partition` branch, whose params hold `optax.MaskedNode` where the leaf belongs
  to another branch; None and callables as they are."""
  if mask is None or callable(mask):
    return mask
  return lambda params: jax.tree.map(
      lambda m, p: p if paths.is_masked(p) else m, mask, params, is_leaf=paths.is_masked)


def check_mask(name: str, mask: Any, params: Any) -> None:
  """A ValueError naming `name` and the first differing path unless the mask (a tree of
  bools, or a callable params -> such a tree) fits `params`."""
  if mask is None:
    return
  tree = mask(params) if callable(mask) else mask
  problem = prefix_mismatch(tree, params)
  if problem is not None:
    raise ValueError(f"{name} does not match the params tree: {problem}. Give it the params' "
                     "structure (or a prefix of it), or a callable params -> mask.")


def check_updates(updates: Any, params: Any) -> None:
  """A ValueError naming the first path where the gradients (updates) and the params
  differ in structure or shape."""
  got, want = _leaf_paths(updates), _leaf_paths(params)
  got_paths, want_paths = [p for p, _ in got], [p for p, _ in want]
  if got_paths != want_paths:
    got_set, want_set = set(got_paths), set(want_paths)
    missing = [p for p in want_paths if p not in got_set]
    extra = [p for p in got_paths if p not in want_set]
    detail = (f"the params have {_show(missing[0])}, which the gradients lack" if missing else
              f"the gradients have {_show(extra[0])}, which the params lack" if extra else
              "their leaves come in another order")
    raise ValueError(
        f"the gradients do not match the params tree ({type(updates).__name__} of "
        f"{len(got)} leaves vs {type(params).__name__} of {len(want)}): {detail}. Pass "
        "gradients with the params' structure, e.g. from jax.grad of a function of them.")
  for (path, g), (_, p) in zip(got, want):
    if paths.is_masked(g) or paths.is_masked(p):
      continue
    if np.shape(g) != np.shape(p):
      raise ValueError(f"the gradient of {_show(path)} has shape {np.shape(g)} but the "
                       f"parameter has shape {np.shape(p)}.")
