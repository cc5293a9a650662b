"""The routing table (`routing_table`): what `describe` and `print(routing)` show, and
the leaves whose matrix view only their name gives, flagged there and warned about once."""

import warnings

import jax
import jax.numpy as jnp
import linen_lm_case

import muon_optax as mo
from muon_optax._routing.table import routing_rows, routing_table
from muon_optax._util.paths import leaves_with_path


def test_a_routing_prints_the_table_describe_prints():
  """`print(routing)` is `describe`'s table of the shapes it routed, and the table's flops
  are `newton_schulz_cost`'s."""
  params = {"attn": {"kernel": jnp.ones((8, 24)), "bias": jnp.ones(24)}, "out": jnp.ones((24, 4))}
  routing = mo.infer_routing(lambda p, x: (x @ p["attn"]["kernel"] + p["attn"]["bias"]) @ p["out"],
                             params, jnp.ones((3, 8)))
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  assert str(routing) == mo.describe(shapes, routing=routing) == routing_table(shapes, routing)
  flops = sum(row[5] for row in routing_rows(params, routing, mo.NewtonSchulz(), None))
  assert flops == mo.newton_schulz_cost(params, routing=routing) > 0
  assert f"{flops:,}" in str(routing)


def _warnings_of(fn):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn()
  return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_views_guessed_from_names_are_flagged_and_warned_about_once():
  """A leaf of rank ≥ 3 whose view comes from its name alone is marked in describe, and
  building the state warns once, naming infer_routing; read from the computation, or
  given by views=, it is neither."""
  model, params, tokens = linen_lm_case.model_and_params()
  guessed = {p for p, x in leaves_with_path(params) if x.ndim == 3}
  rows = {line.split()[0]: line for line in mo.describe(params).splitlines()[2:] if line}
  for path in guessed:
    assert rows[path].endswith("name → weight, view by name (!)"), rows[path]
  assert "Dense_0/kernel" in rows["blocks_0/Mlp_0/Dense_0/kernel"]
  assert "(!)" not in rows["blocks_0/Mlp_0/Dense_0/kernel"]
  assert any(line.startswith("(!) ") and "infer_routing" in line for line in rows.values())
  [message] = _warnings_of(lambda: mo.muon(0.02).init(params))
  assert message.startswith(f"{len(guessed)} parameter(s) (blocks_0/CausalAttn_0/attn_out_proj")
  assert "infer_routing" in message
  inferred = mo.infer_routing(model.apply, {"params": params}, tokens)
  views = mo.Routing.from_rules(views=lambda path, shape: mo.default_view(path, shape))
  for routing in (inferred, views):
    assert "(!)" not in mo.describe(params, routing=routing)
    assert _warnings_of(lambda: mo.normuon(0.02, routing=routing).init(params)) == []


def test_an_override_the_computation_gives_no_view_is_flagged():
  params = {"w": jnp.ones((2, 4, 4)), "v": jnp.ones((4, 4))}
  f = lambda p, x: jnp.sum(p["w"]) * (x @ p["v"])  # w elementwise only: no view read
  routing = mo.infer_routing(f, params, jnp.ones((3, 4)), overrides=[("^w$", "muon")])
  [row] = [line for line in mo.describe(params, routing=routing).splitlines()
           if line.startswith("w ")]
  assert row.endswith("override '^w$', view by name (!)"), row
  [message] = _warnings_of(lambda: mo.muon(0.02, routing=routing).init(params))
  assert message.startswith("1 parameter(s) (w)")
