"""The params' layout by parameter path: the one a user states (`MeshLayout(mesh,
params=shardings)`, the pytree of `NamedSharding` or `PartitionSpec` they pass to
`jax.jit`), or the one concrete params showed at `init`.

An Auto mesh's traced arrays carry no layout, and `jax.shard_map` must be told one: these
are where the exchange and the packed gather read it from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._placement.shardings import spec_axes
from muon_optax._util import paths

FIX = "MeshLayout(mesh, params=<your param shardings>)"


@dataclasses.dataclass(frozen=True)
class ParamSpecs:
  """Every parameter's PartitionSpec over one mesh, by '/'-joined path."""

  specs: tuple[tuple[str, P], ...]

  @property
  def by_path(self) -> Mapping[str, P]:
    return dict(self.specs)

  def spec(self, path: str) -> P:
    """The spec of the parameter at `path`; a ValueError naming it if there is none."""
    specs = self.by_path
    if path not in specs:
      near = ", ".join(repr(p) for p in list(specs)[:3])
      raise ValueError(
          f"MeshLayout(params=...) has no layout for parameter {path!r} (it holds {near}, ...): "
          "pass the shardings of the params tree the optimizer updates, with its structure.")
    return specs[path]

  def check(self, params: Any, mesh: Mesh) -> None:
    """A ValueError naming the first parameter that has no spec, or one it cannot take."""
    for path, leaf in paths.leaves_with_path(params):
      spec = self.spec(path)
      if leaf is None or not hasattr(leaf, "shape"):
        continue
      fits_shape(path, tuple(leaf.shape), spec, mesh)


def fits_shape(path: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
  """A ValueError naming `path` if `spec` does not split `shape` evenly over `mesh`."""
  if len(spec) > len(shape):
    raise ValueError(f"MeshLayout(params=...): {spec} has more entries than parameter {path!r} "
                     f"of shape {shape} has dimensions.")
  for size, entry in zip(shape, spec):
    parts = math.prod(mesh.shape[a] for a in spec_axes(entry))
    if size % parts:
      raise ValueError(f"MeshLayout(params=...): {spec} splits dimension {size} of parameter "
                       f"{path!r} {parts} ways, unevenly; jit would refuse it too.")


def _leaf_spec(path: str, leaf: Any, mesh: Mesh) -> P:
  if isinstance(leaf, NamedSharding):
    if leaf.mesh.shape != mesh.shape or leaf.mesh.axis_names != mesh.axis_names:
      raise ValueError(f"MeshLayout(params=...): parameter {path!r} is laid out on mesh "
                       f"{dict(leaf.mesh.shape)}, not on the layout's mesh {dict(mesh.shape)}.")
    return leaf.spec
  if not isinstance(leaf, P):
    raise ValueError(
        f"MeshLayout(params=...): the leaf at {path!r} is a {type(leaf).__name__}; pass a pytree "
        "of NamedSharding or PartitionSpec with the params' structure (what you pass to "
        "jax.jit), or one of 'auto', 'sharded', 'replicated'.")
  for entry in leaf:
    for axis in spec_axes(entry):
      if axis not in mesh.axis_names:
        raise ValueError(
            f"MeshLayout(params=...): parameter {path!r} is split over {axis!r}, which is not "
            f"an axis of the mesh {dict(mesh.shape)}; resolve logical axis names to mesh axes "
            "first (flax: nn.logical_to_mesh_sharding).")
  return leaf


def param_specs(tree: Any, mesh: Mesh) -> ParamSpecs:
  """The `ParamSpecs` of a pytree of `NamedSharding` or `PartitionSpec` on `mesh`."""
  leaves = paths.leaves_with_path(tree)
  if not leaves:
    raise ValueError("MeshLayout(params=...) got a pytree with no shardings in it; pass the "
                     "params' shardings, or one of 'auto', 'sharded', 'replicated'.")
  return ParamSpecs(tuple((path, _leaf_spec(path, leaf, mesh)) for path, leaf in leaves))


def seen_specs(params: Any, mesh: Mesh) -> Optional[dict[str, P]]:
  """The specs concrete params carry on `mesh`, by path; None if any leaf is traced (under
  `jax.jit` or `jax.eval_shape`) or not laid out on `mesh`, so that nothing is half-known."""
  seen = {}
  for path, leaf in paths.leaves_with_path(params):
    sharding = getattr(leaf, "sharding", None)
    if (isinstance(leaf, jax.core.Tracer) or not isinstance(sharding, NamedSharding)
        or sharding.mesh.shape != mesh.shape or sharding.mesh.axis_names != mesh.axis_names):
      return None
    seen[path] = sharding.spec
  return seen
