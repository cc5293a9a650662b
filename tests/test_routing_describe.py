"""The routing table (`describe`): every leaf with its label, view and why, the totals,
and what name rules cannot see."""

import jax.numpy as jnp
from flax import nnx
from gpt_model import GPT

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path


def test_describe_lists_every_leaf_and_totals():
  params = nnx.state(GPT(rngs=nnx.Rngs(0)), nnx.Param)
  table = mo.describe(params)
  for path, _ in leaves_with_path(params):
    assert path in table
  fc_flops = mo.newton_schulz_plan((16, 64)).flops
  assert f"{fc_flops:,}" in table
  assert "muon:" in table and "adam:" in table and "Newton–Schulz flops per step" in table


def test_describe_under_name_rules_says_what_they_cannot_see():
  text = mo.describe({"Dense_2": {"kernel": jnp.zeros((4, 4))}})
  assert "name → weight" in text and "cannot tell" in text and "infer_routing" in text
