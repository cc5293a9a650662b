"""`Kernel`: one `NewtonSchulz` carried whole to a mesh, for whole matrices and column
parts alike, and priced as it runs."""

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
from muon_optax._newton_schulz.kernel import CUSTOM_FN_PRICE, Kernel


def test_a_kernel_carries_one_newton_schulz_whole():
  # The built-in iteration: whole matrices and column parts with the same settings, and
  # those settings priced. The parts, summed over two halves, give the whole result.
  ns = mo.NewtonSchulz("jordan", gram=False)
  kernel = Kernel.of(ns)
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  np.testing.assert_array_equal(kernel.whole(x), mo.newton_schulz(x, ns))
  halves = jnp.stack([x[..., :8], x[..., 8:]])  # one column part per "device"
  summed = lambda v, op: jnp.sum(v, axis=0, keepdims=True) if op is jnp.add else jnp.max(
      v, axis=0, keepdims=True)
  parts = kernel.column_parts(halves, 2, summed)
  want = mo.newton_schulz(x, ns)
  bound = 64 * np.finfo(np.float32).eps  # a few products' roundings, float32
  np.testing.assert_allclose(jnp.concatenate([parts[0], parts[1]], axis=-1), want, atol=bound)
  assert kernel.priced is ns
  assert Kernel.of(ns.on("tpu")).operands == jnp.bfloat16  # what a mesh's exchange reads
  assert Kernel.of(ns.on("cpu")).operands == jnp.float32
  # A custom function runs whole matrices only, priced as Jordan's standard quintic, its
  # operands unknown; a selection around a kernel keeps its price and operands and
  # splits nothing.
  custom = Kernel.of(mo.NewtonSchulz(fn=lambda v: v * 2))
  assert custom.column_parts is None and custom.priced == CUSTOM_FN_PRICE
  assert custom.operands is None
  wrapped = kernel.around(lambda whole: lambda v: whole(v) * 3)
  assert wrapped.column_parts is None and wrapped.priced is ns
  assert wrapped.operands == kernel.operands
  np.testing.assert_array_equal(wrapped.whole(x), 3 * mo.newton_schulz(x, ns))


def test_a_mesh_kernel_forms_its_products_whole():
  # A mesh's kernel forms every product whole, at the flops the planner prices
  # (`newton_schulz_plan(symmetric=False)`), and equals the symmetric result to float32
  # rounding; one device keeps the cheaper symmetric products.
  ns = mo.NewtonSchulz(compute_dtype="float32", gram=False)
  x = jax.random.normal(jax.random.key(0), (1, 1024, 2048))
  flops = lambda fn: jax.jit(fn).lower(x).compile().cost_analysis()["flops"]
  mesh, single = Kernel.of(ns, whole_products=True), Kernel.of(ns)
  whole = mo.newton_schulz_plan((1024, 2048), ns, backend="cpu", symmetric=False).flops
  symmetric = mo.newton_schulz_plan((1024, 2048), ns, backend="cpu").flops
  assert symmetric < 0.85 * whole
  # The compiled count adds the elementwise work, a few flops an element per step.
  assert whole <= flops(mesh.whole) <= 1.02 * whole
  assert symmetric <= flops(single.whole) <= 1.02 * symmetric
  bound = 64 * np.finfo(np.float32).eps
  np.testing.assert_allclose(mesh.whole(x), single.whole(x), atol=bound)
