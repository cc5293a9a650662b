"""`after`: an exact data dependence that orders work one part after another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax._util.order import after


@pytest.mark.parametrize("done", [1.0, np.nan, np.inf, -0.0])
def test_after_is_exact_whatever_it_waits_on(done):
  x = jnp.asarray([[1.5, -0.0], [np.inf, -3.0]])
  y = after({"x": x}, [jnp.full((2, 3), done)])["x"]
  np.testing.assert_array_equal(y, x)
  assert after(x, []) is x


def test_after_orders_what_it_ties():
  # The tied value reads the one it waits on: the compiled program cannot compute it first.
  jaxpr = jax.make_jaxpr(lambda x, y: after(x, [y]))(jnp.ones(3), jnp.ones(2)).jaxpr
  reached = {str(jaxpr.invars[1])}
  for eqn in jaxpr.eqns:
    if reached & {str(v) for v in eqn.invars}:
      reached |= {str(v) for v in eqn.outvars}
  assert str(jaxpr.outvars[0]) in reached


def test_after_reads_whole_first_rows():
  # One element of a product is computed ahead of the rest from one row and one column;
  # an all-to-all among one device is a copy, so a tie on one element of its output would
  # not wait for the product. The tie reads a whole first row: all one peer sent.
  jaxpr = jax.make_jaxpr(lambda x, y, v: after(x, [y, v]))(
      jnp.ones(3), jnp.ones((4, 5)), jnp.ones(6)).jaxpr
  summed = [e.invars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "reduce_sum"]
  assert (5,) in summed and (6,) in summed
