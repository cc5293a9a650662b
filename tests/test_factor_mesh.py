"""The factor mesh: every mesh axis cut into its primes, in the same device order, so
that groups of consecutive devices are trailing axes collectives can name."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz.operands import Matmul
from muon_optax._placement.shardings import shard_mapped
from muon_optax._sharded_ns.factor_mesh import FactorMesh
from muon_optax._sharded_ns.split_cost import PRODUCT_CHUNKS


@pytest.mark.parametrize("shape, axes, groups", [
    ((8,), ("data",), (2, 4, 8)),
    ((4, 2), ("data", "model"), (2, 4, 8)),
    ((12,), ("data",), (2, 4, 12)),  # 12 = 3 · 2 · 2: the 2s last
])
def test_factor_mesh_keeps_device_order_and_names_groups(shape, axes, groups):
  devices = np.asarray(jax.devices()[:1] * math.prod(shape), dtype=object)
  mesh = jax.sharding.Mesh(devices.reshape(shape), axes)
  factors = FactorMesh.of(mesh)
  assert factors.groups() == groups
  assert math.prod(factors.mesh.shape.values()) == math.prod(shape)
  # Consecutive devices in the mesh's row-major order differ in the trailing axes.
  for g in groups:
    names = factors.group_axes(g)
    assert math.prod(factors.mesh.shape[a] for a in names) == g
    assert names == factors.mesh.axis_names[-len(names):]
  assert factors.spec(jax.sharding.PartitionSpec(None, axes[0])) == jax.sharding.PartitionSpec(
      None, factors.factors[axes[0]])



@pytest.mark.parametrize("g", [2, 4, 8])
def test_row_blocks_of_a_group(g):
  # Each of g consecutive devices holds a block of rows of an m×m matrix: the Gram sum of
  # the group's partials, the whole matrix and the rows of its transpose, exactly (the
  # entries are small integers, so every order of summation gives the same float32).
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  factors = FactorMesh.of(mesh)
  blocks = factors.row_blocks(g)
  m = 8
  partials = jax.random.randint(jax.random.key(0), (8, 2, m, m), -4, 5).astype(jnp.float32)
  whole = jnp.arange(8 * 2 * m * m, dtype=jnp.float32).reshape(8, 2, m, m) % 7

  def body(partial, w):
    partial, w = partial[0], w[0]
    mine = blocks.rows(w)
    return (blocks.sum_rows(partial)[None], blocks.gather(mine)[None], mine[None],
            blocks.transposed(mine)[None])

  axes = factors.mesh.axis_names
  spec = P(axes)
  summed, gathered, mine, transposed = jax.jit(shard_mapped(
      body, factors.mesh, (spec, spec), (spec,) * 4))(partials, whole)
  h = m // g
  for d in range(8):
    group = range(d // g * g, d // g * g + g)
    rows = slice(d % g * h, d % g * h + h)
    np.testing.assert_array_equal(summed[d], sum(partials[k] for k in group)[:, rows])
    # Each device's rows of its own group member's matrix gathered: the member k's rows k.
    expected = jnp.concatenate([whole[k][:, k % g * h:k % g * h + h] for k in group], axis=-2)
    np.testing.assert_array_equal(gathered[d], expected)
    t = jnp.swapaxes(expected, -1, -2)
    np.testing.assert_array_equal(transposed[d], t[:, rows])


@pytest.mark.parametrize("g", [2, 4, 8])
@pytest.mark.parametrize("cols", [8, 64])  # narrow and wide parts
@pytest.mark.parametrize("chunks", [PRODUCT_CHUNKS, 1])  # formed in blocks; whole
@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_row_block_products_a_block_at_a_time(g, cols, chunks, operands):
  # The products of a shared matrix's row blocks, formed a few columns (or rows) at a
  # time or whole, equal the whole-matrix products, exactly (small-integer entries, exact
  # in 16 bits too). An m×m factor is gathered as the product reads it: in 16 bits with
  # 16-bit operands, half the bytes.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  factors = FactorMesh.of(mesh)
  blocks = factors.row_blocks(g, chunks)
  m = 32
  key_a, key_b, key_x = jax.random.split(jax.random.key(1), 3)
  a, b = (jax.random.randint(k, (m, m), -3, 4).astype(jnp.float32) for k in (key_a, key_b))
  parts = jax.random.randint(key_x, (8, m, cols), -3, 4).astype(jnp.float32)
  mm = Matmul(jnp.dtype(operands), jnp.float32, jax.lax.Precision.HIGHEST)

  def body(x):
    x, ra, rb = x[0], blocks.rows(a), blocks.rows(b)
    return (blocks.product(ra, rb, mm)[None], blocks.apply(ra, x, mm)[None],
            blocks.gram_rows(x, mm)[None], blocks.gram_rows(x, mm, jnp.float32(4))[None])

  spec = P(factors.mesh.axis_names)
  fn = jax.jit(shard_mapped(body, factors.mesh, (spec,), (spec,) * 4))
  times, applied, gram, scaled = fn(parts)
  h = m // g
  for d in range(8):
    group, rows = range(d // g * g, d // g * g + g), slice(d % g * h, d % g * h + h)
    np.testing.assert_array_equal(times[d], (a @ b)[rows])
    np.testing.assert_array_equal(applied[d], a @ parts[d])
    np.testing.assert_array_equal(gram[d], sum(parts[k] @ parts[k].T for k in group)[rows])
    # Divided by a power-of-two peak inside the sum: (X / 4)(X / 4)ᵀ, exactly.
    np.testing.assert_array_equal(scaled[d], gram[d] / 16)
  # The program as asked for (a CPU compiler widens 16-bit collectives again; TPU's and
  # GPU's move them as they are).
  mlir = {"float32": "f32", "bfloat16": "bf16"}
  gathers = [line for line in fn.lower(parts).as_text().splitlines() if "all_gather" in line]
  assert gathers and all(mlir[operands] in line for line in gathers)
  assert not any(mlir[other] in line for line in gathers for other in mlir if other != operands)
