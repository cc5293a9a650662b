"""A second moment of the orthogonalized update, per output neuron (NorMuon) or per
element (AdaMuon), and the rescaling that restores the update's size after it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from muon_optax._direction import Chain, Component, Shared
from muon_optax._placement.shardings import explicit_spec, kept_spec, reshard_to
from muon_optax._routing.matrix_leaves import MatrixLeaves
from muon_optax._routing.matrix_view import MatrixView, matrix_view_of
from muon_optax._routing.value import RoutingLike, as_routing
from muon_optax._util import paths, validate

OVER = ("neurons", "elements")
RESCALE = ("norm", "rms")


class SecondMomentState(NamedTuple):
  count: jax.Array  # int32 scalar: steps taken.
  # EMA of O², float32 (float64 for float64 params): per neuron, the params' shapes with
  # the fan-in axes of their matrix view of size 1; per element, the params' shapes.
  nu: optax.Updates


def _statistic_shape(view: MatrixView, shape: tuple[int, ...], over: str) -> tuple[int, ...]:
  if over == "elements":
    return shape
  return tuple(1 if a in view.fan_in else s for a, s in enumerate(shape))


@dataclasses.dataclass(frozen=True)
class SecondMoment(Component):
  """The settings of `scale_by_second_moment`, one value, as `scale_by_muon(normalize=...)`
  takes them: NorMuon is `SecondMoment("neurons", b2=0.95, eps=1e-10, rescale="norm")`,
  AdaMuon `SecondMoment("elements", b2=0.999, eps=1e-8, rescale="rms")`. Checked when
  the transform is built.

  Examples:
    >>> import muon_optax as mo
    >>> tx = mo.scale_by_muon(normalize=mo.SecondMoment("neurons", b2=0.95))
  """

  over: str = "neurons"
  b2: ArrayLike = 0.95
  eps: ArrayLike = 1e-8
  rescale: str = "norm"
  selected_only: bool = False
  stage: ClassVar[str] = "normalize"

  @property
  def gathers(self) -> bool:
    return True  # a statistic of sharded state

  def transform(self, routing: RoutingLike = None) -> optax.GradientTransformation:
    return scale_by_second_moment(self.over, b2=self.b2, eps=self.eps, rescale=self.rescale,
                                  selected_only=self.selected_only, routing=routing)

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    return (*chain, self.transform(shared.routing))


def scale_by_second_moment(
    over: str = "neurons",
    *,
    b2: ArrayLike = 0.95,
    eps: ArrayLike = 1e-8,
    rescale: str = "norm",
    selected_only: bool = False,
    routing: RoutingLike = None,
) -> optax.GradientTransformation:
  """Normalizes an orthogonalized update O by a running second moment, then rescales it.

      v ← b2·v + (1 − b2)·mean over fan-in (O²)   over="neurons": one per output neuron
      v ← b2·v + (1 − b2)·O²                      over="elements"
      Ô = O / (√(v / (1 − b2ᵗ)) + eps)
      rescale="norm": Ô·‖O‖_F / ‖Ô‖_F              (NorMuon: the update keeps its norm)
      rescale="rms":  Ô·√min(fan_in, fan_out) / ‖Ô‖_F  (AdaMuon: a semi-orthogonal
                      matrix's norm, RMS 1/√max; scale_by_shape("moonlight") makes it 0.2)

  An output neuron is a fan-out index of the leaf's matrix view: a column of a JAX
  (in, out) kernel, a row of a PyTorch (out, in) weight. Norms are per matrix of the
  view (a layer of a stack, an expert). v is debiased as in Adam; with either
  rescaling that matters only next to eps. Statistics are float32 (float64 for float64
  updates) whatever the update's dtype; the output keeps it.

  Args:
    over: "neurons" or "elements".
    b2: decay of the second moment, in [0, 1).
    eps: added to √v̂, > 0.
    rescale: "norm" or "rms".
    selected_only: update v only where the update is nonzero (a neuron with any nonzero
      element), so that neurons a row selection (`select_rows`) left out keep theirs.
    routing: gives the matrix views (None: `default_view`).

  Returns:
    An `optax.GradientTransformation` with a `SecondMomentState`.

  Examples:
    >>> import jax, optax, muon_optax as mo
    >>> tx = optax.chain(mo.scale_by_muon_momentum(), mo.orthogonalize(),
    ...                  mo.scale_by_second_moment("neurons"), mo.scale_by_shape())
    >>> g = {"w": jax.random.normal(jax.random.key(0), (16, 32))}
    >>> state = tx.init(g)
    >>> state[2].nu["w"].shape  # one per output neuron
    (1, 32)

  References:
    Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491.
    Si, Zhang, Shen 2025, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005.
  """
  if over not in OVER:
    raise ValueError(f"over must be one of {OVER}, got {over!r}.")
  if rescale not in RESCALE:
    raise ValueError(f"rescale must be one of {RESCALE}, got {rescale!r}.")
  validate.decay_rate("b2", b2)
  validate.positive("eps", eps)
  views = as_routing(routing).view

  def init_leaf(path, p):
    view = matrix_view_of(views, path, p).normalize(p.ndim)
    dtype = jnp.promote_types(p.dtype, jnp.float32)
    return jnp.zeros(_statistic_shape(view, tuple(p.shape), over), dtype)

  def init_fn(params):
    return SecondMomentState(jnp.zeros([], jnp.int32), paths.map_with_path(init_leaf, params))

  def update_leaf(view, o, v, count):
    x = o.astype(v.dtype)
    square = x * x
    if over == "neurons":
      square = jnp.mean(square, axis=view.fan_in, keepdims=True)
    # On Explicit axes, the statistic is used in the update's layout and kept in its own.
    kept, spec = explicit_spec(v), explicit_spec(x)
    spec = None if spec is None else kept_spec(spec, v.shape)
    v_old = reshard_to(v, spec)
    v = (b2 * v_old + (1 - b2) * square).astype(v.dtype)
    if selected_only:
      chosen = x != 0
      if over == "neurons":
        chosen = jnp.any(chosen, axis=view.fan_in, keepdims=True)
      v = jnp.where(chosen, v, v_old)
    v_hat = v / (1 - b2 ** count).astype(v.dtype)
    normalized = x / (jnp.sqrt(v_hat) + eps)
    norm = jnp.sqrt(view.matrix_sums(normalized * normalized))
    if rescale == "norm":
      target = jnp.sqrt(view.matrix_sums(x * x))
    else:
      _, fan_in, fan_out = view.matrix_shape(o.shape)
      target = jnp.sqrt(jnp.asarray(min(fan_in, fan_out), v.dtype))
    factor = jnp.where(norm > 0, target / jnp.where(norm > 0, norm, 1), 0)
    return (normalized * factor).astype(o.dtype), reshard_to(v, kept)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    # Empty leaves are not live: a zero update, an untouched statistic.
    leaves = MatrixLeaves.of(updates, views)
    pairs = [update_leaf(view, o, v, count) for view, o, v in
             zip(leaves.views, leaves.arrays(), leaves.pick(state.nu))]
    return (leaves.put([o for o, _ in pairs]),
            SecondMomentState(count, leaves.put([v for _, v in pairs], state.nu)))

  return optax.GradientTransformation(init_fn, update_fn)
