"""The layouts the state takes and the matrix stacks read from them."""

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

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
