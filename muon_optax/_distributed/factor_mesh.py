"""The mesh cut into prime factors: groups of consecutive devices as named axes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._distributed.layouts import spec_axes
from muon_optax._distributed.plan import group_sizes, prime_factors


def linear_index(axes: tuple[str, ...], sizes: dict) -> jax.Array:
  index = jnp.int32(0)
  for a in axes:
    index = index * sizes[a] + jax.lax.axis_index(a)
  return index


class FactorMesh(NamedTuple):
  """The mesh's devices in the same order, each axis cut into its prime factors, largest
  first: the g consecutive devices that share a split matrix are then the devices that
  differ only in some trailing factor axes, a group collectives can name."""

  mesh: Mesh  # Auto axes, named "<axis>.<k>"
  factors: dict[str, tuple[str, ...]]  # each mesh axis -> its factor axes

  @classmethod
  def of(cls, mesh: Mesh) -> FactorMesh:
    names, sizes, factors = [], [], {}
    for axis, size in mesh.shape.items():
      primes = prime_factors(size)
      factors[axis] = tuple(f"{axis}.{k}" for k in range(len(primes)))
      names += factors[axis]
      sizes += primes
    devices = np.asarray(mesh.devices).reshape(sizes)
    return cls(Mesh(devices, tuple(names), axis_types=(AxisType.Auto,) * len(names)), factors)

  def spec(self, spec: P) -> P:
    """`spec` (over the mesh's axes) over the factor axes."""
    entry = lambda e: tuple(f for a in spec_axes(e) for f in self.factors[a]) or None
    return P(*(entry(e) for e in spec))

  def groups(self) -> tuple[int, ...]:
    """The sizes of the device groups collectives can reduce over (> 1)."""
    return group_sizes(list(self.mesh.shape.values()))

  def group_axes(self, g: int) -> tuple[str, ...]:
    """The trailing factor axes whose devices make the groups of g consecutive devices."""
    names, sizes = self.mesh.axis_names, list(self.mesh.shape.values())
    k = next(k for k in range(len(sizes)) if math.prod(sizes[k:]) == g)
    return tuple(names[k:])

  def group_reduce(self, x, op, g: int):
    """`op`-reduction (add or maximum) over the g consecutive devices sharing a matrix."""
    axes = self.group_axes(g)
    return jax.lax.pmax(x, axes) if op is jnp.maximum else jax.lax.psum(x, axes)

  def row_split(self, g: int) -> Callable[[Callable], Callable]:
    """Makes a product of m×m matrices (held whole by each of g devices) compute this
    device's block of rows and all-gather the others' (see `newton_schulz_column_parts`)."""
    axes = self.group_axes(g)

    def split(product):
      def rows(a, b):
        h, axis = a.shape[-2] // g, a.ndim - 2
        part = jax.lax.dynamic_slice_in_dim(
            a, linear_index(axes, dict(self.mesh.shape)) * h, h, axis=axis)
        return jax.lax.all_gather(product(part, b), axes, axis=axis, tiled=True)
      return rows

    return split
