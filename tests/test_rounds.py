"""The distributed Newton–Schulz plan on its own: no mesh, no compile (the exchange that
runs it is tested on 8 devices in test_sharded_ns_solver.py and for TPU in test_tpu_compile.py)."""


import pytest
from sharded_case import FLOPS_ALONE

import muon_optax as mo
from muon_optax._newton_schulz.variant import newton_schulz_flops, newton_schulz_plan
from muon_optax._sharded_ns.rounds import (
  SPLIT_TOLERANCE,
  Round,
  per_device_flops,
  placed,
  plan_rounds,
  whole_flops,
)
from muon_optax._sharded_ns.split_cost import memory_budget, split_collectives, working_set

NS = mo.NewtonSchulz()


def covers_every_matrix_once(shapes, rounds):
  """Each matrix appears in exactly `split` slots of rounds of its own shape."""
  seen = {}
  for r in rounds:
    for item in r.slots:
      if item is not None:
        assert shapes[item[0]][1:] == (r.rows, r.cols), (item, r)
        seen[item] = seen.get(item, 0) + 1
        assert seen[item] <= r.split
  assert set(seen) == {(i, j) for i, (c, _, _) in enumerate(shapes) for j in range(c)}


def ideal(shapes, devices):
  """Every device's equal share, counted as the plan weighs matrices: whole products."""
  return sum(c * newton_schulz_plan((m, n), NS, symmetric=False).flops
             for c, m, n in shapes) / devices


def test_shapes_never_share_a_round_and_every_matrix_runs_once():
  shapes = [(5, 32, 128), (3, 64, 64), (1, 24, 40), (9, 16, 48)]
  rounds = plan_rounds(shapes, 8)
  covers_every_matrix_once(shapes, rounds)


def occupied(r):
  return [d for d, item in enumerate(r.slots) if item is not None]


def test_partial_rounds_move_onto_devices_the_others_leave_free():
  # 6 wide on 8 devices, then one each of three other shapes: two fit beside the wide
  # round, the third starts a slot of its own; a pair-split round moves by whole pairs.
  shapes = [(6, 32, 128), (1, 24, 40), (1, 32, 32), (1, 12, 20)]
  rounds = plan_rounds(shapes, 8)
  covers_every_matrix_once(shapes, rounds)
  assert [occupied(r) for r in rounds] == [[0, 1, 2, 3, 4, 5], [6], [7], [0]]
  pair = Round(16, 64, ((9, 0),) * 2 + (None,) * 6, split=2)
  three = Round(16, 32, ((7, 0), (7, 1), (7, 2)) + (None,) * 5)
  assert [occupied(r) for r in placed([three, pair], 8)] == [[0, 1, 2], [4, 5]]
  full = Round(16, 32, tuple((7, j) for j in range(8)))
  assert placed([full, pair], 8) == [full, pair]


def test_full_rounds_stay_whole_and_the_rest_is_split_to_fill_the_devices():
  # 12 matrices on 8 devices: one round of whole matrices, the 4 left split by pairs.
  rounds = plan_rounds([(12, 64, 256)], 8, flops_per_byte=0)
  assert [r.split for r in rounds] == [1, 2]
  assert all(None not in r.slots for r in rounds)
  flops = per_device_flops([(12, 64, 256)], 8, flops_per_byte=0)
  assert flops == pytest.approx(ideal([(12, 64, 256)], 8), rel=1e-6)


def test_work_each_device_has_already_leaves_the_rest_whole():
  # The same 12 beside owned stacks whose work is 16 of these matrices a device: the 4
  # left whole in a partial round make the plan 18 matrices' time against an ideal of
  # 17.5, within tolerance, so no split pays its collectives for that.
  base = 16 * whole_flops(64, 256, mo.NewtonSchulz())
  rounds = plan_rounds([(12, 64, 256)], 8, flops_per_byte=0, base=base)
  assert [r.split for r in rounds] == [1, 1]
  assert [r.slots.count(None) for r in rounds] == [0, 4]


def test_rounds_of_different_splits_fill_the_devices():
  # 96 wide matrices on 256 devices: pairs would leave 64 devices idle (4/3 of the
  # ideal); 64 over groups of 4, then 32 over groups of 8, fill every device.
  shapes = [(96, 4096, 14336)]
  rounds = plan_rounds(shapes, 256, flops_per_byte=0)
  assert sorted(r.split for r in rounds) == [4, 8]
  assert all(None not in r.slots for r in rounds)
  covers_every_matrix_once(shapes, rounds)
  assert per_device_flops(shapes, 256, flops_per_byte=0) == pytest.approx(ideal(shapes, 256),
                                                                          rel=1e-6)


def test_traffic_is_weighed_in_16_bit_matmul_flops():
  # float32 operands at HIGHEST precision run as six bfloat16 passes (`matmul_passes`):
  # a byte costs six times fewer of their flops.
  f32 = mo.NewtonSchulz(compute_dtype="float32", precision="highest")
  shapes = [(96, 4096, 14336), (64, 4096, 4096)]
  same_time = dict(compute_dtype="float32", precision="default")
  assert (plan_rounds(shapes, 256, f32, flops_per_byte=600)
          == plan_rounds(shapes, 256, mo.NewtonSchulz(**same_time), flops_per_byte=100))
  # At a v5p's 750, the flops that six passes cost pay for splitting the big matrices
  # finer; in one pass they do not.
  splits = lambda ns: [r.split for r in plan_rounds(shapes, 256, ns) if r.cols == 14336]
  assert splits(f32) == [4, 8] and splits(mo.NewtonSchulz(**same_time)) == [2]


def test_a_split_whose_traffic_costs_more_than_it_saves_stays_whole():
  # 64 rows: three 64×64 transfers a step cost more, at an accelerator's flops per
  # byte, than half of one small matrix's flops; 4096 rows do not.
  assert all(r.split == 1 for r in plan_rounds([(12, 64, 256)], 8))
  rounds = plan_rounds([(12, 4096, 14336)], 8)
  assert [r.split for r in rounds] == [1, 2]


def test_a_split_saving_less_than_its_collectives_fixed_cost_stays_whole():
  # GPT-2 small at float32 / HIGHEST on 8 devices: splitting the 4 attention matrices
  # left over by pairs would save 8% of the flops, less than the 20 collectives it adds
  # cost to start at a v5p's 750 flops a byte; balancing flops alone, they are split.
  f32 = mo.NewtonSchulz(compute_dtype="float32", precision="highest")
  shapes = [(12, 768, 2304), (12, 768, 768), (24, 768, 3072)]
  assert split_collectives(768, 2304, 2, f32) == 20
  assert all(r.split == 1 for r in plan_rounds(shapes, 8, f32))
  assert {r.split for r in plan_rounds(shapes, 8, f32, flops_per_byte=0)} == {1, 2}
  # The big matrices' split saves far more than its 60 collectives cost.
  assert [r.split for r in plan_rounds([(12, 4096, 14336)], 8, f32)] == [1, 2]


def test_a_plan_within_tolerance_splits_nothing():
  # 4 leftovers of a small shape next to 16 big ones: whole, the plan is within 5%.
  shapes = [(16, 256, 1024), (4, 16, 16)]
  rounds = plan_rounds(shapes, 8)
  assert all(r.split == 1 for r in rounds)
  assert per_device_flops(shapes, 8) <= SPLIT_TOLERANCE * ideal(shapes, 8)


def test_splits_respect_what_the_layout_allows():
  # A block of 2 columns cannot be cut into 4 column parts: the plan does not ask it.
  ok = lambda item, g: g <= 2
  rounds = plan_rounds([(2, 64, 256)], 8, split_ok=ok, flops_per_byte=0)
  assert max(r.split for r in rounds) <= 2
  covers_every_matrix_once([(2, 64, 256)], rounds)


@pytest.mark.parametrize("devices", [64, 256])
def test_llama_8b_shapes_within_the_ideal_flops(devices):
  # q/o 4096², k/v 4096×1024, gate/up/down 4096×14336 (wide), 32 layers; the state
  # splits columns in blocks of cols / devices, which bounds the column parts.
  shapes = [(64, 4096, 4096), (64, 1024, 4096), (96, 4096, 14336)]
  width = [n // devices for _, _, n in shapes]
  fits = lambda item, g: width[item[0]] % g == 0
  flops = per_device_flops(shapes, devices, NS, split_ok=fits, flops_per_byte=0)
  assert flops <= 1.10 * ideal(shapes, devices)



def test_a_memory_budget_splits_every_matrix_until_its_work_fits():
  # 12 matrices of 64×256 on 8 devices: whole, one holds 2·64·256 + 4·64² elements. A
  # budget below that splits all 12 (not only the 4 left over) over the fewest devices
  # whose parts fit; no budget leaves the full round whole.
  shapes = [(12, 64, 256), (8, 16, 16)]
  whole = working_set(64, 256, 1)
  assert [r.split for r in plan_rounds(shapes, 8)][:1] == [1]
  for budget in (whole / 2, whole / 4):
    rounds = plan_rounds(shapes, 8, budget=budget)
    covers_every_matrix_once(shapes, rounds)
    split = {r.split for r in rounds if r.rows == 64}
    assert len(split) == 1 and working_set(64, 256, *split) <= budget
    assert working_set(64, 256, next(iter(split)) // 2) > budget  # the fewest that fit
    assert all(r.split == 1 for r in rounds if r.rows == 16)  # these fit whole
  # A budget no split can meet: the largest split there is.
  assert {r.split for r in plan_rounds(shapes, 8, budget=1) if r.rows == 64} == {8}


@pytest.mark.parametrize("devices", [256, 1024])
def test_the_default_budget_splits_a_70b_s_largest_matrices_until_their_work_fits(devices):
  # 80 layers of width 8192, ffn 28672: the flops alone leave the ffn matrices whole at
  # 256 devices and split them over 4 at 1024, each part's work over the state shard's
  # budget; the default budget splits them finer and leaves the other shapes' rounds.
  shapes = [(160, 8192, 8192), (160, 1024, 8192), (240, 8192, 28672)]
  budget = memory_budget(shapes, devices, None)
  rounds = plan_rounds(shapes, devices, NS, budget=budget)
  covers_every_matrix_once(shapes, rounds)
  assert all(working_set(r.rows, r.cols, r.split) <= budget for r in rounds)
  unbounded = plan_rounds(shapes, devices, NS)
  ffn = lambda plan: min(r.split for r in plan if r.cols == 28672)
  assert ffn(unbounded) == {256: 1, 1024: 4}[devices]
  assert working_set(8192, 28672, ffn(unbounded)) > budget and ffn(rounds) > ffn(unbounded)
  others = lambda plan: [r for r in plan if r.cols != 28672]
  assert others(rounds) == others(unbounded)


def test_groups_smaller_than_the_mesh_split_instead_of_padding():
  # 4 matrices of one shape and 4 of another on 8 devices: each shape in a round of its
  # own, split over pairs, all busy; no matrix is padded to the other's shape.
  rounds = plan_rounds([(4, 64, 256), (4, 64, 64)], 8, flops_per_byte=FLOPS_ALONE)
  assert [(r.rows, r.cols, r.split) for r in rounds] == [(64, 256, 2), (64, 64, 2)]
  assert all(None not in r.slots for r in rounds)
  flops = per_device_flops([(4, 64, 256), (4, 64, 64)], 8, flops_per_byte=FLOPS_ALONE)
  assert flops == (newton_schulz_flops(64, 256) + newton_schulz_flops(64, 64)) // 2
  assert flops < newton_schulz_flops(64, 256)  # what one shared, padded round costs
