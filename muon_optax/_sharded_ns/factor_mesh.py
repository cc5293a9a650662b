"""The mesh cut into prime factors: groups of consecutive devices as named axes."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz.row_blocks import RowBlocks
from muon_optax._placement.shardings import spec_axes
from muon_optax._sharded_ns.rounds import group_sizes, prime_factors
from muon_optax._sharded_ns.split_cost import apply_chunks
from muon_optax._util.order import after

# The collectives of a matrix shared by a group of devices (its Gram sums and the whole
# m×m matrices it gathers) are traced in this named scope, so that a compiled program's
# collectives can be told apart from the exchange's.
SHARED_MATRIX_SCOPE = "shared_matrix"


def _in_shared_scope(fn):
  def scoped(*args):
    with jax.named_scope(SHARED_MATRIX_SCOPE):
      return fn(*args)
  return scoped


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
    with jax.named_scope(SHARED_MATRIX_SCOPE):
      return jax.lax.pmax(x, axes) if op is jnp.maximum else jax.lax.psum(x, axes)

  def row_blocks(self, g: int, product_chunks: int = 1) -> RowBlocks:
    """The m×m matrices of a matrix shared by g devices, one block of rows on each
    (see `newton_schulz_column_parts`): Gram sums reduce-scattered, whole matrices
    all-gathered, both over the group; their products formed `most_product_chunks` chunks
    at a time (1: whole; `exchange_schedule.units` says where chunks are needed)."""
    group = _GroupRows(self.group_axes(g), g, product_chunks, dict(self.mesh.shape))
    return RowBlocks(*map(_in_shared_scope, (group.summed, group.gather, group.rows,
                                             group.transposed, group.times, group.applied,
                                             group.gram)))


class _GroupRows(NamedTuple):
  """The `RowBlocks` of a group of g devices over the factor axes `axes`: each holds one
  block of rows of every m×m matrix; products are formed `chunks` chunks at a time."""

  axes: tuple[str, ...]
  g: int
  chunks: int
  sizes: dict

  def rows(self, x):
    h, axis = x.shape[-2] // self.g, x.ndim - 2
    index = linear_index(self.axes, self.sizes)
    return jax.lax.dynamic_slice_in_dim(x, index * h, h, axis=axis)

  def transposed(self, x):
    """Column block k of every device's rows: its rows of the transpose."""
    cols = jax.lax.all_to_all(x, self.axes, x.ndim - 1, x.ndim - 2, tiled=True)
    return jnp.swapaxes(cols, -1, -2)

  def gather(self, x):
    """Along a new major axis: no relayout copy when the batch is one matrix."""
    blocks = jnp.moveaxis(jax.lax.all_gather(x, self.axes, axis=0), 0, -3)
    return blocks.reshape(*x.shape[:-2], -1, x.shape[-1])

  def summed(self, x):
    return jax.lax.psum_scatter(x, self.axes, scatter_dimension=x.ndim - 2, tiled=True)

  def times(self, a, b, mm):
    """a's rows of A B, B's whole columns gathered one chunk at a time, each once the
    last chunk's product is done (the first once A is): so that only one is live, and
    a second product with the same B gathers its own instead of keeping these."""
    k = math.gcd(self.chunks, b.shape[-1])
    b = mm.operand(b)  # gathered as the product reads it
    if k == 1:  # B gathered whole: products with the same B share it
      return mm(a, self.gather(b))
    width, out = b.shape[-1] // k, []
    for c in range(k):
      chunk = b[..., c * width:(c + 1) * width]
      out.append(mm(a, self.gather(after(chunk, out[-1:] or [a]))))
    return jnp.concatenate(out, axis=-1)

  def applied(self, a, x, mm):
    """Rows of M X a few at a time: chunk c gathers sub-block c of every part's rows of
    M, and gives those rows of the result; each once the last chunk's is done. The
    chunks are then put together in a new X-sized array, once X (usually read last
    here) is gone. Only where the whole M is larger than X's part (`apply_chunks`);
    else M is gathered whole."""
    batch, (h, n) = x.shape[:-2], (a.shape[-2], x.shape[-1])
    k = apply_chunks(a.shape[-1], n, self.g, jnp.dtype(mm.operands).itemsize,
                     x.dtype.itemsize, self.chunks)
    a = mm.operand(a)  # gathered as the product reads it
    if k == 1:
      return mm(self.gather(a), x)
    sub, out = a.reshape(*batch, k, h // k, a.shape[-1]), []
    for c in range(k):
      out.append(mm(self.gather(after(sub[..., c, :, :], out[-1:])), x))
    out = jnp.stack([y.reshape(*batch, self.g, h // k, n) for y in out], axis=-3)
    return out.reshape(*batch, self.g * h, n)

  def gram(self, x, mm, peak=None):
    """Rows of X Xᵀ summed a few at a time: chunk c holds rows c of every part's rows
    (sub-block c of each of the g row blocks), so that its reduce-scatter hands each
    part its own rows c; each once the last chunk's sum is done. A compiler may copy a
    product's right operand into the layout it reads (XLA's CPU backend does): chunk Xᵀ
    copies all of X, the transpose of X chunkᵀ copies the chunk and the product
    instead, which is less where X's part is wider than m / (k - 1)."""
    batch, (m, n), g = x.shape[:-2], x.shape[-2:], self.g
    k = math.gcd(self.chunks, m // g)
    sub, out = x.reshape(*batch, g, k, m // g // k, n), []
    swapped = lambda v: jnp.swapaxes(v, -1, -2)
    for c in range(k):
      chunk = after(sub[..., c, :, :].reshape(*batch, m // k, n), out[-1:])
      chunk = chunk if peak is None else chunk / peak / peak  # see `gram_rows`
      rows = swapped(mm(x, swapped(chunk))) if n * (k - 1) > m else mm(chunk, swapped(x))
      out.append(self.summed(rows))
    return jnp.concatenate(out, axis=-2)
