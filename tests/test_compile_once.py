"""One compilation per configuration: a jitted step reuses step 1's executable at step 2,
on one device with host offload and on meshes with the state laid out by
`state_shardings`."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from sharded_case import param_shardings

import muon_optax as mo


def make_params():
  ks = jax.random.split(jax.random.key(0), 3)
  return {"embed": {"embedding": jax.random.normal(ks[0], (32, 16))},
          "fc": {"kernel": jax.random.normal(ks[1], (16, 64)), "bias": jnp.zeros(64)},
          "proj": {"kernel": jax.random.normal(ks[2], (64, 16))}}


def compilations(tx, params, steps=3) -> int:
  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)
  for _ in range(steps):
    params, state = step(params, state, grads)
  return step._cache_size()


OFFLOADED = {"AdamW offloaded": lambda: mo.muon(adam=mo.AuxAdam(backend="offload")),
             "Muon branch offloaded": lambda: mo.muon(offload_momentum=True),
             "normuon offloaded": lambda: mo.normuon(offload_momentum=True,
                                                     adam=mo.AuxAdam(backend="offload")),
             "standalone offload": lambda: mo.AuxAdam(backend="offload").transform()}


@pytest.mark.parametrize("name", list(OFFLOADED))
def test_offload_compiles_once_with_committed_params(name):
  params = jax.device_put(make_params(), jax.devices()[0])
  assert compilations(OFFLOADED[name](), params) == 1


@pytest.mark.parametrize("make", [mo.muon, mo.normuon, mo.AuxAdam().transform])
def test_committed_params_and_a_fresh_state_compile_once(make):
  # A fresh state's step counts are committed where the params are, as step 1 returns them.
  assert compilations(make(), jax.device_put(make_params(), jax.devices()[0])) == 1
  assert compilations(make(), make_params()) == 1  # nothing committed: nothing changes


def test_uncommitted_params_next_to_offloaded_state_are_a_warning():
  with pytest.warns(UserWarning, match=r"not committed to a device.*compile twice.*device_put"):
    mo.muon(adam=mo.AuxAdam(backend="offload")).init(make_params())


def mesh_compilations(make, types: AxisType, layout: str) -> int:
  """Compilations of a plain `jax.jit(tx.update)` over 3 steps on 8 devices, the state
  laid out by `state_shardings` (as the docs write it)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(types,))
  params = make_params()
  shardings = param_shardings(params, mesh, layout)
  params = jax.device_put(params, shardings)
  tx = make(mesh=mesh)
  state = jax.jit(tx.init, out_shardings=mo.state_shardings(tx, params, mesh))(params)
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update(params, state, params)
  return update._cache_size()


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_a_plain_jitted_update_on_eight_devices_compiles_once(types, layout):
  assert mesh_compilations(mo.muon, types, layout) == 1


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
@pytest.mark.parametrize("make", [mo.dion2, mo.nordion2])
def test_row_selection_buffers_keep_their_layout_and_compile_once(make, layout):
  # The error-feedback buffer is computed from the exchange's results: it must come
  # back laid out as the state it replaces, or step 2 sees a new input layout.
  assert mesh_compilations(make, AxisType.Auto, layout) == 1


def test_state_can_be_split_over_two_data_axes():
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  params = make_params()
  tx = mo.muon(mesh=mesh)
  shardings = mo.state_shardings(tx, params, mesh, data_axis=("data", "fsdp"))
  mu = shardings.inner_states["muon"].inner_state[0][0].mu["fc"]["kernel"]
  assert mu.spec == P(None, ("data", "fsdp"))  # 64 columns over all 8 devices
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  leaf = state.inner_states["muon"].inner_state[0][0].mu["fc"]["kernel"]
  assert {s.data.shape for s in leaf.addressable_shards} == {(16, 8)}
  fsdp = mo.fsdp_shardings(params, mesh, data_axis=("data", "fsdp"))
  assert fsdp["proj"]["kernel"].spec == P(("data", "fsdp"))
  with pytest.raises(ValueError, match="data axis 'model' is not an axis"):
    mo.state_shardings(tx, params, mesh, data_axis=("data", "model"))
