"""The jaxpr walk alone: what each use of a parameter leaf is, which axes it holds
through layout ops, which leaves end a computation, and which products are only ever cut
into equal blocks. `infer_routing` builds its decisions on these (test_routing_trace*)."""

import jax
import jax.numpy as jnp
import pytest

from muon_optax._routing.jaxpr_uses import Track, Walker, _reshape
from muon_optax._routing.matrix_view import MatrixView


def walked(f, params: list, *args):
  """(walker, the leaves each output ends with) for `f(params, *args)`."""
  closed = jax.make_jaxpr(f)(params, *args)
  shapes = [tuple(p.shape) for p in params]
  walker = Walker(shapes)
  tracks = [Track(i, tuple((a,) for a in range(len(s))), frozenset()) for i, s in enumerate(shapes)]
  extra = len(closed.jaxpr.invars) - len(params)
  _, lasts = walker.walk(closed.jaxpr, tracks + [None] * extra,
                         [frozenset()] * len(closed.jaxpr.invars))
  return walker, lasts


def uses(walker, leaf):
  return [(u.kind, u.view) for u in walker.uses[leaf]]


def test_reshape_maps_merged_and_split_axes_to_their_leaf_axes():
  # (2, 3, 4) -> (6, 4): dims 0 and 1 merge; -> (2, 3, 2, 2): the last splits in two.
  assert _reshape((2, 3, 4), (6, 4), ((0,), (1,), (2,))) == (((0, 1), (2,)), set())
  assert _reshape((2, 3, 4), (2, 3, 2, 2), ((0,), (1,), (2,))) == (
      ((0,), (1,), (2,), (2,)), set())
  # A size-1 dim is indexed away.
  assert _reshape((1, 8), (8,), ((0,), (1,))) == (((1,),), {0})


@pytest.mark.parametrize("f, view", [
    (lambda p, x: x @ p[0], MatrixView((), (0,), (1,))),
    (lambda p, x: x @ p[0].T.T, MatrixView((), (0,), (1,))),  # layout ops keep the axes
    (lambda p, x: (p[0].T @ x.T).T, MatrixView((), (0,), (1,))),  # W on the left of a product
])
def test_a_product_is_a_dot_use_with_its_fan_in_and_fan_out(f, view):
  walker, _ = walked(f, [jnp.ones((8, 16))], jnp.ones((4, 8)))
  assert uses(walker, 0) == [("dot", view)]


def test_a_transposed_kernel_swaps_fan_in_and_fan_out():
  walker, _ = walked(lambda p, x: x @ p[0].T, [jnp.ones((16, 8))], jnp.ones((4, 8)))
  assert uses(walker, 0) == [("dot", MatrixView((), (1,), (0,)))]


def test_a_stack_indexed_in_a_scan_is_a_batch_of_matrices():
  def f(p, x):
    return jax.lax.scan(lambda h, w: (h @ w, None), x, p[0])[0]
  walker, _ = walked(f, [jnp.ones((3, 8, 8))], jnp.ones((2, 8)))
  assert uses(walker, 0) == [("dot", MatrixView((0,), (1,), (2,)))]


def test_an_einsum_over_experts_keeps_the_expert_axis_as_batch():
  f = lambda p, x: jnp.einsum("ebd,edf->ebf", x, p[0])
  walker, _ = walked(f, [jnp.ones((4, 8, 16))], jnp.ones((4, 2, 8)))
  assert uses(walker, 0) == [("dot", MatrixView((0,), (1,), (2,)))]


@pytest.mark.parametrize("f, kind", [
    (lambda p, ids: p[0][ids], "gather"),  # an embedding lookup
    (lambda p, x: x * p[0], "elementwise"),  # a norm scale or a bias
])
def test_lookups_and_elementwise_uses_are_not_products(f, kind):
  walker, _ = walked(f, [jnp.ones((8, 4))], jnp.zeros(3, int) if kind == "gather"
                     else jnp.ones((8, 4)))
  assert [k for k, _ in uses(walker, 0)] == [kind]


def test_a_conv_kernel_flattens_its_window_into_the_fan_in():
  def f(p, x):
    return jax.lax.conv_general_dilated(x, p[0], (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
  walker, _ = walked(f, [jnp.ones((3, 3, 4, 8))], jnp.ones((1, 5, 5, 4)))
  assert uses(walker, 0) == [("conv", MatrixView((), (0, 1, 2), (3,)))]


def test_the_last_product_before_an_output_is_its_head():
  f = lambda p, x: jnp.tanh(x @ p[0]) @ p[1] + 1.0
  walker, lasts = walked(f, [jnp.ones((8, 8)), jnp.ones((8, 5))], jnp.ones((2, 8)))
  assert lasts == [frozenset({1})]
  assert walker.fed == {0}  # the first product reaches the second


@pytest.mark.parametrize("cut, blocks", [
    (lambda y: jnp.split(y, 3, axis=-1), 3),
    (lambda y: [y[:, :8], y[:, 8:16], y[:, 16:]], 3),  # static slices that tile it
    (lambda y: list(y.reshape(2, 3, 8).transpose(1, 0, 2)), 3),  # reshape, then index
    (lambda y: [y[:, :8], y[:, 8:]], 1),  # unequal parts
    (lambda y: [y[:, :8], y[:, 16:]], 1),  # a gap: not a tiling
    (lambda y: [*jnp.split(y, 3, axis=-1), y], 1),  # also used whole
    (lambda y: jnp.split(y, 2, axis=0), 1),  # cut along the batch, not the fan-out
])
def test_a_product_only_ever_cut_into_equal_blocks_makes_them_matrices(cut, blocks):
  def f(p, x):
    return sum(jnp.sum(part) for part in cut(x @ p[0] + p[1]))
  walker, _ = walked(f, [jnp.ones((8, 24)), jnp.zeros(24)], jnp.ones((2, 8)))
  assert walker.blocks(0) == blocks
