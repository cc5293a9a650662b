"""Helpers shared by the tests: the one tree comparison, with explicit tolerances."""

import jax
import numpy as np


def assert_trees_close(actual, expected, *, rtol: float, atol: float) -> None:
  """Every leaf equal within explicit tolerances; structures must match exactly."""
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert a_def == e_def, f"tree structures differ:\n{a_def}\n{e_def}"
  for (path, a), e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol,
        err_msg=f"at {jax.tree_util.keystr(path)}")
