"""'/'-joined tree paths, the keys every routing and view decision is made on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: tuple) -> str:
  """'/'-joined names; the trailing `.value` of an nnx Variable is dropped."""
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]
  return "/".join(key_name(k) for k in path)


def is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
  """tree_map with the path string as first argument; optax.MaskedNode leaves pass through."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x, *r: x if is_masked(x) else fn(path_str(p), x, *r),
      tree, *rest, is_leaf=is_masked,
  )


def leaves_with_path(tree: Any) -> list[tuple[str, Any]]:
  """(path string, leaf) pairs in tree order, without optax.MaskedNode placeholders."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)
  return [(path_str(p), x) for p, x in flat if not is_masked(x)]
