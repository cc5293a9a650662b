"""`after`: an exact data dependence that orders work one part after another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax._distributed.order import after


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
