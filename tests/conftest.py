"""Test session set-up: 8 simulated CPU devices, and the one tree-comparison helper."""

import os

# Must be set before jax is imported anywhere in the session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402


def assert_trees_close(actual, expected, *, rtol: float, atol: float) -> None:
  """Every leaf equal within explicit tolerances; structures must match exactly."""
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert a_def == e_def, f"tree structures differ:\n{a_def}\n{e_def}"
  for (path, a), e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol,
        err_msg=f"at {jax.tree_util.keystr(path)}")
