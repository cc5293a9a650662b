"""orthogonalize: any Newton–Schulz function plugs in through NewtonSchulz(fn=...)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo


def svd_polar(x):
  """The exact polar factor U Vᵀ of each matrix of a stack, in jax."""
  u, _, vt = jnp.linalg.svd(x, full_matrices=False)
  return u @ vt


def tree():
  ks = jax.random.split(jax.random.key(0), 4)
  return {"a": {"kernel": jax.random.normal(ks[0], (16, 24))},
          "b": {"kernel": jax.random.normal(ks[1], (24, 16))},  # transposed: same group
          "c": {"kernel": jax.random.normal(ks[2], (2, 16, 40))},  # a stack
          "d": {"kernel": jax.random.normal(ks[3], (8, 8))}}


def test_custom_ns_fn_matches_a_per_leaf_reference():
  calls = []

  def ns_fn(x):
    calls.append(x.shape)
    assert x.ndim == 3 and x.shape[1] <= x.shape[2]  # a stack of wide matrices
    return svd_polar(x)

  g = tree()
  tx = mo.orthogonalize(mo.NewtonSchulz(fn=ns_fn))
  out, state = jax.jit(tx.update)(g, tx.init(g))
  assert state == optax.EmptyState()
  assert sorted(calls) == [(1, 8, 8), (2, 16, 24), (2, 16, 40)]  # one call per shape group
  for name, leaf in g.items():
    x = np.asarray(leaf["kernel"], np.float64).reshape(-1, *leaf["kernel"].shape[-2:])
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    expected = (u @ vt).reshape(leaf["kernel"].shape)
    # float32 SVD against float64: both are the polar factor, up to float32 rounding
    # amplified by the conditioning of these Gaussian matrices (σ_min ≥ ~0.05·σ_max).
    s = np.linalg.svd(x, compute_uv=False)
    tol = 100 * np.finfo(np.float32).eps * (s.max() / s.min())
    got = np.asarray(out[name]["kernel"], np.float64)
    assert np.linalg.norm(got - expected) <= tol * np.linalg.norm(expected), name


def test_ns_fn_reaches_scale_by_muon_through_the_built_in_path():
  # The built-in iteration is one ns_fn among others: passing it explicitly is the same.
  g = tree()
  jordan = mo.NewtonSchulz("jordan", steps=5)
  plugged = mo.orthogonalize(mo.NewtonSchulz(fn=lambda x: mo.newton_schulz(x, jordan)))
  built_in = mo.orthogonalize(jordan)
  a, _ = plugged.update(g, plugged.init(g))
  b, _ = built_in.update(g, built_in.init(g))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kwargs", [dict(coeffs="jordan"), dict(steps=3), dict(gram=True),
                                    dict(compute_dtype="bfloat16"), dict(precondition="aol"),
                                    dict(precision="highest")])
def test_fn_with_built_in_options_is_a_clear_error(kwargs):
  with pytest.raises(ValueError, match=f"fn replaces the built-in iteration, so \\['{list(kwargs)[0]}'\\]"):
    mo.NewtonSchulz(fn=svd_polar, **kwargs)


def test_a_custom_fn_is_described_and_runs_in_newton_schulz():
  custom = mo.NewtonSchulz(fn=svd_polar)
  x = jax.random.normal(jax.random.key(1), (3, 24, 16))  # tall: fn sees it wide
  np.testing.assert_allclose(mo.newton_schulz(x, custom), svd_polar(x), atol=1e-5)
  table = mo.describe({"w": x}, ns=custom)
  assert "custom" in table and "a custom function" in table
  assert mo.newton_schulz_cost({"w": x}, ns=custom) == 0


def test_bad_settings_are_clear_errors_where_ns_is_taken():
  for make in (mo.orthogonalize, lambda ns: mo.scale_by_muon(ns=ns), lambda ns: mo.muon(ns=ns),
               lambda ns: mo.newton_schulz(jnp.ones((2, 2)), ns),
               lambda ns: mo.newton_schulz_plan((2, 2), ns)):
    with pytest.raises(ValueError, match="unknown Newton–Schulz preset 'fast'"):
      make("fast")
    with pytest.raises(ValueError, match=r"NewtonSchulz\(fn=...\)"):
      make(svd_polar)


def test_mesh_plan_reports_the_rounds_and_flops_a_mesh_runs():
  # 12 matrices 64×256 on 8 devices: a round of 8 whole, then 4 left. Priced at a TPU's
  # traffic they stay whole (a split's collectives cost more than it saves): 2 whole
  # matrices' flops on the busiest device. With traffic free they are split over pairs,
  # whose m×m products are split by rows too: half a matrix each, the ideal.
  params = {f"l{i}": {"kernel": jnp.ones((256, 64))} for i in range(12)}  # tall: as 64×256
  whole = mo.newton_schulz_plan((64, 256)).flops
  plan = mo.mesh_plan(params, 8)
  assert plan.rounds == ((64, 256, 1), (64, 256, 1))
  assert plan.flops_per_device == 2 * whole and plan.ideal_flops_per_device == 12 * whole / 8
  free = mo.mesh_plan(params, 8, flops_per_byte=0)
  assert free.rounds == ((64, 256, 1), (64, 256, 2))
  assert free.flops_per_device == whole + whole // 2 == free.ideal_flops_per_device
  # A memory cap of a tenth of the state shard splits every matrix, over 8 devices.
  capped = mo.mesh_plan(params, 8, memory=0.1)
  assert {split for *_, split in capped.rounds} == {8}
  # Non-Muon leaves (a bias) and the routing's views are read as `muon` reads them.
  assert mo.mesh_plan({**params, "b": jnp.ones(64)}, 8) == plan


def mesh_update_flops(mesh, shape=(8, 512, 1024)):
  """Per-device compiled flops of orthogonalizing an FSDP-split stack of `shape` over
  the 8 devices of `mesh`: one whole matrix each."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, None, "data")))
  tx = mo.orthogonalize(mesh=mo.MeshLayout(mesh, params="sharded"))
  lowered = jax.jit(lambda u: tx.update({"w": u}, optax.EmptyState(), {"w": u})[0]).lower(x)
  return lowered.compile().cost_analysis()["flops"]


def test_a_mesh_forms_its_products_whole():
  # Each round of a mesh is its own Newton–Schulz call: block rows there would multiply
  # the compile time (benchmarks/results/mesh_products.txt).
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  ns = mo.NewtonSchulz().on("cpu")
  symmetric = mo.newton_schulz_plan((512, 1024), ns, backend="cpu").flops
  whole = mo.newton_schulz_plan((512, 1024), ns, backend="cpu", symmetric=False).flops
  assert symmetric < 0.9 * whole
  # The compiled count adds the elementwise work, a few flops an element per step.
  assert whole <= mesh_update_flops(mesh) <= 1.02 * whole
