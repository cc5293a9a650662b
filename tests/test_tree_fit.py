"""Whether a tree given with the params fits them, and the error that names where not."""

import jax.numpy as jnp
import optax
import pytest

from muon_optax._util import tree_fit

PARAMS = {"mlp": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}, "embed": jnp.ones((4, 2))}


def test_a_prefix_fits_and_a_stranger_is_named():
  assert tree_fit.prefix_mismatch({"mlp": True, "embed": False}, PARAMS) is None
  assert tree_fit.prefix_mismatch(PARAMS, PARAMS) is None
  assert "'embed'" in tree_fit.prefix_mismatch({"mlp": True}, PARAMS)
  assert "'head'" in tree_fit.prefix_mismatch({"mlp": True, "embed": True, "head": True}, PARAMS)


def test_check_mask_names_the_setting_and_takes_callables():
  tree_fit.check_mask("weight_decay_mask", lambda p: {"mlp": True, "embed": False}, PARAMS)
  with pytest.raises(ValueError, match="weight_decay_mask does not match the params tree: "
                                       "the params have 'embed'"):
    tree_fit.check_mask("weight_decay_mask", {"mlp": True}, PARAMS)


def test_check_updates_names_the_first_missing_path_or_wrong_shape():
  tree_fit.check_updates(PARAMS, PARAMS)
  with pytest.raises(ValueError, match="the params have 'embed', which the gradients lack"):
    tree_fit.check_updates({"mlp": PARAMS["mlp"]}, PARAMS)
  wrong = {**PARAMS, "embed": jnp.ones((2, 4))}
  with pytest.raises(ValueError, match=r"gradient of 'embed' has shape \(2, 4\)"):
    tree_fit.check_updates(wrong, PARAMS)


def test_a_branch_mask_leaves_other_branches_placeholders():
  mask = tree_fit.branch_mask({"mlp": {"kernel": True, "bias": False}, "embed": False})
  branch = {"mlp": {"kernel": PARAMS["mlp"]["kernel"], "bias": optax.MaskedNode()},
            "embed": optax.MaskedNode()}
  out = mask(branch)
  assert out["mlp"]["kernel"] is True and out["embed"] == optax.MaskedNode()
  assert tree_fit.branch_mask(None) is None
