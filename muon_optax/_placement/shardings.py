"""Data-parallel layout of the optimizer state (ZeRO-1 / FSDP) on a jax.sharding mesh."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._util import paths

DataAxis = Union[str, Sequence[str]]


def data_axes(mesh: Mesh, data_axis: DataAxis) -> tuple[str, ...]:
  """The data-parallel mesh axes: one name, or several (("data", "fsdp")) whose devices
  together hold one share of the state each; a ValueError naming any that is missing."""
  axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  for axis in axes:
    if axis not in mesh.axis_names:
      raise ValueError(
          f"data axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}; pass "
          "data_axis= one of its axis names (or a tuple of them).")
  if not axes or len(set(axes)) != len(axes):
    raise ValueError(f"data_axis must name one mesh axis or several distinct ones, got "
                     f"{data_axis!r}.")
  return axes


def _param_specs(params: Any, mesh: Mesh) -> dict[str, P]:
  """PartitionSpec of every param that carries a NamedSharding on `mesh`, by path."""
  specs = {}
  for path, leaf in paths.leaves_with_path(params):
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


def same_spec(a: P, b: P, ndim: int) -> bool:
  """Whether two specs lay out an array of `ndim` dimensions alike (trailing Nones aside)."""
  pad = lambda s: [spec_axes(e) for e in s] + [()] * (ndim - len(s))
  return pad(a) == pad(b)


def _spec_axes(spec: P) -> set[str]:
  return {axis for entry in spec for axis in spec_axes(entry)}


def mirrored_param(path: str, shape: tuple[int, ...], param_shapes: Mapping[str, tuple[int, ...]],
                   *, reduced: bool = False) -> Optional[str]:
  """The parameter that the state leaf at `path` mirrors, or None.

  A state leaf mirrors a parameter (momentum, Adam moments) when a suffix of its '/'-joined
  path names a parameter of the same shape; the longest such suffix wins, so
  `.../mu/blocks/0/kernel` mirrors `blocks/0/kernel`, not a parameter named `0/kernel`.
  With `reduced`, a statistic of the parameter over some axes (those axes of size 1, as
  NorMuon's per-neuron second moment) mirrors it too.
  """
  fits = lambda p: len(p) == len(shape) and all(
      s == q or (reduced and s == 1) for s, q in zip(shape, p))
  parts = path.split("/")
  for k in range(len(parts)):
    suffix = "/".join(parts[k:])
    if suffix in param_shapes and fits(tuple(param_shapes[suffix])):
      return suffix
  return None


def divided_axis(shape: tuple[int, ...], size: int,
                 free: Optional[list[int]] = None) -> Optional[int]:
  """The axis `size` devices split a leaf of `shape` along: its largest (the last of
  equals) among `free` (default all) that `size` divides; None if there is none.
  The last of equals: a square kernel (fan_in, fan_out) lies in blocks of columns, as
  every other matrix does seen wide (its longer axis), so that a column part of any
  matrix is whole blocks (`stack_shards.by_blocks`), which travel among n/g devices,
  not all n."""
  free = range(len(shape)) if free is None else free
  fits = [d for d in free if shape[d] % size == 0]
  if not fits:
    return None
  return max(fits, key=lambda d: (shape[d], d))


def add_data_axes(shape: tuple[int, ...], spec: P, mesh: Mesh, axes: tuple[str, ...]) -> P:
  """`spec` with the data axes it lacks added on the largest free dimension they divide
  together, in the form a jitted update returns its state in (one entry per dimension
  on Explicit axes, no trailing None on Auto ones), so that step 2 finds the state laid
  out as step 1 did and reuses its executable.

  A leaf with no such dimension (scalars, counters, odd-sized vectors) stays
  replicated over those axes: it is small, and padding it would change its shape.
  """
  entries = list(spec) + [None] * (len(shape) - len(spec))
  missing = tuple(a for a in axes if a not in _spec_axes(spec))
  size = int(np.prod([mesh.shape[a] for a in missing]))
  axis = divided_axis(shape, size, [d for d in range(len(shape)) if entries[d] is None])
  if missing and axis is not None:
    entries[axis] = missing[0] if len(missing) == 1 else missing
  while entries and entries[-1] is None and not is_explicit(mesh):
    entries.pop()
  return P(*entries)


def state_shardings(tx: optax.GradientTransformation, params: Any, mesh: Any,
                    data_axis: DataAxis = "data") -> Any:
  """NamedSharding of every leaf of `tx.init(params)`, partitioned along `data_axis`.

  - A state leaf that mirrors a parameter (same path suffix and shape: momentum,
    Adam moments; or the shape with some axes of size 1: a per-neuron statistic)
    starts from that parameter's spec, so FSDP-sharded params keep their state beside
    them and tensor-parallel ones keep their model axes; if the spec lacks the data
    axis (ZeRO-1: replicated params, or params sharded only over other axes), the data
    axis is added on the largest free dimension it divides.
  - Any other leaf (flat buffers, counts) gets the data axis the same way.
  - Leaves with no dimension divisible by the data-axis size stay replicated.

  This is the layout the optimizer's exchange reads its inputs in: pass the params as
  they lie, or the `MeshLayout` that states their layout.

  Args:
    tx: the optimizer.
    params: params or `jax.ShapeDtypeStruct`s; a `NamedSharding` on them is followed.
    mesh: the device mesh, or the `MeshLayout` given to the optimizer: its stated
      params layout (`MeshLayout(mesh, params=shardings)`) then lays out the params that
      carry no sharding, and its data axes are the default.
    data_axis: the data-parallel axis of `mesh`, or a tuple of axes (("data", "fsdp"))
      over whose devices together the state is split.

  Returns:
    A pytree of `NamedSharding` with the structure of `tx.init(params)`.

  Examples:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = mo.muon(0.02, mesh=mesh)
    >>> shardings = mo.state_shardings(tx, params, mesh)
    >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
  """
  stated = {}
  if not isinstance(mesh, Mesh) and hasattr(mesh, "param_spec"):  # a MeshLayout
    layout, mesh = mesh, mesh.mesh
    data_axis = layout.data_axis if data_axis == "data" else data_axis
    if hasattr(layout.params, "by_path"):
      stated = layout.params.by_path
  axes = data_axes(mesh, data_axis)
  param_specs = {**stated, **_param_specs(params, mesh)}
  param_shapes = {p: tuple(np.shape(x)) for p, x in paths.leaves_with_path(params)}
  abstract = jax.eval_shape(tx.init, params)

  def sharding(path: str, leaf: Any) -> NamedSharding:
    shape = tuple(leaf.shape)
    param = mirrored_param(path, shape, param_shapes, reduced=True)
    spec = P() if param is None else kept_spec(param_specs.get(param, P()), shape)
    return NamedSharding(mesh, add_data_axes(shape, spec, mesh, axes))

  return paths.map_with_path(sharding, abstract)


def kept_spec(spec: P, shape: tuple[int, ...]) -> P:
  """A parameter's spec for a statistic of `shape` over some of its axes: the axes it
  keeps as they are, its size-1 (reduced) axes replicated."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  return P(*(None if size == 1 else e for size, e in zip(shape, entries)))


def fsdp_shardings(params: Any, mesh: Mesh, data_axis: DataAxis = "data") -> Any:
  """FSDP / ZeRO-3 layout of `params`: each leaf split along `data_axis` on its largest
  dimension that the axis size divides (the last of equals: a square kernel's
  columns, see `divided_axis`); leaves with none stay replicated.

  Examples:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> shardings = mo.fsdp_shardings(params, mesh)
    >>> params = jax.device_put(params, shardings)
  """
  axes = data_axes(mesh, data_axis)
  return paths.map_with_path(
      lambda path, x: NamedSharding(mesh, add_data_axes(tuple(np.shape(x)), P(), mesh, axes)),
      params)


def is_explicit(mesh: Any) -> bool:
  """Whether `mesh` has Explicit axes, whose shardings are part of array types."""
  return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def explicit_spec(x: Any) -> Optional[P]:
  """x's PartitionSpec, one entry per dimension, when its type carries one (an Explicit
  mesh); None otherwise (XLA propagates layouts itself)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  if not is_explicit(getattr(sharding, "mesh", None)):
    return None
  spec = tuple(sharding.spec)
  return P(*spec, *([None] * (x.ndim - len(spec))))


def reshard_to(x: jax.Array, spec: Optional[P]) -> jax.Array:
  """x in layout `spec` on its Explicit mesh; unchanged without one. Elementwise maths
  between two arrays laid out differently on Explicit axes is a type error otherwise."""
  if spec is None or explicit_spec(x) is None or explicit_spec(x) == spec:
    return x
  return jax.sharding.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, spec))


def shard_mapped(fn, mesh: Mesh, in_specs, out_specs):
  """`fn` run on each device's blocks: a `jax.shard_map` over `mesh`, callable inside a jit
  (traced under the mesh). On an Explicit mesh the arguments are first given the types of
  `in_specs`, which shard_map requires."""
  body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

  def run(*args):
    if is_explicit(mesh):
      args = [reshard_to(x, spec) for x, spec in zip(args, in_specs)]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return body(*args)
  return run


def data_spec(shape: tuple[int, ...], mesh: Mesh, axes: tuple[str, ...]) -> P:
  """The layout `state_shardings` gives a state leaf of `shape` whose parameter is
  replicated, and `fsdp_shardings` gives a parameter: the data axes on its largest
  dimension they divide."""
  return add_data_axes(shape, P(), mesh, axes)


def split_first(batch: tuple[int, ...], specs: Sequence[P]) -> tuple[int, ...]:
  """The leaf axes `batch` (those a matrix stack flattens into its count), reordered so
  that the one a layout in `specs` splits, the first spec to split exactly one, leads:
  a stack made through them then keeps that split (`stack_spec`), where the order given
  would leave it whole and have XLA gather it (scanned experts: (layers, experts, ...)
  split on experts). The order of the count is free: each matrix is its own."""
  for spec in specs:
    split = [a for a in batch if a < len(spec) and spec[a] is not None]
    if len(split) == 1:
      return (split[0], *[a for a in batch if a != split[0]])
  return batch


def stack_spec(spec: P, groups: tuple[tuple[int, ...], ...], transposed: bool) -> P:
  """The layout of a leaf's (count, rows, cols) matrix stack, given the leaf's `spec`
  and the leaf axes that make each stack axis (`groups`: batch, fan_in, fan_out, in
  that order). A stack axis keeps the split of its first leaf axis when that is the
  only split one of the group (a reshape keeps such blocks where they are); any other
  split leaves it whole (XLA then moves the data). `transposed`: rows and cols swapped."""
  entries = list(spec) + [None] * (sum(map(len, groups)) - len(spec))
  out = []
  for group in groups:
    split = [a for a in group if entries[a] is not None]
    out.append(entries[group[0]] if group and split == [group[0]] else None)
  if transposed:
    out[1], out[2] = out[2], out[1]
  return P(*out)
