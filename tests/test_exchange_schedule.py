"""The static plan of one exchange on its own: no mesh, no compile (the exchange that
runs it is tested on 8 devices in test_sharded_ns_solver.py)."""

from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz.settings import DEFAULT_NS as NS
from muon_optax._placement.mesh_layout import EXCHANGES
from muon_optax._sharded_ns.exchange_schedule import (
  ExchangePlan,
  Span,
  Unit,
  buffer_elements,
  exchanges_by_need,
  out_slice,
  piece,
  slice_width,
  split_into_exchanges,
  unit_size,
  unit_work,
  units,
)
from muon_optax._sharded_ns.rounds import Round, plan_rounds
from muon_optax._sharded_ns.split_cost import (
  PRODUCT_CHUNKS,
  WHOLE_PRODUCTS_SHARE,
  split_collectives,
  working_set,
)
from muon_optax._sharded_ns.stack_shards import StackShards

DEVICES = 8


def columns(rows, cols, replicas=1):
  """A stack's layout with its columns split over the devices (each block replicated
  over `replicas` consecutive devices)."""
  blocks = DEVICES // replicas
  return StackShards(P(None, None, "d"), (1, blocks), (rows, cols // blocks), replicas,
                tuple((0, s // replicas, s % replicas) for s in range(DEVICES)))


def in_rows(rows, cols):
  """A stack's layout with its rows split over the devices: a column part of it is a
  slice of every block, never whole blocks (`takes_whole_shards`)."""
  return StackShards(P(None, "d", None), (DEVICES, 1), (rows // DEVICES, cols), 1,
                tuple((s, 0, 0) for s in range(DEVICES)))


def partial(rows, cols, stack, first, count, split=1):
  """A round of `count` matrices of stack `stack` on devices from `first` on."""
  slots = [None] * DEVICES
  for j in range(count):
    slots[first + j * split:first + (j + 1) * split] = [(stack, j)] * split
  return Round(rows, cols, tuple(slots), split)


def test_pieces_are_a_shards_slices_split_between_its_replicas():
  shards = columns(16, 64)  # 16×8 shards
  assert (slice_width(shards, 1), slice_width(shards, 3)) == (8, 3)
  assert (piece(shards, 1), piece(shards, 3)) == (128, 48)
  assert piece(columns(16, 64, replicas=2), 1) == 16 * 16 // 2
  assert out_slice(shards, columns(16, 64, replicas=2), 1) == 16
  assert out_slice(shards, columns(16, 64, replicas=2), 2) == 4  # the input's slices


def test_rounds_on_disjoint_devices_share_a_slot_as_wide_as_their_widest_piece():
  ins = [columns(16, 64), columns(32, 64), columns(16, 16)]
  rounds = [partial(16, 64, 0, 0, 4), partial(32, 64, 1, 4, 3),
            Round(16, 16, tuple((2, j) for j in range(DEVICES)))]
  plan = ExchangePlan.of(rounds, ins, ins, gather=False, devices=DEVICES)
  assert plan.slots == [[0, 1], [2]] and plan.slot == [0, 0, 1]
  assert plan.width == [128, 256, 32] and plan.start == [0, 0, 256]
  assert plan.slot_width == [256, 32] and plan.back_slot_width == plan.slot_width
  assert plan.back_width == plan.width and plan.back_start == plan.start
  assert [plan.owner(0, d) for d in range(DEVICES)] == [0, 0, 0, 0, 1, 1, 1, None]
  assert plan.table(0) == [0, 0, 0, 0, 1, 1, 1, 0]
  assert plan.where[(1, 2)] == (1, 6)


def test_a_slot_is_filled_span_by_span_one_slice_of_a_stack_each():
  ins = [in_rows(16, 64), columns(32, 64), in_rows(16, 64)]
  mixed = Round(16, 64, ((2, 0),) * 2 + ((0, 1),) * 2 + ((0, 2),) * 2 + (None,) * 2, 2)
  rounds = [mixed, partial(32, 64, 1, 6, 2)]
  plan = ExchangePlan.of(rounds, ins, ins, gather=False, devices=DEVICES)
  assert plan.slots == [[0, 1]]
  # Stack 0's matrices 1 and 2 lie on consecutive devices: one span; stack 2's apart.
  assert plan.spans(0) == [Span(2, 0, 2, 0), Span(4, 0, 0, 1), Span(2, 1, 1, 0)]
  alone = ExchangePlan.of([partial(16, 64, 0, 1, 3), partial(16, 64, 2, 5, 1)], ins, ins,
                          gather=False, devices=DEVICES)
  assert alone.spans(0) == [Span(1), Span(3, 0, 0, 0), Span(1), Span(1, 1, 2, 0), Span(2)]
  for plan_ in (plan, alone):  # every device once, in order
    assert sum(s.devices for s in plan_.spans(0)) == DEVICES


def test_a_buffer_is_filled_in_segments_of_devices_that_lie_in_one_span_of_every_slot():
  ins = [in_rows(16, 64), columns(16, 64), columns(16, 16)]
  rounds = [partial(16, 64, 0, 0, 2, split=4), partial(16, 16, 2, 0, 4),
            partial(16, 16, 1, 4, 4)]
  plan = ExchangePlan.of(rounds, ins, ins, gather=False, devices=DEVICES)
  assert plan.slots == [[0], [1, 2]]
  assert plan.spans(0) == [Span(8, 0, 0, 0)]  # matrices 0 and 1, 4 devices each
  assert plan.spans(1) == [Span(4, 1, 2, 0), Span(4, 2, 1, 0)]
  assert plan.segments([0, 1]) == [
      (0, 4, [(Span(8, 0, 0, 0), 0), (Span(4, 1, 2, 0), 0)]),
      (4, 4, [(Span(8, 0, 0, 0), 4), (Span(4, 2, 1, 0), 0)])]
  # Spans cut finer in one slot cut the others': offsets into their spans.
  finer = ExchangePlan.of([partial(16, 64, 0, 0, 2, split=4), partial(16, 16, 2, 2, 3)],
                          ins, ins, gather=False, devices=DEVICES)
  assert finer.slots == [[0], [1]]
  assert finer.spans(1) == [Span(2), Span(3, 1, 2, 0), Span(3)]
  assert [(a, n, [off for _, off in where]) for a, n, where in finer.segments([0, 1])] == [
      (0, 2, [0, 0]), (2, 3, [2, 0]), (5, 3, [5, 0])]
  assert plan.segments([]) == []


def test_rounds_on_the_same_devices_and_block_wise_rounds_keep_slots_of_their_own():
  # Stack 0's 3-column blocks split over pairs take whole blocks (`takes_whole_shards`): its
  # parts travel apart, in an all-to-all of their own.
  ins = [columns(16, 24), columns(16, 64), columns(16, 64)]
  rounds = [partial(16, 24, 0, 0, 2, split=2), partial(16, 64, 1, 4, 2),
            partial(16, 64, 2, 5, 2)]
  plan = ExchangePlan.of(rounds, ins, ins, gather=False, devices=DEVICES)
  assert plan.whole_shards == {0} and plan.width[0] == 0
  assert plan.slots == [[0], [1], [2]]
  assert plan.start[1:] == [0, 128]


def test_split_rounds_of_a_kind_run_together_as_many_as_fit_the_budget():
  whole = [partial(16, 64, 0, 0, 8)] * 2
  split = [partial(16, 64, 1, 0, 4, split=2)] * 3
  other = [partial(16, 64, 1, 0, 2, split=4)]
  rounds = [whole[0], split[0], other[0], split[1], whole[1], split[2]]
  order = lambda budget: [unit.rounds for unit in units(rounds, budget)]
  assert order(None) == [[0], [1, 3, 5], [2], [4]]
  two = 2 * working_set(16, 64, 2)
  assert order(two) == [[0], [1, 3], [2], [4], [5]]
  assert order(two - 1) == [[0], [1], [2], [3], [4], [5]]
  # 16 rows: never formed in blocks (`most_product_chunks`), whatever the budget.
  assert {unit.product_chunks for unit in units(rounds, two - 1)} == {1}


# Llama-3-8B's gate/up/down shape, wide, split over 32 devices: with its m×m products
# whole a unit holds a 4096² matrix more than in blocks, but runs fewer collectives.
BIG = (4096, 14336, 32)


def test_a_unit_forms_its_products_whole_where_that_fits_and_launches_fewer_collectives():
  blocked, whole = working_set(*BIG), working_set(*BIG, product_chunks=1)
  assert whole > blocked
  per = lambda chunks: split_collectives(*BIG, NS, product_chunks=chunks)
  assert per(1) < per(PRODUCT_CHUNKS) < 4 * per(1)
  # No cap: every round in one unit, products whole.
  assert unit_size(*BIG, 3, None, NS) == (3, 1)
  # A cap whose share for whole products holds one round, and four rounds in blocks:
  # three rounds run fewer collectives whole, one unit each, than in blocks in one
  # unit; four run fewer in blocks.
  cap = whole / WHOLE_PRODUCTS_SHARE
  assert cap // blocked >= 4
  assert unit_size(*BIG, 3, cap, NS) == (1, 1)
  assert unit_size(*BIG, 4, cap, NS) == (4, PRODUCT_CHUNKS)
  assert unit_size(*BIG, 1, cap, NS) == (1, 1)
  # Whole products fit the cap, but not its share for them: blocks.
  assert whole // blocked == 2 and unit_size(*BIG, 3, whole, NS) == (2, PRODUCT_CHUNKS)
  # Nothing fits: one round a unit, in the most blocks, as small as it gets.
  assert unit_size(*BIG, 3, 1.0, NS) == (1, PRODUCT_CHUNKS)


def test_units_carry_their_kind_s_blocks_and_rounds_of_whole_matrices_none():
  rounds = [Round(*BIG[:2], (None,) * DEVICES), Round(*BIG[:2], (None,) * DEVICES, BIG[2]),
            Round(*BIG[:2], (None,) * DEVICES, BIG[2])]
  blocked = working_set(*BIG)
  got = units(rounds, blocked, NS)
  assert got == [Unit([0], 1), Unit([1], PRODUCT_CHUNKS), Unit([2], PRODUCT_CHUNKS)]
  assert units(rounds, None, NS) == [Unit([0], 1), Unit([1, 2], 1)]


def test_exchanges_by_need_are_the_fewest_whose_buffers_fit_beside_the_largest_unit():
  # 32 matrices 64×128 on 8 devices: 4 whole rounds, each a slot of its own.
  stacks = [columns(64, 128)]
  rounds = plan_rounds([(32, 64, 128)], DEVICES)
  assert len(rounds) == 4
  need = lambda budget: exchanges_by_need(rounds, stacks, stacks, False, budget)
  work = max(unit_work(rounds, unit) for unit in units(rounds, None))
  assert work == 2 * 64 * 128 + 4 * 64 * 64  # one whole matrix (`working_set`)
  # One exchange's buffers: every matrix of a device's round in and back, 4 rounds.
  whole = buffer_elements(ExchangePlan.of(rounds, stacks, stacks, False, DEVICES), False)
  assert whole == 2 * 4 * 64 * 128
  assert need(None) == 1 and need(whole + work) == 1
  # The fewest that fit: two exchanges of two rounds each hold half the buffers.
  assert need(whole + work - 1) == 2 and need(whole / 2 + work) == 2
  # Three cut 4 rounds as 1 + 2 + 1, no smaller than two: past them, four.
  assert need(whole / 2 + work - 1) == EXCHANGES
  assert need(work) == EXCHANGES  # nothing fits
  # Gathered, every device receives every result: n times the results it owns.
  gathered = buffer_elements(ExchangePlan.of(rounds, stacks, stacks, True, DEVICES), True)
  assert gathered == 4 * 64 * 128 * (1 + DEVICES)


def test_exchanges_are_capped_by_the_rounds():
  # Rounds that share devices travel together: 4 rounds make at most 4 exchanges, so a
  # count of 8 (`MeshLayout(exchanges=8)`) cuts them exactly as 4 does.
  rounds = plan_rounds([(32, 64, 128)], DEVICES)
  assert split_into_exchanges(rounds, 8) == split_into_exchanges(rounds, 4)
  assert [len(part) for part in split_into_exchanges(rounds, 8)] == [1] * 4
  stacks = [columns(64, 128)]
  assert exchanges_by_need(rounds[:2], stacks, stacks, False, 1.0) == 2  # nothing fits
