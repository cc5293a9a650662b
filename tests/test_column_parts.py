"""Block-wise column parts of split matrices: parts cut finer than the input blocks, and
parts of whole blocks that travel as runs, give the single-device update."""


import jax
import pytest
from _helpers import assert_trees_close
from sharded_case import (
  AUTO,
  EXPLICIT,
  FLOPS_ALONE,
  mesh_of,
  optimizer,
  param_shardings,
  placed,
  run_steps,
)

import muon_optax as mo
from muon_optax._sharded_ns.exchange_schedule import Span, spans_of
from muon_optax._sharded_ns.rounds import plan_rounds
from muon_optax._sharded_ns.split_cost import (
  working_set,
)


def narrow_blocks_tree():
  """Columns split in blocks narrower than the parts the plan cuts them into: 24 and 40
  columns over 8 devices are blocks of 3 and 5, cut into zero-padded slices."""
  ks = jax.random.split(jax.random.key(4), 3)
  n = lambda k, s: jax.random.normal(k, s) * 0.1
  return {"a": {"kernel": n(ks[0], (16, 24))}, "b": {"kernel": n(ks[1], (40, 16))},
          "c": {"kernel": n(ks[2], (2, 24, 40))}}


@pytest.mark.parametrize("layout, types", [("zero1", AUTO), ("fsdp", AUTO), ("fsdp", EXPLICIT)])
def test_splits_finer_than_the_input_blocks_match_single_device(layout, types):
  mesh, params = mesh_of(types=types), narrow_blocks_tree()
  shapes = [(1, 16, 24), (1, 16, 40), (2, 24, 40)]
  blocks = [8, 8, 8]  # the state's columns (the long side) over the 8 devices
  rounds = plan_rounds(shapes, 8, col_shards=blocks, flops_per_byte=FLOPS_ALONE)
  assert any(r.split > 1 and r.cols // 8 % r.split for r in rounds), rounds
  pshard = param_shardings(params, mesh, layout)
  want_p, _ = run_steps(optimizer(), params, 5)
  got_p, _ = run_steps(optimizer(placed(mesh, layout)), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)


@pytest.mark.parametrize("count", [4, 3])
def test_block_wise_parts_of_a_stack_travel_as_runs_and_match_single_device(count):
  # A stack of 24×40 matrices in 5-column blocks split over pairs: each part is whole
  # blocks (`takes_whole_shards`), and consecutive matrices of the stack lie on consecutive
  # residue classes, which the exchange packs as one slice. A memory cap that fits a
  # matrix's work over a pair splits 3 of them so, leaving the last pair empty.
  mesh = mesh_of()
  params = {"c": {"kernel": jax.random.normal(jax.random.key(5), (count, 24, 40)) * 0.1}}
  budget = working_set(24, 40, 2)
  memory = budget / (count * 24 * 40 / 8)  # the cap, as a multiple of the shard
  rounds = plan_rounds([(count, 24, 40)], 8, col_shards=[8], budget=budget)
  assert [r.split for r in rounds] == [2]
  spans = spans_of([None if item is None else (0, 1, item) for item in rounds[0].slots[::2]])
  assert spans == [Span(count, 0, 0, 0)] + [Span(4 - count)] * (count < 4)
  layout = mo.MeshLayout(mesh, params="sharded", memory=memory)
  want_p, _ = run_steps(optimizer(), params, 5)
  got_p, _ = run_steps(optimizer(layout), params, 5, (mesh, mo.fsdp_shardings(params, mesh)))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)
