"""The sharded update compiles for TPU: the real TPU compiler, run offline on a v5p
topology of 8 chips (`jax.experimental.topologies`), no TPU needed. Skipped where
libtpu is not installed (`pip install -e ".[all,tpu]"` installs it)."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import param_shardings

import muon_optax as mo
from benchmarks.hlo import collective_stats
from muon_optax._sharded_ns.factor_mesh import SHARED_MATRIX_SCOPE

# libtpu takes a lockfile that one process at a time may hold; conftest.py lets both
# workers load it (offline compiles hold no chip), as the benchmarks' TPU columns do too.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (the `tpu` extra)")


@pytest.fixture(scope="module")
def chips():
  from jax.experimental import topologies
  return np.asarray(topologies.get_topology_desc("v5p:2x2x2", "tpu").devices)


def gpt_tree(layers=8, d=128):
  """8 layers: 8 matrices of each shape, whole rounds on 8 chips (nothing split)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  tree = {str(i): {"attn": {"qkv": {"kernel": s(d, 3 * d)}, "proj": {"kernel": s(d, d)}},
                   "mlp": {"fc": {"kernel": s(d, 4 * d)}, "fc_proj": {"kernel": s(4 * d, d)},
                           "bias": s(4 * d)},
                   "ln": {"scale": s(d)}}
          for i in range(layers)}
  tree["embed"] = {"embedding": s(512, d)}
  return tree


def compile_update(tx, params, mesh, kind, data_axis="data"):
  return lower_update(tx, params, mesh, kind, data_axis).compile()


def lower_update(tx, params, mesh, kind, data_axis="data"):
  shard = param_shardings(params, mesh, kind, data_axis)
  params = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h),
                        params, shard)
  shardings = mo.state_shardings(tx, params, mesh, data_axis=data_axis)
  state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                       jax.eval_shape(tx.init, params), shardings)
  step = jax.jit(tx.update, out_shardings=(shard, shardings))
  return step.lower(params, state, params)


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_muon_on_a_mesh_compiles_for_tpu(chips, kind, types):
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(types,))
  layout = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded",
                         exchanges=1)
  compiled = compile_update(mo.muon(0.02, mesh=layout), gpt_tree(), mesh, kind)
  stats = collective_stats(compiled.as_text())
  # The exchange: one all-to-all in; one back (FSDP) or one gather (ZeRO-1), plus
  # ZeRO-1's packed gather of the AdamW updates.
  assert sum(n for n, _ in stats.values()) <= 4, stats
  assert stats["all-to-all"][0] >= 1, stats


def test_the_exchange_in_several_parts_compiles_for_tpu(chips):
  # MeshLayout(exchanges=k): k exchanges one after another, each one all-to-all in and
  # one out, so that the TPU compiler keeps one part's buffers live at a time.
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  tx = mo.muon(0.02, mesh=mo.MeshLayout(mesh, exchanges=2))
  stats = collective_stats(compile_update(tx, gpt_tree(), mesh, "fsdp").as_text())
  assert stats["all-to-all"][0] == 4, stats


FRONTIER = {
    "normuon": mo.normuon, "adamuon": mo.adamuon,
    "nordion2": mo.nordion2,
    "nordion2 per shard": lambda lr, **kw: mo.nordion2(
        lr, fraction=mo.RowSelection(0.25, scope="shard"), **kw),
    "muonbp": lambda lr, **kw: mo.muonbp(lr, blocks=mo.BlockPeriodic(period=4), **kw),
    "muonh": mo.muonh,
}


@pytest.mark.parametrize("make", FRONTIER.values(), ids=FRONTIER)
def test_the_family_on_a_mesh_compiles_for_tpu(chips, make):
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  compile_update(make(0.02, mesh=mesh), gpt_tree(), mesh, "fsdp")


def test_a_two_dimensional_mesh_compiles_for_tpu(chips):
  mesh = Mesh(chips.reshape(4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  axes = ("data", "fsdp")
  tx = mo.muon(0.02, mesh=mo.MeshLayout(mesh, data_axis=axes, exchanges=1))
  compiled = compile_update(tx, gpt_tree(), mesh, "fsdp", data_axis=axes)
  stats = collective_stats(compiled.as_text())
  assert sum(n for n, _ in stats.values()) <= 3, stats


@pytest.mark.parametrize("kind", ["tp", "fsdp_tp"])
def test_a_stated_tensor_parallel_layout_compiles_for_tpu_in_the_exchanges_collectives(
    chips, kind):
  # Megatron-style TP (alone, or with FSDP on "data") on an Auto mesh, its layout stated
  # as the shardings passed to jit: one all-to-all in and one out, plus (TP alone, or
  # biases and norms replicated over "data") one packed all-gather of AdamW's updates.
  from benchmarks.common import layout_shardings
  mesh = Mesh(chips.reshape(4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  shardings = layout_shardings(kind, gpt_tree(), mesh)
  params = jax.tree.map(lambda p, h: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=h),
                        gpt_tree(), shardings)
  layout = mo.MeshLayout(mesh, params=shardings, exchanges=1)
  tx = mo.muon(0.02, mesh=layout)
  state_shardings = mo.state_shardings(tx, params, layout)
  state = jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                       jax.eval_shape(tx.init, params), state_shardings)
  step = jax.jit(tx.update, out_shardings=(shardings, state_shardings))
  stats = collective_stats(step.lower(params, state, params).compile().as_text())
  assert {k: n for k, (n, _) in stats.items() if n} == {"all-to-all": 2, "all-gather": 1}, stats


@pytest.mark.parametrize("how", [{"flops_per_byte": 0}, {"memory": 0.5}])
def test_split_matrices_compile_for_tpu(chips, how):
  # Two matrices for eight chips: each is split by columns over four of them (balancing
  # flops alone, or capped for memory: then over all eight), whose Gram sums and m×m
  # blocks are collectives over the group, in their own scope.
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"a": {"kernel": s(128, 512)}, "b": {"kernel": s(512, 128)}}
  tx = mo.muon(0.02, mesh=mo.MeshLayout(mesh, **how))  # split, whatever it costs
  text = compile_update(tx, params, mesh, "fsdp").as_text()
  count = lambda stats: sum(n for n, _ in stats.values())
  assert count(collective_stats(text)) > count(collective_stats(text, outside=SHARED_MATRIX_SCOPE))


def test_an_owned_expert_stack_compiles_for_tpu_and_moves_nothing(chips):
  # Experts sharded on their stack axis lie whole on their chips: orthogonalized there.
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Explicit,))
  s = jax.ShapeDtypeStruct((8, 128, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  params = {"moe": {"kernel": s}}
  tx = mo.muon(0.02, mesh=mesh)
  shardings = mo.state_shardings(tx, params, mesh)
  state = jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h),
                       jax.eval_shape(tx.init, params), shardings)
  step = jax.jit(tx.update, out_shardings=({"moe": {"kernel": s.sharding}}, shardings))
  stats = collective_stats(step.lower(params, state, params).compile().as_text())
  assert all(n == 0 for n, _ in stats.values()), stats


@pytest.mark.parametrize("name", ["muon", "normuon", "nordion2 per shard"])
def test_the_collective_count_does_not_grow_with_the_layers_on_tpu(chips, name):
  # The TPU compiler combines the per-neuron statistics' small all-reduces across leaves
  # (the CPU one does not): the count is the same for 2 and 8 layers.
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  make = {"muon": mo.muon, **FRONTIER}[name]
  counts = []
  for layers in (2, 8):
    tx = make(0.02, mesh=mo.MeshLayout(mesh, exchanges=1))
    stats = collective_stats(compile_update(tx, gpt_tree(layers), mesh, "fsdp").as_text())
    counts.append({op: n for op, (n, _) in stats.items() if n})
  assert counts[0] == counts[1], counts
  assert sum(counts[0].values()) <= 8, counts


def test_newton_schulz_takes_the_defaults_of_the_mesh_platform(chips):
  # jax's default backend is the CPU here, but the update runs on the mesh's TPU chips:
  # its products take TPU's defaults, bfloat16 operands (float32 on a CPU mesh).
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  text = lower_update(mo.muon(0.02, mesh=mesh), gpt_tree(layers=2), mesh, "fsdp").as_text()
  products = [line for line in text.splitlines() if "dot_general" in line]
  assert products and any("bf16" in line for line in products)


@pytest.mark.parametrize("types, kind", [
    (AxisType.Auto, "fsdp"), (AxisType.Explicit, "fsdp"), (AxisType.Auto, "zero1"),
    (AxisType.Explicit, "zero1")])
def test_a_tpu_mesh_sends_its_results_back_in_bfloat16(chips, types, kind):
  # The iteration rounds its operands to bfloat16 on a TPU, so its results go back in
  # it: the same collectives, the way back (FSDP's all-to-all, ZeRO-1's gather of the
  # results) at half the bytes, the momenta whole (FSDP: a quarter less in all);
  # exchange_dtype="bfloat16" halves both ways. ZeRO-1's AdamW updates stay float32.
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(types,))
  moved = {}
  for wire in (None, "float32", "bfloat16"):
    layout = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded",
                           exchanges=1, exchange_dtype=wire)
    text = compile_update(mo.muon(0.02, mesh=layout), gpt_tree(), mesh, kind).as_text()
    moved[wire] = collective_stats(text)
  sent, both = moved["float32"], moved["bfloat16"]
  if kind == "fsdp":
    count, received = sent["all-to-all"]
    assert count == 2 and received > 0, moved  # one in, one out, as large
    for wire, share in ((None, 0.75), ("bfloat16", 0.5)):
      assert moved[wire] == {**sent, "all-to-all": (count, share * received)}, moved
    assert sum(n for n, _ in moved[None].values()) == count, moved
  else:
    assert moved[None]["all-to-all"] == sent["all-to-all"], moved
    assert moved[None]["all-gather"] == both["all-gather"], moved
    assert both["all-gather"][1] < sent["all-gather"][1], moved


def _relaid_collective_outputs(text: str) -> list[str]:
  """The fusions that read one collective's output whole into as many elements: a
  relayout of the whole buffer."""
  shape = r"(\w+)\[([\d,]*)\]"
  size = lambda dims: int(np.prod([int(d) for d in dims.split(",") if d]))
  outputs = {}
  for m in re.finditer(rf"%([\w.-]+) = {shape}\{{[^}}]*\}} (?:all-to-all|all-gather)\(", text):
    outputs[m.group(1)] = size(m.group(3))
  return [m.group(0)[:80] for m in re.finditer(rf"%[\w.-]+ = {shape}\{{[^}}]*\}} fusion\(%([\w.-]+)\)",
                                               text)
          if m.group(3) in outputs and size(m.group(2)) == outputs[m.group(3)]]


@pytest.mark.parametrize("kind", ["fsdp", "zero1"])
def test_exchange_buffers_are_read_where_the_collectives_write_them(chips, kind):
  # A TPU lays a collective's rows out a tile each; a (devices, width) view of them is a
  # copy of the whole buffer (`peer_rows`), on each side of every exchange.
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  layout = mo.MeshLayout(mesh, params="replicated" if kind == "zero1" else "sharded")
  text = compile_update(mo.muon(0.02, mesh=layout), gpt_tree(d=256), mesh, kind).as_text()
  assert "all-to-all(" in text
  assert _relaid_collective_outputs(text) == []


def test_a_tpu_mesh_forms_its_products_whole(chips, monkeypatch):
  # Block rows' slices and joins cost a TPU more HBM traffic than their flops save
  # (benchmarks/results/mesh_products.txt): a mesh forms every product whole, even
  # where one chip would cut X Xᵀ (its floors lowered here to this small shape).
  from test_orthogonalize import mesh_update_flops

  from muon_optax._newton_schulz import symmetric
  monkeypatch.setitem(symmetric.MIN_CUT_ROWS_ON, "tpu", 0)
  monkeypatch.setitem(symmetric.MIN_GRAM_SPACE_X_XT_CUT_WORK_ON, "tpu", 0)
  mesh = Mesh(chips.reshape(8), ("data",), axis_types=(AxisType.Auto,))
  ns = mo.NewtonSchulz().on("tpu")
  whole = mo.newton_schulz_plan((512, 1024), ns, backend="tpu", symmetric=False).flops
  assert mo.newton_schulz_plan((512, 1024), ns, backend="tpu").flops < 0.95 * whole  # X Xᵀ cut
  assert whole <= mesh_update_flops(mesh) <= 1.02 * whole


def test_the_symmetric_benchmark_prices_the_tpu_row_floor(capsys):
  # Compiled for one v5p chip, every arm of the benchmark prices its products: below the
  # floors the default's products are whole (its "symmetric" row, and those of the arms
  # that cut differently above them, equal the whole products'), and the floors lifted
  # cut them.
  from benchmarks import newton_schulz_symmetric
  newton_schulz_symmetric.main(["--shapes", "", "--platform", "tpu", "--flops-only", "512x1024"])
  rows = {cells[2]: float(cells[3]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("| 512×1024 | tpu v5p |") for cells in [line.split(" | ")]}
  assert list(rows) == list(newton_schulz_symmetric.ns_arms("tpu"))
  for arm in newton_schulz_symmetric.NS_ARMS:
    whole = rows[f"newton_schulz {arm}, whole products"]
    assert rows[f"newton_schulz {arm}, symmetric"] == whole
    assert rows[f"newton_schulz {arm}, cut at any size"] < 0.95 * whole
    assert rows[f"newton_schulz {arm}, squares whole"] == whole
  for name, flops in rows.items():
    if "Gram-space products cut" in name:
      assert flops == rows[name.split(", ")[0] + ", whole products"]
