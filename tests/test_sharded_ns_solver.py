"""The sharded Newton–Schulz update (`sharded_solver`) through `muon(mesh=...)` on 8
simulated devices: the same results as one device, and the flops, bytes, collectives
and memory its compiled programs hold."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import all_to_all_bytes, assert_trees_close, float32_bound, rel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import (
  AUTO,
  EXPLICIT,
  FLOPS_ALONE,
  compiled_update,
  gpt2_small_tree,
  lowered_update,
  mesh_of,
  optimizer,
  param_shardings,
  placed,
  run_steps,
  small_tree,
)

import muon_optax as mo
from benchmarks.hlo import collective_ops, collective_stats
from muon_optax._newton_schulz import symmetric
from muon_optax._newton_schulz.kernel import Kernel
from muon_optax._newton_schulz.variant import newton_schulz_flops
from muon_optax._placement.mesh_layout import EXCHANGES
from muon_optax._sharded_ns.factor_mesh import SHARED_MATRIX_SCOPE
from muon_optax._sharded_ns.rounds import per_device_flops, plan_rounds
from muon_optax._sharded_ns.solver import wire_dtypes
from muon_optax._sharded_ns.split_cost import (
  PRODUCT_CHUNKS,
  WHOLE_PRODUCTS_SHARE,
  memory_budget,
  split_bytes,
  split_collectives,
  working_set,
)


@pytest.mark.parametrize("layout, types, backend", [
    ("zero1", AUTO, "optax"), ("fsdp", AUTO, "optax"), ("zero1", EXPLICIT, "optax"),
    ("fsdp", EXPLICIT, "optax"), ("fsdp", EXPLICIT, "reference")])
def test_matches_single_device_over_five_steps(layout, types, backend):
  mesh, params = mesh_of(types=types), small_tree()
  pshard = param_shardings(params, mesh, layout)
  want_p, want_s = run_steps(optimizer(backend=backend), params, 5)
  got_p, got_s = run_steps(optimizer(placed(mesh, layout), backend), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)
  assert_trees_close(got_s, want_s, rtol=0, atol=1e-5)
  # No resharding drift: the state keeps the layout state_shardings gave it.
  expected = mo.state_shardings(optimizer(mesh, backend), jax.device_put(params, pshard), mesh)
  jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(
      f"{x.sharding} != {s}"), got_s, expected)


def few_matrices_tree():
  """Four Muon matrices for eight devices: each is split over two of them."""
  ks = jax.random.split(jax.random.key(3), 5)
  n = lambda k, s: jax.random.normal(k, s) * 0.1
  return {"a": {"kernel": n(ks[0], (32, 128))}, "b": {"kernel": n(ks[1], (128, 32))},
          "c": {"kernel": n(ks[2], (32, 64))}, "d": {"kernel": n(ks[3], (40, 40))},
          "ln": {"scale": jnp.ones(32)}}


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_fewer_matrices_than_devices_split_and_match_single_device(layout):
  mesh, params = mesh_of(), few_matrices_tree()
  rounds = plan_rounds([(1, 32, 128), (1, 32, 128), (1, 32, 64), (1, 40, 40)], 8,
                       flops_per_byte=FLOPS_ALONE)
  # Each shape in rounds of its own, split (columns, and rows of the m×m products) to
  # fill every device: 2 × 4, 1 × 8, 1 × 8.
  assert {(r.rows, r.cols): r.split for r in rounds} == {(32, 128): 4, (32, 64): 8,
                                                          (40, 40): 8}
  assert all(None not in r.slots for r in rounds)
  pshard = param_shardings(params, mesh, layout)
  tx = lambda mesh=None: mo.muon(0.05, weight_decay=0.01, mesh=mesh,
                                 adam=mo.AuxAdam(1e-2, backend="optax"))
  want_p, _ = run_steps(tx(), params, 5)
  got_p, _ = run_steps(tx(placed(mesh, layout)), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)


def test_split_matrices_at_extreme_scales_match_single_device():
  # A shared matrix divides by its peak inside the Gram sums' row blocks, not as a copy:
  # updates of size 1e-30 and 1e30 give the single-device directions (within twice the
  # float32 evaluation bound, as whole matrices do), and 0 gives 0.
  mesh, params = mesh_of(), few_matrices_tree()
  matrices = {k: v for k, v in params.items() if "kernel" in v}
  shardings = mo.fsdp_shardings(matrices, mesh)
  on_mesh = lambda u: jax.jit(mo.orthogonalize(mesh=placed(mesh)).update)(
      jax.device_put(u, shardings), optax.EmptyState())[0]
  single = lambda u: jax.jit(mo.orthogonalize().update)(u, optax.EmptyState())[0]
  assert any(r.split > 1 for r in plan_rounds([(1, 32, 128)] * 2 + [(1, 32, 64), (1, 40, 40)],
                                              8, flops_per_byte=FLOPS_ALONE))
  for k in (1e-30, 1.0, 1e30):
    updates = jax.tree.map(lambda x: x * k, matrices)
    got, want = on_mesh(updates), single(updates)
    for name in matrices:
      assert np.all(np.isfinite(got[name]["kernel"])), (k, name)
      assert rel(got[name]["kernel"], want[name]["kernel"]) < 2 * float32_bound(), (k, name)
  zeros = jax.tree.map(jnp.zeros_like, matrices)
  assert all(not np.any(leaf) for leaf in jax.tree.leaves(on_mesh(zeros)))


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_rounds_of_one_shape_in_different_splits_match_single_device(layout):
  # 3 matrices on 8 devices: one split over pairs would leave 2 devices idle; two over
  # groups of 4, then one over all 8, keep every device busy at the ideal flops.
  mesh = mesh_of()
  ks = jax.random.split(jax.random.key(5), 3)
  params = {"a": {"kernel": jax.random.normal(ks[0], (32, 128)) * 0.1},
            "b": {"kernel": jax.random.normal(ks[1], (128, 32)) * 0.1},  # transposed
            "c": {"kernel": jax.random.normal(ks[2], (32, 128)) * 0.1}}
  shapes = [(1, 32, 128)] * 3
  rounds = plan_rounds(shapes, 8, flops_per_byte=FLOPS_ALONE)
  assert [r.split for r in rounds] == [4, 8]
  assert all(None not in r.slots for r in rounds)
  assert per_device_flops(shapes, 8, flops_per_byte=FLOPS_ALONE) == 3 * newton_schulz_flops(32, 128) // 8
  pshard = param_shardings(params, mesh, layout)
  want_p, _ = run_steps(optimizer(), params, 5)
  got_p, _ = run_steps(optimizer(placed(mesh, layout)), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)


def test_two_dimensional_mesh_matches_single_device():
  mesh = mesh_of((4, 2), ("data", "model"))
  params = small_tree(1)
  pshard = jax.tree.map(
      lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "model")
                              if x.ndim >= 2 and x.shape[-1] % 2 == 0 else P()), params)
  want_p, _ = run_steps(optimizer(), params, 5)
  got_p, got_s = run_steps(optimizer(mesh), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)
  fc = got_s.inner_states["muon"].inner_state[0][0].mu["blocks"]["fc"]["kernel"]
  assert set(fc.sharding.spec) >= {"model"} and "data" in str(fc.sharding.spec)


@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_gpt2_small_update_near_the_ideal_flops_and_bytes(kind, monkeypatch):
  params, mesh, n = gpt2_small_tree(), mesh_of(), 8
  single = compiled_update(mo.muon(0.02), params).cost_analysis()["flops"]
  with monkeypatch.context() as patch:  # every product whole, as the plan counts them
    patch.setattr(symmetric, "MIN_BLOCK_ROWS", 1 << 62)
    single_whole = compiled_update(mo.muon(0.02), params).cost_analysis()["flops"]
  sharded = compiled_update(mo.muon(0.02, mesh=placed(mesh, kind)), params, mesh, kind)
  per_device = sharded.cost_analysis()["flops"]
  # 12 matrices of two shapes leave 4 over on 8 devices: split by pairs, not idle. A
  # split matrix's row blocks compute its m×m products whole, not symmetric: the plan
  # balances whole-product counts, and only whole matrices save on top of that.
  assert single / n <= per_device <= 1.06 * single_whole / n, (per_device, single / n)
  stats = collective_stats(sharded.as_text())
  # One all-to-all in and one out (FSDP) per exchange, as many as memory needs (see
  # `test_exchanges_by_need`); the split matrices' own collectives are traced in a scope
  # of their own.
  exchange = collective_stats(sharded.as_text(), outside=SHARED_MATRIX_SCOPE)
  assert exchange["all-to-all"][0] <= 2 * EXCHANGES, exchange
  # Minimal bytes: every Muon element moves to its owner and back once; with
  # replicated params, back means every device receives the updates it did not compute.
  # The split matrices' Gram sums and row-block gathers add a few m×m (768²) each, as
  # the plan counts them (`split_bytes`; the leftover 768×2304 and 768×768 by pairs).
  size = sum(4 * np.prod(p.shape) for p in jax.tree.leaves(params))
  minimal = (n - 1) / n * size / n + (n - 1) / n * (size if kind == "zero1" else size / n)
  shapes = [(12, 768, 2304), (12, 768, 768), (24, 768, 3072)]
  shared = sum(split_bytes(r.rows, r.split, mo.NewtonSchulz().on("cpu"))
               for r in plan_rounds(shapes, n, flops_per_byte=FLOPS_ALONE) if r.split > 1)
  assert shared > 0
  assert sum(b for _, b in stats.values()) <= 1.1 * (minimal + shared), (stats, minimal, shared)


def test_exchanges_by_need():
  # GPT-2-small's 12 layers on 8 devices, FSDP: one exchange's buffers (about twice the
  # state shard) beside the largest matrix's Newton–Schulz work (768×3072) exceed the
  # default memory cap (twice the shard), two exchanges' halves fit it: one all-to-all
  # in and one out each. Where the cap holds one (three shards, or none), one exchange;
  # where it holds not even two or three (one shard), four.
  # ZeRO-1 (params replicated) holds every update whole on every device, and its
  # exchanges gather them: the cap adds those replicas (7 shards) to its multiple of the
  # shard (`memory_budget`). Two halves' buffers, each an all-to-all in and an
  # all-gather out, then fit from one shard on, one exchange's from four.
  params, mesh = gpt2_small_tree(), mesh_of()

  def exchange(kind="fsdp", **settings):
    layout = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded",
                           **settings)
    compiled = compiled_update(mo.muon(0.02, mesh=layout), params, mesh, kind)
    stats = collective_stats(compiled.as_text(), outside=SHARED_MATRIX_SCOPE)
    return {op: n for op, (n, _) in stats.items() if n}

  assert exchange() == {"all-to-all": 2 * 2}
  assert exchange(memory=1.0) == {"all-to-all": 2 * EXCHANGES}
  assert exchange(memory=3.0) == {"all-to-all": 2}
  assert exchange(memory=math.inf) == {"all-to-all": 2}
  assert exchange("zero1") == {"all-to-all": 2, "all-gather": 2}
  assert exchange("zero1", memory=1.0) == exchange("zero1")
  assert exchange("zero1", memory=4.0) == {"all-to-all": 1, "all-gather": 1}


@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_partial_rounds_on_disjoint_devices_share_a_slot_and_match_single_device(kind):
  # Four 16×64 and four 32×32 matrices on 8 devices, too small to split at the default
  # flops per byte: two partial rounds on devices 0-3 and 4-7, one buffer slot. Every
  # device then receives its own matrices' pieces only: the minimal bytes, no zeros.
  n = lambda k, s: jax.random.normal(jax.random.key(k), s) * 0.1
  params = {"wide": {"kernel": n(0, (4, 16, 64))}, "sq": {"kernel": n(1, (4, 32, 32))}}
  mesh = mesh_of()
  rounds = plan_rounds([(4, 16, 64), (4, 32, 32)], 8, mo.NewtonSchulz().on("cpu"))
  assert [r.split for r in rounds] == [1, 1], rounds
  layout = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded")
  pshard = param_shardings(params, mesh, kind)
  want, _ = run_steps(optimizer(), params, 2)
  got, _ = run_steps(optimizer(layout), params, 2, (mesh, pshard))
  assert_trees_close(got, want, rtol=0, atol=1e-5)
  stats = collective_stats(compiled_update(optimizer(layout), params, mesh, kind).as_text())
  share = 8 * 1024 * 4 // 8  # this device's bytes of the matrices (a block, or a slice)
  if kind == "zero1":  # in: 7/8 of its share; back: the 7 other owners' results
    assert (stats["all-to-all"][1], stats["all-gather"][1]) == (share * 7 // 8, 7 * 1024 * 4)
  else:  # in and back: 7/8 of its share
    assert stats["all-to-all"][1] == 2 * share * 7 // 8, stats


@pytest.mark.parametrize("kind, memory, split", [("fsdp", 4.0, 2), ("zero1", 2.0, 4)])
def test_a_split_round_shares_its_slot_with_whole_matrices_and_matches_single_device(
    kind, memory, split):
  # A memory cap splits the three 32×256 matrices: a partial round over pairs (or
  # groups of 4) leaves devices free, and the two 16×16 matrices run whole there, in
  # the same slot. Its devices also run the split round's program on what their slot
  # holds, collectives and all, within their own groups, and nobody reads the result.
  n = lambda k, s: jax.random.normal(jax.random.key(k), s) * 0.1
  params = {"wide": {"kernel": n(2, (3, 32, 256))}, "small": {"kernel": n(3, (2, 16, 16))}}
  shapes = [(3, 32, 256), (2, 16, 16)]
  budget = memory * sum(c * r * k for c, r, k in shapes) / 8
  rounds = plan_rounds(shapes, 8, mo.NewtonSchulz().on("cpu"), budget=budget)
  shared = [r for r in rounds if None in r.slots]
  assert [r.split for r in shared] == [split, 1], rounds
  assert not any(a is not None and b is not None for a, b in zip(*(r.slots for r in shared)))
  mesh = mesh_of()
  layout = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded",
                         memory=memory)
  pshard = param_shardings(params, mesh, kind)
  want, _ = run_steps(optimizer(), params, 2)
  got, _ = run_steps(optimizer(layout), params, 2, (mesh, pshard))
  assert_trees_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_explicit_mesh_update_in_the_collectives_of_an_auto_one(kind):
  # On Explicit axes the results take the params' layout from the types: ZeRO-1 gathers
  # once, not per leaf, exactly as an Auto mesh told the params are replicated.
  params = gpt2_small_tree(layers=2, d=128)
  count = lambda types: collective_stats(compiled_update(
      mo.muon(0.02, mesh=placed(mesh_of(types=types), kind)), params, mesh_of(types=types),
      kind).as_text())
  assert count(EXPLICIT) == count(AUTO)


@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_one_layer_per_device_flops_at_most_optax_contrib_muons(kind):
  # 4 matrices on 8 devices: whole matrices would leave the largest (768×3072) on one
  # device; splitting it over two beats XLA's tensor-parallel partition of each NS.
  params, mesh = gpt2_small_tree(layers=1), mesh_of()
  ours = compiled_update(mo.muon(0.02, mesh=placed(mesh, kind)), params, mesh,
                         kind).cost_analysis()["flops"]
  theirs = compiled_update(optax.contrib.muon(0.02), params, mesh, kind).cost_analysis()["flops"]
  assert ours <= theirs, (ours, theirs)


def test_whole_rounds_have_no_collective_inside_the_iterations():
  # 8 matrices of each shape for 8 devices: whole matrices only, so the number of
  # Newton–Schulz steps does not change the program's collectives.
  params, mesh = gpt2_small_tree(layers=8, d=128), mesh_of()
  stats = [collective_stats(compiled_update(mo.muon(0.02, ns=mo.NewtonSchulz(steps=k), mesh=mesh),
                                               params, mesh).as_text()) for k in (2, 7)]
  assert stats[0] == stats[1]


def test_leaves_that_lie_alike_share_one_assembly():
  # A round holds one leaf per device; leaves of one shape and layout are assembled and
  # sent back by one program on every device, with no branch per leaf (a conditional,
  # whose operands a compiler keeps live in each branch's layout).
  params, mesh = gpt2_small_tree(layers=8, d=128), mesh_of()
  hlo = compiled_update(mo.muon(0.02, mesh=mesh), params, mesh, "fsdp").as_text()
  assert " conditional(" not in hlo


def test_rounds_run_one_after_another_in_bounded_memory():
  # 16 layers of 4 matrices for 8 devices: 8 whole rounds. Run one after another, each
  # waiting on the last one's results, the compiler keeps about one round's Newton–Schulz
  # temporaries live, not all eight rounds' (which XLA's CPU scheduler did when the
  # rounds were independent: 3.3× the state shard for Llama-3-8B shapes on 8 devices).
  # Four exchanges, as on a larger model: by need this small one would take one, its
  # buffers well within the 32 MB floor of the memory cap.
  params, mesh = gpt2_small_tree(layers=16, d=256), mesh_of()
  layout = mo.MeshLayout(mesh, exchanges=EXCHANGES)
  compiled = compiled_update(mo.muon(0.02, mesh=layout, adam=mo.AuxAdam(backend="optax")),
                             params, mesh, "fsdp")
  shard = sum(4 * np.prod(p.shape) for p in jax.tree.leaves(params)) / 8
  assert compiled.memory_analysis().temp_size_in_bytes <= 1.5 * shard


@pytest.mark.parametrize("types", [AUTO, EXPLICIT])
def test_a_memory_cap_splits_every_matrix_and_matches_single_device(types):
  mesh, params = mesh_of(types=types), small_tree()
  capped = mo.MeshLayout(mesh, params="sharded", memory=0.25)
  want_p, want_s = run_steps(optimizer(), params, 3)
  got_p, got_s = run_steps(optimizer(capped), params, 3, (mesh, mo.fsdp_shardings(params, mesh)))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)
  assert_trees_close(got_s, want_s, rtol=0, atol=1e-5)


def test_a_memory_cap_bounds_temp_memory_with_split_matrices():
  # 4 layers of GPT-2 shapes at width 256 on 8 devices: 16 matrices, all whole in the
  # default plan (about 2× the state shard of temp). Capped at a quarter of the shard
  # for one matrix's work, every matrix is split, its rounds run one at a time, and
  # temp memory falls below the shard (the exchange's buffers come on top of the cap).
  params, mesh = gpt2_small_tree(layers=4, d=256), mesh_of()
  shard = sum(4 * np.prod(p.shape) for p in jax.tree.leaves(params)) / 8
  temp = lambda layout: compiled_update(mo.muon(0.02, mesh=layout, adam=mo.AuxAdam(
      backend="optax")), params, mesh, "fsdp").memory_analysis().temp_size_in_bytes
  default = temp(mo.MeshLayout(mesh, params="sharded"))
  capped = temp(mo.MeshLayout(mesh, params="sharded", memory=0.25))
  assert capped <= 0.5 * default and capped <= shard, (capped, default, shard)


def test_split_matrices_add_a_fixed_number_of_collectives_per_step():
  # 2 matrices per shape for 8 devices: all split. The Gram sums and row-block gathers of the
  # standard iteration repeat once per step, the exchange does not.
  params, mesh = gpt2_small_tree(layers=2, d=128), mesh_of()
  counts = [sum(c for c, _ in collective_stats(compiled_update(
      mo.muon(0.02, ns=mo.NewtonSchulz(steps=k, gram=False), mesh=placed(mesh)), params,
      mesh).as_text()).values()) for k in (2, 3, 4)]
  assert counts[2] - counts[1] == counts[1] - counts[0] > 0, counts


@pytest.mark.parametrize("ns", [mo.NewtonSchulz(), mo.NewtonSchulz(gram=False),
                                mo.NewtonSchulz("jordan", steps=5),
                                mo.NewtonSchulz(gram=False, compute_dtype="bfloat16"),
                                mo.NewtonSchulz(gram=True, compute_dtype="bfloat16")],
                         ids=["gram", "standard", "jordan", "bfloat16", "bfloat16 gram"])
@pytest.mark.parametrize("shape, memory, blocks", [
    ((64, 128), math.inf, 1), ((6, 128), math.inf, 1), ((4096, 8192), math.inf, 1),
    ((4096, 8192), 4.6, PRODUCT_CHUNKS)],
    ids=["rows split", "rows whole", "products whole", "products in blocks"])
def test_the_plan_counts_the_collectives_a_split_runs(ns, shape, memory, blocks):
  # 2 matrices on 8 devices, each split over 4: the plan's count (which prices a split's
  # fixed cost) is what the compiled iteration runs in its scope (compiled, not run).
  # With no memory cap the 4096-row matrices form their m×m products whole; under a cap
  # their work fits only with the products in blocks (the default's would split them
  # over 8).
  params = {f"l{k}": {"kernel": jax.ShapeDtypeStruct(shape, jnp.float32)} for k in range(2)}
  mesh = mesh_of()
  program = compiled_update(mo.muon(0.02, ns=ns, mesh=placed(mesh, memory=memory)), params,
                            mesh, "fsdp").as_text()
  shared = [op for op, _, _, name in collective_ops(program) if SHARED_MATRIX_SCOPE in name]
  budget = memory_budget([(2, *shape)], 8, memory)
  assert {r.split for r in plan_rounds([(2, *shape)], 8, ns, flops_per_byte=FLOPS_ALONE,
                                       budget=budget)} == {4}
  whole = math.inf if budget is None else WHOLE_PRODUCTS_SHARE * budget
  assert (working_set(*shape, 4, product_chunks=1) <= whole) == (blocks == 1)
  assert len(shared) == split_collectives(*shape, 4, ns, product_chunks=blocks)


def test_fewer_collective_bytes_than_optax_contrib_muon():
  params, mesh = gpt2_small_tree(layers=2, d=128), mesh_of()
  ours = collective_stats(compiled_update(mo.muon(0.02, mesh=mesh), params, mesh).as_text())
  theirs = collective_stats(compiled_update(optax.contrib.muon(0.02), params, mesh).as_text())
  total = lambda stats: sum(b for _, b in stats.values())
  assert total(ours) < total(theirs), (ours, theirs)
  assert sum(n for n, _ in ours.values()) < sum(n for n, _ in theirs.values())


@pytest.mark.parametrize("operands, wire, shares", [
    ("float32", None, (1, 1)),
    # The momenta travel whole (rounding them costs accuracy), the results in bfloat16
    # where the operands are 16-bit (see wire_dtypes: bfloat16 for float16 operands too).
    ("bfloat16", None, (1, 0.5)), ("float16", None, (1, 0.5)),
    ("bfloat16", "float32", (1, 1)), ("float32", "bfloat16", (0.5, 0.5))])
def test_the_exchange_moves_results_in_bfloat16_where_the_operands_are_16_bit(
    operands, wire, shares):
  mesh, params = mesh_of(), small_tree()

  def moved(wire):
    layout = mo.MeshLayout(mesh, params="sharded", exchanges=1, exchange_dtype=wire)
    tx = mo.muon(0.02, ns=mo.NewtonSchulz(compute_dtype=operands), mesh=layout)
    return all_to_all_bytes(lowered_update(tx, params, mesh, "fsdp").as_text())
  whole = moved("float32")  # in and out
  assert len(whole) == 2 and moved(wire) == [s * b for s, b in zip(shares, whole)]


@pytest.mark.parametrize("operands, back", [
    ("float32", None), ("bfloat16", "bfloat16"), ("float16", "bfloat16")])
def test_results_go_back_in_bfloat16_even_from_float16_operands(operands, back):
  # float16's range would lose small updates; bfloat16 keeps float32's.
  kernel = Kernel.of(mo.NewtonSchulz(compute_dtype=operands))
  layout = mo.MeshLayout(mesh_of(), params="sharded")
  assert wire_dtypes(kernel, layout, [jnp.float32]) == (None, back and jnp.dtype(back))
  assert wire_dtypes(kernel, layout, [jnp.bfloat16]) == (None, None)  # nothing to save


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_matrices_handed_over_in_bfloat16_arrive_and_return_rounded(wire):
  # A custom function's operands are unknown, so by default its matrices travel in their
  # own dtype; a stated bfloat16 exchange hands it each matrix rounded to bfloat16 and
  # hands back its bfloat16 result as float32. The function is exact in float32 on
  # bfloat16 values (small integer factors), so the results are exact.
  def fn(x):
    rows = jnp.arange(1, x.shape[-2] + 1, dtype=jnp.float32)[:, None]
    return (x.astype(jnp.float32) * rows * 3).astype(x.dtype)
  mesh = mesh_of()
  shapes = {"a": (32, 128), "b": (128, 32), "c": (24, 40), "d": (32, 32), "e": (64, 256)}
  params = {k: {"kernel": jnp.zeros(s)} for k, s in shapes.items()}
  grads = {k: {"kernel": jax.random.normal(jax.random.key(i), s)}
           for i, (k, s) in enumerate(shapes.items())}
  tx = mo.orthogonalize(mo.NewtonSchulz(fn=fn),
                        mesh=mo.MeshLayout(mesh, params="sharded", exchange_dtype=wire))
  shard = param_shardings(params, mesh, "fsdp")
  got, _ = jax.jit(tx.update)(jax.device_put(grads, shard), tx.init(params),
                              jax.device_put(params, shard))
  single = mo.orthogonalize(mo.NewtonSchulz(fn=fn))
  rounded = grads if wire is None else jax.tree.map(
      lambda g: g.astype(jnp.bfloat16), grads)
  want, _ = single.update(rounded, single.init(params))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      np.asarray(a), np.asarray(b.astype(jnp.float32))), got, want)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got))
