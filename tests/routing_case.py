"""The routing tests' shared case: an inferred Routing as a table, and Muon's update on
every inferred view checked against a plain Newton–Schulz reference."""

import jax
import numpy as np
from _helpers import float32_bound, rel

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path

V = mo.MatrixView
JORDAN = (3.4445, -4.7750, 2.0315)


def table(routing):
  """path -> (label, view) for every leaf of an inferred Routing."""
  return {p: (d.label, d.view) for p, (_, d) in routing.decisions.items()}


def ns_reference(m, dtype):
  """Jordan's quintic Newton–Schulz on one matrix, in numpy at `dtype`."""
  x = np.asarray(m, dtype)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / np.linalg.norm(x)
  a, b, c = (dtype(v) for v in JORDAN)
  for _ in range(5):
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if tall else x


def assert_muon_update_is_ns_of_each_view(routing, params):
  """With beta=0, no shape scaling and lr=1, Muon's update of a leaf is -NS(its matrices)."""
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params)
  tx = mo.muon(1.0, beta=0.0, nesterov=False, scale=None, ns="jordan",  # 5 steps
               routing=routing)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  checked = 0
  for (path, g), (_, u) in zip(leaves_with_path(grads), leaves_with_path(updates)):
    label, view = table(routing)[path]
    if label != "muon":
      continue
    order = view.batch + view.fan_in + view.fan_out
    count, fan_in, fan_out = view.matrix_shape(g.shape)
    mats = np.transpose(np.asarray(g), order).reshape(count, fan_in, fan_out)
    ref64 = np.stack([ns_reference(m, np.float64) for m in mats])
    permuted = np.transpose(-np.asarray(u, np.float64), order).reshape(count, fan_in, fan_out)
    # Any float32 evaluation (standard or Gram-space) is within the a priori bound.
    assert np.all(rel(permuted, ref64) < float32_bound("jordan")), path
    checked += 1
  assert checked
