"""Data-parallel layout of the optimizer state (ZeRO-1 / FSDP) on a jax.sharding mesh."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax import _paths


def check_data_axis(mesh: Mesh, data_axis: str) -> None:
  if data_axis not in mesh.axis_names:
    raise ValueError(
        f"data axis {data_axis!r} is not an axis of the mesh {dict(mesh.shape)}; pass "
        "data_axis= one of its axis names.")


def _param_specs(params: Any, mesh: Mesh) -> dict[str, P]:
  """PartitionSpec of every param that carries a NamedSharding on `mesh`, by path."""
  specs = {}
  for path, leaf in _paths.leaves_with_path(params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      if sharding.mesh.shape != mesh.shape or sharding.mesh.axis_names != mesh.axis_names:
        raise ValueError(
            f"parameter {path!r} is sharded on mesh {dict(sharding.mesh.shape)}, not on the "
            f"given mesh {dict(mesh.shape)}; pass the mesh the params live on.")
      specs[path] = sharding.spec
  return specs


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry: None, an axis name or a tuple of names."""
  return entry if isinstance(entry, tuple) else () if entry is None else (entry,)


def _spec_axes(spec: P) -> set[str]:
  return {axis for entry in spec for axis in spec_axes(entry)}


def mirrored_param(path: str, shape: tuple[int, ...], param_shapes: Mapping[str, tuple[int, ...]]
                   ) -> Optional[str]:
  """The parameter that the state leaf at `path` mirrors, or None.

  A state leaf mirrors a parameter (momentum, Adam moments) when a suffix of its '/'-joined
  path names a parameter of the same shape; the longest such suffix wins, so
  `.../mu/blocks/0/kernel` mirrors `blocks/0/kernel`, not a parameter named `0/kernel`.
  """
  parts = path.split("/")
  for k in range(len(parts)):
    suffix = "/".join(parts[k:])
    if suffix in param_shapes and tuple(param_shapes[suffix]) == tuple(shape):
      return suffix
  return None


def _add_data_axis(shape: tuple[int, ...], spec: P, mesh: Mesh, data_axis: str) -> P:
  """`spec` with the data axis added on the largest free dimension it divides.

  A leaf with no such dimension (scalars, counters, odd-sized vectors) stays
  replicated over the data axis: it is small, and padding it would change its shape.
  """
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if data_axis in _spec_axes(spec):
    return P(*entries)
  size = mesh.shape[data_axis]
  free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % size == 0]
  if free:
    entries[max(free, key=lambda d: (shape[d], -d))] = data_axis
  return P(*entries)


def state_shardings(tx: optax.GradientTransformation, params: Any, mesh: Mesh,
                    data_axis: str = "data") -> Any:
  """NamedSharding of every leaf of `tx.init(params)`, partitioned along `data_axis`.

  - A state leaf that mirrors a parameter (same path suffix and shape: momentum,
    Adam moments) starts from that parameter's spec, so FSDP-sharded params keep
    their state beside them; if the spec lacks the data axis (ZeRO-1: replicated
    params, or params sharded only over other axes), the data axis is added on the
    largest dimension it divides.
  - Any other leaf (flat buffers, counts) gets the data axis the same way.
  - Leaves with no dimension divisible by the data-axis size stay replicated.

  Args:
    tx: the optimizer.
    params: params or `jax.ShapeDtypeStruct`s; a `NamedSharding` on them is followed.
    mesh: the device mesh.
    data_axis: name of the data-parallel axis of `mesh`.

  Returns:
    A pytree of `NamedSharding` with the structure of `tx.init(params)`.

  Example:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = mo.muon(0.02, mesh=mesh)
    >>> shardings = mo.state_shardings(tx, params, mesh)
    >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
  """
  check_data_axis(mesh, data_axis)
  param_specs = _param_specs(params, mesh)
  param_shapes = {p: tuple(np.shape(x)) for p, x in _paths.leaves_with_path(params)}
  abstract = jax.eval_shape(tx.init, params)

  def sharding(path: str, leaf: Any) -> NamedSharding:
    shape = tuple(leaf.shape)
    param = mirrored_param(path, shape, param_shapes)
    spec = P() if param is None else param_specs.get(param, P())
    return NamedSharding(mesh, _add_data_axis(shape, spec, mesh, data_axis))

  return _paths.map_with_path(sharding, abstract)


def fsdp_shardings(params: Any, mesh: Mesh, data_axis: str = "data") -> Any:
  """FSDP / ZeRO-3 layout of `params`: each leaf split along `data_axis` on its largest
  dimension that the axis size divides; leaves with none stay replicated.

  Example:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> shardings = mo.fsdp_shardings(params, mesh)
    >>> params = jax.device_put(params, shardings)
  """
  check_data_axis(mesh, data_axis)
  return _paths.map_with_path(
      lambda path, x: NamedSharding(mesh, _add_data_axis(tuple(np.shape(x)), P(), mesh, data_axis)),
      params)
