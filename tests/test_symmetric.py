"""Symmetric products: the upper block triangle, mirrored, against the whole product
(within float32's own rounding bound), their flops against XLA's count, and the whole
iteration built on them against the SVD polar factor."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import compiled_flops, float32_bound, polar, rel, singular_values

import muon_optax as mo
from muon_optax._newton_schulz import symmetric
from muon_optax._newton_schulz.iteration import newton_schulz_whole_products
from muon_optax._newton_schulz.operands import Matmul
from muon_optax._newton_schulz.symmetric import (
  block_count,
  symmetric_flops,
  symmetric_gram,
  symmetric_product,
)

MM = Matmul(jnp.float32, jnp.float32, jax.lax.Precision.HIGHEST)
EPS32 = float(np.finfo(np.float32).eps) / 2  # unit roundoff


def rounding_bound(a, b):
  """|fl(A B) − A B| ≤ γ_k (|A| |B|) entrywise for float32 products with inner dimension
  k (γ_k = k u / (1 − k u)): two float32 evaluations differ by at most twice that."""
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  k = a.shape[-1]
  return 2 * k * EPS32 / (1 - k * EPS32) * (a @ b)


def assert_mirrored(c, blocks):
  """Blocks off the diagonal mirror each other exactly (one is the other's transpose)."""
  m = c.shape[-1]
  size = -(-m // blocks)
  off = np.arange(m)[:, None] // size != np.arange(m)[None, :] // size
  c = np.asarray(c)
  np.testing.assert_array_equal(np.where(off, c, 0), np.where(off, np.swapaxes(c, -1, -2), 0))


@pytest.mark.parametrize("shape,blocks", [((12, 40), 2), ((12, 40), 3), ((10, 7), 4),
                                          ((3, 17, 50), 5), ((9, 30), 9), ((16, 16), 1)])
def test_gram_equals_the_whole_product(shape, blocks):
  x = jax.random.normal(jax.random.key(0), shape)
  got = jax.jit(lambda x: symmetric_gram(x, MM, blocks))(x)
  whole = MM(x, jnp.swapaxes(x, -1, -2))
  bound = rounding_bound(x, np.swapaxes(x, -1, -2))
  assert got.shape == whole.shape and got.dtype == whole.dtype
  assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(whole, np.float64)) <= bound)
  assert_mirrored(got, blocks)


def test_product_of_commuting_symmetric_matrices():
  # R = X Xᵀ and polynomials in it, as the iteration multiplies them.
  x = jax.random.normal(jax.random.key(1), (2, 24, 64)) / 8
  r = MM(x, jnp.swapaxes(x, -1, -2))
  r = 0.5 * (r + jnp.swapaxes(r, -1, -2))
  p = 2.0 * jnp.eye(24) - 1.5 * r + 0.5 * MM(r, r)
  for a, b in ((r, p), (p, MM(p, r)), (r, r)):
    got = symmetric_product(a, b, MM, 4)
    bound = rounding_bound(a, b)
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(MM(a, b), np.float64))
                  <= bound)
    assert_mirrored(got, 4)


def iter_eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it (jit, scan, cond, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from iter_eqns(sub)


def tie_flops(m, k, cuts):
  """The elementwise flops of the ties that run a symmetric product's block rows one
  after another (`symmetric_product`): each later block row's rows of a and columns of
  b get a zero added, made from the last strip's first row. XLA adds a few scalar
  operations per tie (at most 8)."""
  return sum((stop - start) * k + k * (m - start) + (m - last)
             for last, start, stop in zip(cuts[:-2], cuts[1:-1], cuts[2:]))


@pytest.mark.parametrize("m,k,blocks", [(12, 40, 3), (10, 7, 3), (30, 30, 2), (30, 30, 1)])
def test_flops_equal_xlas_count(m, k, blocks):
  """XLA's count is the products' (`symmetric_flops`) plus the ties that run the block
  rows one after another (`tie_flops`)."""
  x = jnp.ones((m, k), jnp.float32)
  cuts = symmetric._cuts(m, blocks)
  ties = tie_flops(m, k, cuts)
  extra = compiled_flops(lambda x: symmetric_gram(x, MM, blocks), x) - symmetric_flops(
      m, k, blocks)
  assert ties <= extra <= ties + 8 * (len(cuts) - 2)
  # b equal blocks: (b + 1) / (2b) of the whole product.
  if m % blocks == 0:
    assert symmetric_flops(m, k, blocks) * 2 * blocks == 2 * m * m * k * (blocks + 1)


def test_block_count_follows_the_measured_threshold():
  rows = symmetric.MIN_BLOCK_ROWS
  assert block_count(2 * rows - 1) == 1  # computed whole below two blocks of rows
  assert block_count(2 * rows) == 2 and block_count(3 * rows) == 3
  assert block_count(1000 * rows) == symmetric.MAX_BLOCKS


def test_bad_inputs_are_clear_errors():
  x = jnp.ones((4, 6))
  with pytest.raises(ValueError, match="square"):
    symmetric_product(x, x, MM)
  with pytest.raises(ValueError, match="1 to 4 block rows, got 5"):
    symmetric_gram(x, MM, 5)
  with pytest.raises(ValueError, match="got 0"):
    symmetric_flops(4, 6, 0)


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 8 rows, so that the small matrices here take the symmetric path."""
  monkeypatch.setattr(symmetric, "MIN_BLOCK_ROWS", 8)


def whole_newton_schulz(x, ns, monkeypatch):
  with monkeypatch.context() as patch:
    patch.setattr(symmetric, "MIN_BLOCK_ROWS", 1 << 30)
    return jax.jit(lambda x: mo.newton_schulz(x, ns))(x)


@pytest.mark.parametrize("ns", ["turbo", "jordan", "polar_express"])
@pytest.mark.parametrize("shape,gram", [((48, 48), None), ((40, 120), None), ((120, 40), True),
                                        ((2, 32, 64), False)])
def test_iteration_against_polar_factor(small_blocks, monkeypatch, ns, shape, gram):
  settings = mo.NewtonSchulz(ns, gram=gram)
  x = jax.random.normal(jax.random.key(2), shape)
  got = jax.jit(lambda x: mo.newton_schulz(x, settings))(x)
  whole = whole_newton_schulz(x, settings, monkeypatch)
  # Both are float32 evaluations of one polynomial: within its a priori float32 bound.
  assert np.all(rel(got, whole) < 2 * float32_bound(settings))
  flat = lambda v: np.reshape(v, (-1, *shape[-2:]))
  for o, w, g in zip(flat(got), flat(whole), flat(x)):
    p = polar(g)
    assert rel(o, p) <= 1.05 * rel(w, p)  # DESIGN.md §7
    s, s_whole = singular_values(o), singular_values(w)
    tol = 4 * float32_bound(settings)
    assert s.min() >= s_whole.min() - tol and s.max() <= s_whole.max() + tol


def test_default_sizes_take_the_symmetric_path():
  # GPT-2 small's width: three block rows; compiled flops as the plan counts them.
  shape = (768, 1536)
  x = jnp.ones(shape, jnp.float32)
  plan = mo.newton_schulz_plan(shape)
  assert compiled_flops(mo.newton_schulz, x) == pytest.approx(plan.flops, rel=1e-2)
  m, n = shape
  assert plan.flops < 0.8 * (8 * m * m * n + 20 * m**3)  # the whole products' count


def test_gpus_form_every_product_whole():
  """Measured slower in block rows on an H200, so a GPU's plan and iteration use whole
  products, while the CPU's cut them all."""
  assert block_count(4096, "gpu") == 1 and block_count(4096, "cpu") == symmetric.MAX_BLOCKS
  assert block_count(4096, "cpu", of="gram_space") == symmetric.MAX_BLOCKS
  assert block_count(4096, "cpu", of="squares") == symmetric.MAX_BLOCKS  # no cap on squares
  whole = mo.newton_schulz_plan((768, 3072), "turbo", backend="gpu", symmetric=False).flops
  assert mo.newton_schulz_plan((768, 3072), "turbo", backend="gpu").flops == whole
  assert mo.newton_schulz_plan((768, 3072), "turbo", backend="cpu").flops < whole


def traced_dots(fn, *shapes):
  """The products `fn` traces on arrays of ones of these shapes (block rows each one)."""
  jaxpr = jax.make_jaxpr(fn)(*map(jnp.ones, shapes)).jaxpr
  return [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]


def whole_square_products(x, ns, m):
  """How many products of two whole m×m matrices `newton_schulz(x, ns)` traces."""
  dots = traced_dots(lambda x: mo.newton_schulz(x, ns), x.shape)
  return sum(all(v.aval.shape[-2:] == (m, m) for v in e.invars) for e in dots)


@pytest.mark.parametrize("gram,shape", [(False, (768, 768)), (False, (768, 3072)),
                                        (True, (768, 3072))])
def test_a_tpu_forms_gram_space_products_whole(gram, shape, monkeypatch):
  """On a v5p chip block rows of the Gram-space iteration's m×m products cost more HBM
  bytes than they save, those of the standard iteration save more than they cost
  (benchmarks/results/newton_schulz_symmetric.txt): the TPU's plan and the iteration
  traced on a TPU cut X Xᵀ and the standard iteration's products as the CPU's do, and
  form the Gram-space products whole (with the TPU's row floor lowered,
  `MIN_CUT_ROWS_ON`, `MIN_SQUARE_CUT_WORK_ON`, `MIN_GRAM_SPACE_X_XT_CUT_WORK_ON`, so
  that these small shapes are cut)."""
  for floor in ("MIN_CUT_ROWS_ON", "MIN_SQUARE_CUT_WORK_ON", "MIN_GRAM_SPACE_X_XT_CUT_WORK_ON"):
    monkeypatch.setitem(getattr(symmetric, floor), "tpu", 0)
  assert block_count(4096, "tpu") == symmetric.MAX_BLOCKS
  assert block_count(4096, "tpu", of="squares") == symmetric.MAX_SQUARE_BLOCKS_ON["tpu"] == 4
  assert block_count(4096, "tpu", of="gram_space") == 1
  m, _ = shape
  ns = mo.NewtonSchulz("jordan", steps=5, gram=gram).on("tpu")
  plan = mo.newton_schulz_plan(shape, ns, backend="tpu")
  assert plan.variant == ("gram" if gram else "standard")
  on_cpu = mo.newton_schulz_plan(shape, ns, backend="cpu").flops
  # Traced as on this CPU and as on a TPU: each product the TPU forms whole is a whole
  # m×m product more in its trace, and its block rows' saving less in its plan.
  x = jnp.ones(shape)
  cpu = whole_square_products(x, ns, m)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  formed_whole = whole_square_products(x, ns, m) - cpu
  # Gram space: R² each (quintic) step, and P Q, P (P R) within each segment but its first
  # step (`gram_flops`).
  in_gram_space = 5 + sum(3 * (stop - start - 1) for start, stop in plan.segments)
  assert formed_whole == (in_gram_space if gram else 0)
  saved = 2 * m**3 - symmetric_flops(m, m, backend="cpu")
  assert plan.flops == on_cpu + formed_whole * saved


def dot_count(fn, *shapes):
  """How many products `fn` traces on arrays of these shapes (its block rows)."""
  return len(traced_dots(fn, *shapes))


@pytest.mark.parametrize("shape", [(3072, 3072), (3072, 6144), (3072, 12288), (4096, 4096)])
def test_a_tpu_cuts_products_of_two_squares_in_large_steps_in_at_most_4_block_rows(
    shape, monkeypatch):
  """On a v5p chip the standard iteration ran faster by the roofline with its squares
  whole on 3072² and 3072×6144, with them cut on 3072×12288 and 4096², the last in 4
  block rows rather than 8 (benchmarks/results/newton_schulz_symmetric.txt): traced as
  on a TPU, the iteration of an m×n X cuts its products of two m×m matrices from m²n =
  4096³ on, in at most 4 block rows, its X Xᵀ in 8 (of a square X too), as its plan
  counts."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  m, n = shape
  assert symmetric.MIN_SQUARE_CUT_WORK_ON["tpu"] == 4096**3
  square_blocks = 4 if m * m * n >= 4096**3 else 1
  assert block_count(m, "tpu", of="squares", n=n) == square_blocks
  assert dot_count(lambda x: symmetric_gram(x, MM), shape) == symmetric.MAX_BLOCKS
  squares = functools.partial(symmetric_product, matmul=MM, of="squares", n=n)
  assert dot_count(lambda a: squares(a, a), (m, m)) == square_blocks
  # The standard iteration, traced as on a TPU: per step X Xᵀ in 8 block rows, the
  # square in its block rows and one product with X, as its plan counts.
  ns = mo.NewtonSchulz(gram=False).on("tpu")
  plan = mo.newton_schulz_plan(shape, ns, backend="tpu")
  assert dot_count(lambda x: mo.newton_schulz(x, ns), shape) == plan.steps * (
      symmetric.MAX_BLOCKS + square_blocks + 1)
  assert plan.flops == plan.steps * (symmetric_flops(m, n, 8) + 2 * m * m * n
                                     + symmetric_flops(m, m, square_blocks))


@pytest.mark.parametrize("shape", [(3072, 6144), (3072, 8192)])
def test_a_tpu_cuts_the_gram_space_x_xt_in_large_steps_only(shape, monkeypatch):
  """On a v5p chip the Gram-space default ran faster by the roofline with its X Xᵀ whole
  on 3072×6144, cut on 3072×8192 (benchmarks/results/newton_schulz_symmetric.txt): traced
  as on a TPU, the Gram-space iteration of an m×n X cuts its X Xᵀ (once a segment) from
  m²n = 4096³ on, in 8 block rows, as its plan counts, while the standard iteration cuts
  its X Xᵀ at both sizes."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  m, n = shape
  assert symmetric.MIN_GRAM_SPACE_X_XT_CUT_WORK_ON["tpu"] == 4096**3
  blocks = symmetric.MAX_BLOCKS if m * m * n >= 4096**3 else 1
  assert block_count(m, "tpu", of="gram_space_x_xt", n=n) == blocks
  assert block_count(m, "tpu", of="x_xt", n=n) == symmetric.MAX_BLOCKS
  assert dot_count(lambda x: symmetric_gram(x, MM, gram_space=True), shape) == blocks
  assert dot_count(lambda x: symmetric_gram(x, MM), shape) == symmetric.MAX_BLOCKS
  ns = mo.NewtonSchulz().on("tpu")
  plan = mo.newton_schulz_plan(shape, ns, backend="tpu")
  assert plan.variant == "gram"
  # X Xᵀ's block rows are the products contracting X's n columns, one X Xᵀ a segment;
  # the rest of the plan is formed whole on a TPU.
  x_xt = [e for e in traced_dots(lambda x: mo.newton_schulz(x, ns), shape)
          if e.invars[0].aval.shape[-1] == n]
  assert len(x_xt) == len(plan.segments) * blocks
  whole = mo.newton_schulz_plan(shape, ns, backend="tpu", symmetric=False).flops
  assert plan.flops - whole == len(plan.segments) * (symmetric_flops(m, n, blocks)
                                                     - 2 * m * m * n)


def test_a_tpu_forms_x_xt_whole_below_its_row_floor(monkeypatch):
  """On a v5p chip X Xᵀ of fewer than 3072 rows ran faster whole by the roofline
  (benchmarks/results/newton_schulz_symmetric.txt): the plan and the iteration traced
  on a TPU form it whole there, and cut it from the floor on."""
  floor = symmetric.MIN_CUT_ROWS_ON["tpu"]
  assert block_count(floor - 1, "tpu") == 1 and block_count(floor, "tpu") > 1
  assert block_count(floor - 1, "cpu") > 1  # the floor is the TPU's alone
  shape = (2048, 8192)
  whole = mo.newton_schulz_plan(shape, "turbo", backend="tpu", symmetric=False).flops
  assert mo.newton_schulz_plan(shape, "turbo", backend="tpu").flops == whole
  assert mo.newton_schulz_plan(shape, "turbo", backend="cpu").flops < whole
  # Traced as on a TPU with the floor above a small shape: the whole products' program.
  monkeypatch.setitem(symmetric.MIN_CUT_ROWS_ON, "tpu", 1024)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  x = jnp.ones((768, 3072), jnp.float32)
  ns = mo.NewtonSchulz("jordan", steps=5, gram=False)
  assert (compiled_flops(lambda x: mo.newton_schulz(x, ns), x)
          == compiled_flops(lambda x: newton_schulz_whole_products(x, ns), x))


@pytest.mark.parametrize("shape", [(1024, 1024), (2048, 8192)])
def test_block_rows_hold_one_strips_copies_at_a_time(shape):
  """Compiled for the CPU, the iteration with symmetric products holds at most 1.3× the
  temporaries of whole products: its block rows run one after another, each copying its
  own slices of the operands (all at once, they held 1.6× to 3.1×)."""
  from muon_optax._newton_schulz.iteration import newton_schulz
  x = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
  temp = lambda fn: jax.jit(lambda a: fn(a, mo.NewtonSchulz().on("cpu"))).lower(
      x).compile().memory_analysis().temp_size_in_bytes
  assert temp(newton_schulz) <= 1.3 * temp(newton_schulz_whole_products)
