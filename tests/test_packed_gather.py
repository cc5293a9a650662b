"""The packed gather: arrays split over a mesh come back replicated, all of them in one
all-gather, whatever axes split them; what it cannot pack is left as it is."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import compiled_update, gpt2_small_tree, param_shardings, placed, run_steps, small_tree

import muon_optax as mo
from benchmarks.hlo import collective_stats
from muon_optax._placement.packed_gather import gather_together, with_packed_gather


def mesh_of(shape, names, types=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(types,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])


def arrays(shapes, dtypes=None):
  dtypes = dtypes or [jnp.float32] * len(shapes)
  return [jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s).astype(dt) * (k + 1)
          for k, (s, dt) in enumerate(zip(shapes, dtypes))]


def gathered(xs, specs, mesh):
  """The values, shardings and collectives of `gather_together` under jit."""
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(xs, specs)]
  fn = jax.jit(lambda *ys: gather_together(list(ys), specs, mesh))
  return fn(*placed), collective_stats(fn.lower(*placed).compile().as_text())


@pytest.mark.parametrize("mesh_shape, names, specs", [
    ((8,), ("data",), [P("data"), P(None, "data"), P("data", None), P(None, None, "data")]),
    ((2, 4), ("data", "fsdp"), [P(("data", "fsdp")), P("fsdp", "data"), P(None, "fsdp"),
                                P("data", None, "fsdp")]),
])
def test_every_split_array_comes_back_whole_in_one_all_gather(mesh_shape, names, specs):
  mesh = mesh_of(mesh_shape, names)
  shapes = [(16,), (4, 24), (8, 8), (2, 3, 8)]
  xs = arrays(shapes)
  out, stats = gathered(xs, specs, mesh)
  for x, y in zip(xs, out):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))  # a gather is exact
  # One all-gather of every device's blocks, packed: each device receives the other
  # seven's (a block replicated over an axis travels from each of its holders).
  blocks = [np.prod(NamedSharding(mesh, spec).shard_shape(x.shape)) for x, spec in zip(xs, specs)]
  moved = 7 * 4 * int(sum(blocks))
  assert stats["all-gather"] == (1, moved)
  assert sum(count for count, _ in stats.values()) == 1


def test_arrays_of_several_dtypes_pack_together_and_keep_their_dtype():
  mesh = mesh_of((8,), ("data",))
  xs = arrays([(16, 4), (8,)], [jnp.bfloat16, jnp.float32])
  out, stats = gathered(xs, [P("data"), P("data")], mesh)
  assert [y.dtype for y in out] == [jnp.bfloat16, jnp.float32]
  for x, y in zip(xs, out):
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))
  assert stats["all-gather"][0] == 1


def test_what_it_cannot_pack_is_left_as_it_is():
  mesh = mesh_of((8,), ("data",))
  xs = arrays([(12,), (5, 3)])
  # Replicated arrays need nothing, and one no mesh axis divides is left to XLA.
  assert gather_together(xs, [P(), P()], mesh) == xs
  out = gather_together(xs, [P(None), P("data")], mesh)
  assert out[0] is xs[0] and out[1] is xs[1]


def test_with_packed_gather_gathers_zero1_updates_and_keeps_the_state():
  mesh = mesh_of((8,), ("data",))
  zero1 = mo.MeshLayout(mesh, params="replicated")
  params = {"b": jnp.ones(16), "ln": jnp.ones(32), "w": jnp.ones((8, 4))}
  grads = jax.tree.map(lambda p: jnp.linspace(-1, 1, p.size).reshape(p.shape), params)
  inner = optax.adam(1e-2)
  tx = with_packed_gather(inner, zero1)
  state_sharding = mo.state_shardings(tx, params, mesh)
  state = jax.jit(tx.init, out_shardings=state_sharding)(params)
  update = jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  want, want_state = inner.update(grads, inner.init(params), params)
  for path in params:
    np.testing.assert_allclose(updates[path], want[path], rtol=1e-6)
    assert updates[path].sharding.is_fully_replicated
  assert jax.tree.structure(new_state) == jax.tree.structure(want_state)
  stats = collective_stats(update.lower(grads, state, params).compile().as_text())
  assert stats["all-gather"][0] == 1


def test_without_replicated_params_it_is_the_inner_transform():
  mesh = mesh_of((8,), ("data",))
  inner = optax.adam(1e-2)
  assert with_packed_gather(inner, mo.MeshLayout(mesh, params="sharded")) is inner


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_packed_gather_matches_single_device(layout):
  mesh, params = mesh_of((8,), ("data",)), small_tree()
  pshard = param_shardings(params, mesh, layout)
  # muon(mesh=...) wraps its AdamW branch in with_packed_gather.
  tx = lambda mesh=None: mo.muon(0.05, weight_decay=0.01, mesh=mesh,
                                 adam=mo.AuxAdam(1e-2, backend="optax"))
  want_p, want_s = run_steps(tx(), params, 5)
  got_p, got_s = run_steps(tx(placed(mesh, layout)), params, 5, (mesh, pshard))
  assert_trees_close(got_p, want_p, rtol=0, atol=1e-5)
  # The state is the AdamW transform's own: same structure as without a mesh.
  plain = mo.muon(0.05, adam=mo.AuxAdam(1e-2, backend="optax")).init(params)
  assert jax.tree.structure(got_s) == jax.tree.structure(plain)
  assert_trees_close(got_s, want_s, rtol=0, atol=1e-5)


def test_packed_gather_gathers_every_adam_update_at_once():
  # Biases and norms of 2 GPT-2 blocks: ZeRO-1 gathers each AdamW update on its own,
  # unless with_packed_gather packs them.
  params, mesh, d = gpt2_small_tree(layers=2, d=128), mesh_of((8,), ("data",)), 128
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  small = {k: {"qkv_bias": s(3 * d), "fc_bias": s(4 * d), "ln": {"scale": s(d), "bias": s(d)}}
           for k in params}
  count = lambda tx, tree: sum(c for c, _ in collective_stats(
      compiled_update(tx, tree, mesh, "zero1").as_text()).values())
  adam = mo.AuxAdam(backend="optax").transform()
  assert count(adam, small) >= 8
  assert count(with_packed_gather(adam, placed(mesh, "zero1")), small) == 1
  muon = mo.muon(0.02, mesh=placed(mesh, "zero1"), adam=mo.AuxAdam(backend="optax"))
  without = count(muon, params)
  for name, block in params.items():
    block.update(small[name])
  # All of their AdamW updates cost one packed gather more than none.
  assert count(muon, params) == without + 1
