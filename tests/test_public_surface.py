"""The public surface stays small: one settings value per concept, short signatures, and
the removed spellings gone."""

import inspect

import pytest

import muon_optax as mo

ALIASES = {"muon", "normuon", "adamuon", "dion2", "nordion2", "muonbp", "muonh"}
BUILDER = "scale_by_muon"  # one argument per component of the direction


def public_functions():
  for name in mo.__all__:
    obj = getattr(mo, name)
    if inspect.isfunction(obj):
      yield name, obj
    elif inspect.isclass(obj):
      yield from ((f"{name}.{m}", f) for m, f in vars(obj).items()
                  if not m.startswith("_") and isinstance(f, (classmethod, staticmethod)))


@pytest.mark.parametrize("name, fn", list(public_functions()), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_signatures_are_short(name, fn):
  fn = getattr(fn, "__func__", fn)
  params = [p for p in inspect.signature(fn).parameters.values() if p.name != "cls"]
  limit = 14 if name in ALIASES else 10 if name == BUILDER else 8
  assert len(params) <= limit, (name, [p.name for p in params])


@pytest.mark.parametrize("fn", [mo.muon, mo.normuon, mo.adamuon, mo.dion2, mo.nordion2, mo.muonbp,
                                mo.muonh, mo.orthogonalize_blocks,
                                mo.scale_by_muon, mo.select_rows,
                                mo.orthogonalize, mo.describe, mo.newton_schulz_cost,
                                mo.checkpoint.Checkpointer])
def test_routing_and_newton_schulz_arrive_one_way(fn):
  names = set(inspect.signature(fn).parameters)
  assert not names & {"labels", "rules", "views", "per_head", "ns_steps", "gram",
                      "precondition", "compute_dtype", "ns_fn", "adam_backend"}, names


def test_the_family_shares_muons_arguments():
  muon = list(inspect.signature(mo.muon).parameters)
  for alias in (mo.normuon, mo.adamuon):
    assert [p for p in inspect.signature(alias).parameters if p != "b2"] == muon


def test_the_frontier_shares_them_too():
  muon = list(inspect.signature(mo.muon).parameters)
  dion2 = [p for p in muon if p != "nesterov"]  # a buffer with no look-ahead
  dion2.insert(1, "fraction")
  assert list(inspect.signature(mo.dion2).parameters) == dion2
  assert [p for p in inspect.signature(mo.nordion2).parameters if p != "b2"] == dion2
  muonbp = list(muon)
  muonbp.insert(1, "blocks")
  assert list(inspect.signature(mo.muonbp).parameters) == muonbp
  # The hyperball replaces weight decay and the shape scale (its step is relative).
  assert list(inspect.signature(mo.muonh).parameters) == [
      p for p in muon if p not in ("scale", "weight_decay", "weight_decay_mask")]
