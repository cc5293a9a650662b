"""The family's direction as a chain of components: one a stage, each checked against the
others; a new variant is one component; the aliases' states keep their structure."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo
from muon_optax._direction import (
  Component,
  ShapeScale,
  Shared,
  WholeMatrices,
  direction,
  scale_component,
)


def shared(**changes):
  base = Shared(beta=0.9, nesterov=None, ns="jordan", mu_dtype=None,
                routing=mo.Routing.from_rules(), mesh=None)
  return dataclasses.replace(base, **changes)


@dataclasses.dataclass(frozen=True)
class Clipped(Component):
  """A new normalization, written here as a variant would be: each element of the
  orthogonal direction clipped to ±bound."""

  bound: float = 0.01
  stage: ClassVar[str] = "normalize"

  def extend(self, chain, shared):
    clip = optax.stateless(lambda u, p=None: jax.tree.map(
        lambda x: jnp.clip(x, -self.bound, self.bound), u))
    return (*chain, clip)


def test_a_new_variant_is_one_component_in_its_stage():
  g = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
  tx = direction([ShapeScale("moonlight"), Clipped(), WholeMatrices()], shared())
  want = optax.chain(mo.scale_by_muon_momentum(0.9), mo.orthogonalize("jordan"),
                     optax.clip(0.01), mo.scale_by_shape("moonlight"))
  got, state = tx.update(g, tx.init(g))
  expected, _ = want.update(g, want.init(g))
  np.testing.assert_array_equal(got["w"], expected["w"])  # stage order, not list order
  assert [type(s).__name__ for s in state] == [
      "MuonMomentumState", "EmptyState", "EmptyState", "EmptyState"]


def test_one_component_a_stage_and_an_orthogonal_one_needed():
  with pytest.raises(ValueError, match="RowSelection and BlockPeriodic both decide how the "
                     "gradients become an orthogonal direction"):
    mo.scale_by_muon(select=mo.RowSelection(), blocks=mo.BlockPeriodic(devices=2))
  with pytest.raises(ValueError, match="SecondMoment and Clipped both decide a normalization"):
    direction([WholeMatrices(), mo.SecondMoment(), Clipped(), ShapeScale()], shared())
  with pytest.raises(ValueError, match=r"needs a component for \['orthogonal'\]"):
    direction([ShapeScale()], shared())


def test_each_component_refuses_what_it_does_not_combine_with():
  with pytest.raises(ValueError, match="does not combine with RowSelection"):
    mo.scale_by_muon(scale="adaptive", select=mo.RowSelection())
  with pytest.raises(ValueError, match="does not combine with BlockPeriodic"):
    mo.scale_by_muon(scale="adaptive", blocks=mo.BlockPeriodic(devices=2))
  with pytest.raises(ValueError, match="two ways to set the update's magnitude"):
    mo.scale_by_muon(scale="adaptive", normalize=mo.SecondMoment())
  with pytest.raises(ValueError, match="no Nesterov look-ahead"):
    mo.scale_by_muon(nesterov=True, select=mo.RowSelection())
  with pytest.raises(ValueError, match="unknown scale 'rms'"):
    scale_component("rms")


STATES = {  # each alias's Muon-branch state, as checkpoints and state_shardings know it
    mo.muon: ["MuonMomentumState", "EmptyState", "EmptyState"],
    mo.normuon: ["MuonMomentumState", "EmptyState", "SecondMomentState", "EmptyState"],
    mo.adamuon: ["MuonMomentumState", "EmptyState", "SecondMomentState", "EmptyState"],
    mo.dion2: ["RowSelectionState", "EmptyState"],
    mo.nordion2: ["RowSelectionState", "SecondMomentState", "EmptyState"],
    mo.muonh: ["MuonMomentumState", "EmptyState", "EmptyState"],
    (lambda: mo.muonbp(blocks=mo.BlockPeriodic(devices=2))):
        ["MuonMomentumState", "BlockPeriodicState", "EmptyState"],
    (lambda: mo.muon(scale="adaptive")):
        ["MuonMomentumState", "EmptyState", "ScaleByScheduleState", "EmptyState"],
}


@pytest.mark.parametrize("make", list(STATES), ids=range(len(STATES)))
def test_the_aliases_states_keep_their_structure(make):
  params = {"w": jax.random.normal(jax.random.key(0), (8, 16)), "b": jnp.zeros(16)}
  state = make().init(params)
  direction_state, step_state = state.inner_states["muon"].inner_state
  assert [type(s).__name__ for s in direction_state] == STATES[make]
