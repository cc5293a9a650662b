"""`MeshLayout`: the mesh an optimizer runs on, checked when it is built."""

import math

import jax
import jax.numpy as jnp
import pytest

import muon_optax as mo


def test_mesh_layout_is_checked_when_built():
  mesh = jax.make_mesh((8,), ("data",))
  assert mo.MeshLayout(mesh).data_axis == ("data",)
  other = jax.make_mesh((4, 2), ("x", "y"))
  assert mo.MeshLayout(other).data_axis == ("x", "y")  # no "data" axis: all of them
  with pytest.raises(ValueError, match=r"MeshLayout\(params='zero1'\): choose one of"):
    mo.MeshLayout(mesh, params="zero1")
  with pytest.raises(ValueError, match="data axis 'batch' is not an axis"):
    mo.MeshLayout(mesh, data_axis="batch")
  with pytest.raises(ValueError, match=r"MeshLayout\(memory=0\) must be a positive multiple"):
    mo.MeshLayout(mesh, memory=0)
  for bad in ("2", True, float("nan")):
    with pytest.raises(ValueError, match=r"must be a positive multiple of the Muon state shard"):
      mo.MeshLayout(mesh, memory=bad)
  assert mo.MeshLayout(mesh, memory=1.5).memory == 1.5
  assert mo.MeshLayout(mesh, memory=math.inf).memory == math.inf  # no cap
  assert mo.MeshLayout(mesh).exchanges is None  # as many as memory needs
  assert mo.MeshLayout(mesh, exchanges=2).exchanges == 2
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match=r"exchanges=.* must be a positive integer, or None"):
      mo.MeshLayout(mesh, exchanges=bad)
  assert mo.MeshLayout(mesh).exchange_dtype is None  # bfloat16 where the operands are 16-bit
  assert mo.MeshLayout(mesh, exchange_dtype="float32").exchange_dtype == jnp.float32
  for bad in ("int8", "float8_e4m3fn", "fp32", 3):
    with pytest.raises(ValueError, match=r"exchange_dtype=.* must be a floating dtype of 16 bits"):
      mo.MeshLayout(mesh, exchange_dtype=bad)
  with pytest.raises(ValueError, match="mesh= takes a jax.sharding.Mesh or a muon_optax.MeshLayout"):
    mo.muon(0.02, mesh="data")



def test_a_state_leaf_lies_as_its_type_or_the_stated_layout_says():
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  shape = (16, 48)
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  stated = mo.MeshLayout(auto, params={"fc": P(None, "model")})
  leaf = jax.ShapeDtypeStruct(shape, "float32")
  # Auto axes: beside the stated column-parallel kernel, the data axis on the free rows.
  assert stated.lies(leaf, "fc") == P("data", "model")
  assert mo.MeshLayout(auto, params="replicated").lies(leaf, "fc") == P(None, "data")
  explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  typed = jax.ShapeDtypeStruct(shape, "float32", sharding=NamedSharding(explicit, P("model")))
  assert mo.MeshLayout(explicit, params={"fc": P(None, "model")}).lies(typed, "fc") == \
      P("model", None)  # the type wins
