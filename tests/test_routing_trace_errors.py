"""infer_routing on bad input: an error that names the parameter path and its uses."""

import jax
import jax.numpy as jnp
import linen_lm_case
import pytest

import muon_optax as mo

# --- bad input --------------------------------------------------------------------

def test_unused_leaf_names_the_path():
  params = {"w": jnp.ones((4, 4)), "spare": jnp.ones((4, 4))}
  with pytest.raises(ValueError, match=r"'spare'.*not used"):
    mo.infer_routing(lambda p, x: x @ p["w"], params, jnp.ones((2, 4)))
  routing = mo.infer_routing(lambda p, x: x @ p["w"], params, jnp.ones((2, 4)),
                             overrides=[("spare", "frozen")])
  assert routing.labels(params)["spare"] == "frozen"


def test_leaf_used_two_ways_names_the_path_and_uses():
  params = {"w": jnp.ones((4, 6)), "k": jnp.ones((3, 3, 4, 6))}
  f = lambda p, x: (x @ p["w"]) @ p["w"].T
  two_ways = r"'w'.*incompatible.*dot_general as 4×6, dot_general as 6×4"
  with pytest.raises(ValueError, match=two_ways):
    mo.infer_routing(f, {"w": params["w"]}, jnp.ones((2, 4)))
  conv = lambda p, img: jax.lax.conv_general_dilated(
      img, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  g = lambda p, x, img: (x @ p["k"][0, 0]).sum() + conv(p, img).sum() + (x @ p["w"]).sum()
  two_ways = r"'k'.*incompatible.*conv 3×3×4→6 → 36×6, dot_general as 9×\(4×6\)"
  with pytest.raises(ValueError, match=two_ways):
    mo.infer_routing(g, params, jnp.ones((2, 4)), jnp.ones((1, 5, 5, 4)))


def test_f_that_fails_to_trace():
  with pytest.raises(ValueError, match="could not trace f"):
    mo.infer_routing(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 4))}, jnp.ones((2, 5)))
  with pytest.raises(ValueError, match="pass the params"):
    mo.infer_routing(lambda p: p)
  with pytest.raises(ValueError, match=r"routing rule \('\(', 'adam'\) has a bad regex"):
    mo.infer_routing(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 4))}, jnp.ones((2, 4)),
                     overrides=[("(", "adam")])


def test_routing_of_other_params_is_an_error_naming_the_path():
  routing = mo.infer_routing(lambda p, x: jnp.tanh(x @ p["w"]) @ p["o"],
                             {"w": jnp.ones((4, 4)), "o": jnp.ones((4, 2))}, jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r"'v'.*not in this Routing"):
    routing.labels({"v": jnp.ones((4, 4))})


def test_linen_params_given_for_the_variables_suggests_them():
  """A Linen apply takes the variables: given only their "params" collection, Flax cannot
  find it, and the error says what to pass."""
  model, params, tokens = linen_lm_case.model_and_params()
  with pytest.raises(ValueError, match=r"ScopeCollectionNotFound.*\n.*pass the variables, "
                     r"\{'params': params\}: infer_routing\(model.apply, \{'params': params\}"):
    mo.infer_routing(model.apply, params, tokens)
  routing = mo.infer_routing(model.apply, {"params": params}, tokens)
  assert routing.labels(params)["embed"]["embedding"] == "adam"
  with pytest.raises(ValueError) as other:  # another cause: no suggestion
    mo.infer_routing(model.apply, {"params": params}, jnp.zeros((2, 3, 4)))
  assert "{'params': params}" not in str(other.value)
