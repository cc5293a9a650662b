"""The type aliases of the public signatures: every form each one names is taken, and
taken alike."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax

import muon_optax as mo
from muon_optax._util.types import Mask, ScalarOrSchedule


def params_and_grads():
  ks = jax.random.split(jax.random.key(0), 4)
  params = {"w": {"kernel": jax.random.normal(ks[0], (8, 16))},
            "v": {"kernel": jax.random.normal(ks[1], (16, 8))}}
  grads = {"w": {"kernel": jax.random.normal(ks[2], (8, 16))},
           "v": {"kernel": jax.random.normal(ks[3], (16, 8))}}
  return params, grads


def first_update(tx):
  params, grads = params_and_grads()
  return tx.update(grads, tx.init(params), params)[0]


def test_the_public_signatures_use_the_aliases():
  for alias in (mo.muon, mo.normuon, mo.adamuon):
    hints = typing.get_type_hints(alias)
    assert hints["learning_rate"] == ScalarOrSchedule, alias.__name__
    assert hints["weight_decay_mask"] == Mask, alias.__name__


def test_a_number_an_array_and_a_schedule_are_one_learning_rate():
  # The same arithmetic on the same float32 value: equal to the bit.
  want = first_update(mo.muon(0.02))
  for rate in (jnp.float32(0.02), jnp.asarray(0.02), optax.constant_schedule(0.02)):
    jax.tree.map(np.testing.assert_array_equal, first_update(mo.muon(rate)), want)


def test_a_mask_tree_and_a_mask_function_are_one_mask():
  mask = {"w": {"kernel": True}, "v": {"kernel": False}}
  by_tree = first_update(mo.muon(0.02, weight_decay=0.5, weight_decay_mask=mask))
  by_function = first_update(mo.muon(0.02, weight_decay=0.5, weight_decay_mask=lambda p: mask))
  jax.tree.map(np.testing.assert_array_equal, by_tree, by_function)
  every = first_update(mo.muon(0.02, weight_decay=0.5, weight_decay_mask=None))
  np.testing.assert_array_equal(by_tree["w"]["kernel"], every["w"]["kernel"])
  assert not np.array_equal(by_tree["v"]["kernel"], every["v"]["kernel"])  # None decays every Muon leaf
