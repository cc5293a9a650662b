"""Fused projections split as the model splits them: infer_routing views a kernel whose
product is only ever cut into equal blocks as one matrix per block, and every part of the
family then treats each block as the separate kernel it stands for."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from family_case import EPS32, STEPS, grads_at, svd_polar
from flax import nnx

import muon_optax as mo

D = 16


def route(f, params):
  return mo.infer_routing(f, params, jnp.zeros(4, int))


def embed(p, ids):
  return p["emb"][ids]


CUTS = {
    "split": lambda y: jnp.split(y, 3, axis=-1),
    "slices": lambda y: (y[:, :D], y[:, D:2 * D], y[:, 2 * D:]),
    "reshape and index": lambda y: tuple(y.reshape(y.shape[0], 3, D)[:, i] for i in range(3)),
    "bias, then split": lambda y: jnp.split(y + 1.0, 3, axis=-1),
}


@pytest.mark.parametrize("cut", CUTS)
def test_a_product_cut_into_equal_blocks_is_one_matrix_per_block(cut):
  params = {"emb": jnp.ones((10, D)), "qkv": jnp.ones((D, 3 * D)), "head": jnp.ones((D, 10))}

  def f(p, ids):
    q, k, v = CUTS[cut](embed(p, ids) @ p["qkv"])
    return (jax.nn.softmax(q @ k.T) @ v) @ p["head"]

  routing = route(f, params)
  assert routing.view("qkv", (D, 3 * D)) == mo.MatrixView((), (0,), (1,), blocks=3)
  assert "split into 3 × 16×16" in mo.describe(params, routing=routing)


def test_a_view_given_in_place_of_the_blocks_is_the_one_described():
  """views= keeping a fused kernel whole: the table's view and its why both say so."""
  params = {"emb": jnp.ones((10, D)), "qkv": jnp.ones((D, 3 * D)), "head": jnp.ones((D, 10))}

  def f(p, ids):
    q, k, v = jnp.split(embed(p, ids) @ p["qkv"], 3, axis=-1)
    return (jax.nn.softmax(q @ k.T) @ v) @ p["head"]

  whole = lambda path, shape: mo.MatrixView((), (0,), (1,)) if path == "qkv" else None
  routing = mo.infer_routing(f, params, jnp.zeros(4, int), views=whole)
  [row] = [line for line in mo.describe(params, routing=routing).splitlines()
           if line.startswith("qkv ")]
  assert "split" not in row and row.count("16×48") == 3, row  # shape, view, why
  assert row.endswith("dot_general → 16×48 (view given)"), row


@pytest.mark.parametrize("use", ["whole too", "unequal cuts", "a part unused"])
def test_any_other_use_keeps_the_matrix_whole(use):
  params = {"emb": jnp.ones((10, D)), "w": jnp.ones((D, 2 * D)), "head": jnp.ones((D, 10))}

  def f(p, ids):
    y = embed(p, ids) @ p["w"]
    if use == "whole too":
      a, b = jnp.split(y, 2, axis=-1)
      a = a + jnp.sum(y)
    elif use == "unequal cuts":
      a, b = y[:, :D // 2] @ jnp.ones((D // 2, D)), y[:, D // 2:][:, :D]
    else:
      a = b = y[:, :D]
    return (a * b) @ p["head"]

  assert route(f, params).view("w", (D, 2 * D)).blocks == 1


def test_an_nnx_model_with_a_fused_qkv_and_gate_up():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
      self.gate_up = nnx.Linear(D, 4 * D, use_bias=False, rngs=rngs)
      self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
      q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
      x = x + jax.nn.softmax(q @ k.swapaxes(-1, -2)) @ v
      gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
      return x + self.down(jax.nn.silu(gate) * up)

  model = Block(nnx.Rngs(0))
  routing = mo.infer_routing(model, jnp.ones((2, 5, D)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  table = mo.describe(params, routing=routing)
  assert "split into 3 × 16×16" in table and "split into 2 × 16×32" in table
  assert routing.view("down/kernel", (2 * D, D)).blocks == 1


def separate_and_fused():
  """The same three kernels, as three leaves and as one fused leaf split in three."""
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (0.1 * jax.random.normal(key, (D, D)) for key in ks)
  separate = {"q": q, "k": k, "v": v}
  fused = {"qkv": jnp.concatenate([q, k, v], axis=1)}
  views = {"q": mo.MatrixView((), (0,), (1,)), "k": mo.MatrixView((), (0,), (1,)),
           "v": mo.MatrixView((), (0,), (1,)), "qkv": mo.MatrixView((), (0,), (1,), blocks=3)}
  routing = mo.Routing.from_rules([(".*", "muon")], views=lambda path, shape: views[path])
  return separate, fused, routing


def test_orthogonalize_treats_each_block_as_its_own_matrix():
  separate, fused, routing = separate_and_fused()
  tx = mo.orthogonalize(mo.NewtonSchulz(fn=svd_polar), routing=routing)
  u, _ = tx.update(fused, tx.init(fused))
  want = jnp.concatenate([svd_polar(separate[n][None])[0] for n in "qkv"], axis=1)
  np.testing.assert_allclose(u["qkv"], want, rtol=0, atol=16 * EPS32)


@pytest.mark.parametrize("make", [
    lambda r: mo.muon(0.05, routing=r), lambda r: mo.normuon(0.05, routing=r),
    lambda r: mo.adamuon(0.01, routing=r), lambda r: mo.muon(0.5, scale="adaptive", routing=r),
    lambda r: mo.nordion2(0.05, routing=r), lambda r: mo.muonh(0.05, routing=r)],
    ids=["muon", "normuon", "adamuon", "adaptive", "nordion2", "muonh"])
def test_every_member_trains_a_fused_kernel_as_the_separate_ones(make):
  separate, fused, routing = separate_and_fused()
  results = []
  for p, is_fused in ((separate, False), (fused, True)):
    tx = make(routing)
    state, update = tx.init(p), jax.jit(tx.update)
    for step in range(STEPS):
      g = grads_at(step, separate)
      g = {"qkv": jnp.concatenate([g[n] for n in "qkv"], axis=1)} if is_fused else g
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
    results.append(p)
  want = np.concatenate([np.asarray(results[0][n]) for n in "qkv"], axis=1)
  # The same float32 operations on the same matrices, in another layout.
  np.testing.assert_allclose(np.asarray(results[1]["qkv"]), want, rtol=0,
                             atol=64 * STEPS * EPS32 * np.abs(want).max())


def test_the_checkpoint_record_names_blocks_only_where_a_view_has_them():
  from muon_optax.checkpoint import _record

  _, fused, routing = separate_and_fused()
  params = {**fused, "w": jnp.ones((D, D))}
  views = lambda path, shape: mo.MatrixView((), (0,), (1,), blocks=3 if path == "qkv" else 1)
  routing = mo.Routing.from_rules([(".*", "muon")], views=views)
  state = mo.muon(routing=routing).init(params)
  record = _record.record(params, state, routing)["routing"]
  assert record["qkv"]["view"]["blocks"] == 3
  assert "blocks" not in record["w"]["view"]
