"""The layouts the state takes and the matrix stacks read from them."""

import jax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_case import mesh_of, optimizer, small_tree

import muon_optax as mo
from muon_optax._placement.shardings import data_spec, divided_axis, stack_spec


def test_the_data_axes_split_the_largest_axis_they_divide_last_of_equals():
  assert divided_axis((64, 256), 8) == 1
  assert divided_axis((256, 64), 8) == 0
  assert divided_axis((2, 16, 16), 8) == 2  # equals: the last (a square kernel's columns)
  assert divided_axis((16, 16, 2), 8) == 1
  assert divided_axis((6, 10), 4) is None
  assert divided_axis((6, 10), 4, free=[1]) is None
  assert divided_axis((8, 16), 8, free=[0]) == 0


def test_data_spec_puts_the_data_axis_there():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  assert data_spec((64, 256), mesh, ("data",)) == P(None, "data")
  assert data_spec((256, 64), mesh, ("data",)) == P("data")
  assert data_spec((6, 10), mesh, ("data",)) == P()  # small and odd: replicated
  # On Explicit axes, one entry per dimension: the form a jitted update returns.
  explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  assert tuple(data_spec((256, 64), explicit, ("data",))) == ("data", None)


def test_a_stack_keeps_a_split_that_leads_its_group():
  # (layers, in, out) with `in` split: the stack's rows keep it.
  assert stack_spec(P(None, "data"), ((0,), (1,), (2,)), False) == P(None, "data", None)
  # A conv kernel (h, w, in, out) split on `in`: not the group's first axis, so whole.
  assert stack_spec(P(None, None, "data"), ((), (0, 1, 2), (3,)), False) == P(None, None, None)
  # Turned wide: rows and columns swap.
  assert stack_spec(P("data"), ((), (0,), (1,)), True) == P(None, None, "data")


def test_state_bytes_per_device_are_an_eighth():
  mesh, params = mesh_of(), small_tree()
  tx = optimizer(mesh)
  rep = jax.device_put(params, NamedSharding(mesh, P()))
  state = jax.jit(tx.init, out_shardings=mo.state_shardings(tx, rep, mesh))(rep)
  leaves = jax.tree.leaves(state)
  total = sum(x.nbytes for x in leaves)
  replicated = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
  per_device = max(sum(s.data.nbytes for x in leaves for s in x.addressable_shards
                       if s.device == d) for d in mesh.devices.flat)
  assert replicated < 0.01 * total  # only counts and odd-sized leaves
  assert per_device <= 1.02 * total / 8 + replicated


def test_bad_mesh_inputs_are_clear_errors():
  mesh, params = mesh_of(), small_tree()
  with pytest.raises(ValueError, match="data axis 'batch' is not an axis"):
    mo.state_shardings(optimizer(mesh), params, mesh, data_axis="batch")
  other = mesh_of((4,))
  placed = jax.device_put(params, NamedSharding(other, P()))
  with pytest.raises(ValueError, match="parameter 'blocks/fc/bias' is sharded on mesh"):
    mo.state_shardings(optimizer(mesh), placed, mesh)
