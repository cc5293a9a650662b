"""Static row selection as slices (`static_rows`), against NumPy's indexing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax._sharded_ns.static_rows import runs, take_rows


def test_runs_are_the_index_list_cut_where_it_stops_counting_up():
  assert runs([0, 1, 2, 3]) == [(0, 4)]
  assert runs([2, 3, 0, 1]) == [(2, 4), (0, 2)]
  assert runs([0, 0, 1, 1]) == [(0, 1), (0, 2), (1, 2)]
  assert runs([]) == []


@pytest.mark.parametrize("index", [
    [0, 1, 2, 3, 4, 5],  # the identity
    [3, 4, 5, 0, 1, 2],  # a rotation: two runs
    [5, 2, 0, 4, 1, 3],  # any permutation
    [0, 0, 0, 4, 4, 4],  # repeats: a replicated block, wanted by every replica
    [2, 3],  # fewer rows than there are
])
def test_take_rows_is_numpy_indexing_with_no_gather(index):
  x = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
  np.testing.assert_array_equal(take_rows(jnp.asarray(x), index), x[np.asarray(index)])
  jaxpr = jax.make_jaxpr(lambda v: take_rows(v, index))(x)
  assert not any(e.primitive.name == "gather" for e in jaxpr.jaxpr.eqns)


def test_the_identity_is_no_op():
  jaxpr = jax.make_jaxpr(lambda v: take_rows(v, range(4)))(np.zeros((4, 3), np.float32))
  assert not jaxpr.jaxpr.eqns
