"""The Muon family as short compositions of the parts: `scale_by_muon`, and the aliases
`muon`, `normuon`, `adamuon`, `dion2`, `nordion2`, `muonbp` and `muonh`, each hidden matrices
through its chain and every other leaf through its own AdamW."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import jax
import optax
from jax.sharding import Mesh
from jax.typing import ArrayLike

from muon_optax import _routing
from muon_optax._adamw import offload
from muon_optax._adamw.backends import AuxAdam
from muon_optax._block_periodic import DEFAULT_BLOCKS, BlockPeriodic
from muon_optax._direction import Shared, WholeMatrices, direction, scale_component
from muon_optax._hyperball import hyperball
from muon_optax._momentum import MuonMomentumState
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS
from muon_optax._placement.mesh_layout import MeshLayout, as_mesh_layout
from muon_optax._placement.packed_gather import with_packed_gather
from muon_optax._routing.value import Routing, RoutingLike
from muon_optax._row_selection import RowSelection, RowSelectionState
from muon_optax._scaling import SCALES
from muon_optax._second_moment import SecondMoment
from muon_optax._util import tree_fit, validate
from muon_optax._util.types import Mask, ScalarOrSchedule
from muon_optax._weight_decay import WeightDecay, decay_part


def scale_by_muon(
    beta: ArrayLike = 0.95,
    *,
    nesterov: Optional[bool] = None,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "jordan",
    mu_dtype: Optional[Any] = None,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
    normalize: Optional[SecondMoment] = None,
    select: Optional[RowSelection] = None,
    blocks: Optional[BlockPeriodic] = None,
) -> optax.GradientTransformation:
  """The family's direction without learning rate or weight decay, built from its parts:
  momentum → Newton–Schulz orthogonalization → (a second moment) → scaling.

  A chain of components, one a stage: how the gradients become an orthogonal direction
  (Muon's momentum and whole matrices; a `RowSelection`, whose error-feedback buffer (decay
  `beta`) and selected neurons take the place of both (`select_rows`); or a
  `BlockPeriodic`), then a normalization (a `SecondMoment`: NorMuon, AdaMuon) or none,
  then the scale (a shape's, or adaptive: ⟨M̂, O⟩ (M̂ the momentum without its start-up
  bias) and Jordan's shape factor, as `optax.contrib.muon(adaptive=True)`). Two
  components of one stage, or that do not combine, are a ValueError. Every leaf it sees
  must have a matrix view; route other leaves elsewhere (`muon` does that for you).
  Arguments as in `muon`, and:

  Args:
    nesterov: the momentum's look-ahead; None: True, or False with `select` (Dion2's
      buffer has none).
    normalize: a `SecondMoment` that normalizes the orthogonalized update (NorMuon,
      AdaMuon), or None.
    select: a `RowSelection`: orthogonalize only that fraction of each matrix's output
      neurons (Dion2), or None.
    blocks: a `BlockPeriodic`: orthogonalize each device's block alone on most steps,
      whole matrices every `period`-th (MuonBP; `orthogonalize_blocks`), or None.

  Examples:
    >>> import jax, optax, muon_optax as mo
    >>> tx = optax.chain(mo.scale_by_muon(), optax.scale(-0.02))
    >>> p = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> u, s = tx.update(p, tx.init(p))

  References:
    Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks".
  """
  shared = Shared(beta, nesterov, ns, mu_dtype, _routing.as_routing(routing), mesh)
  orthogonal = [c for c in (select, blocks) if c is not None] or [WholeMatrices()]
  return direction([*orthogonal, normalize, scale_component(scale)], shared)


def _decoupled_step(learning_rate: ScalarOrSchedule,
                    weight_decay: Union[WeightDecay, ScalarOrSchedule],
                    weight_decay_mask: Mask) -> optax.GradientTransformation:
  """Decoupled weight decay (plain or cautious), then the learning rate."""
  validate.learning_rate("learning_rate", learning_rate)
  return optax.chain(decay_part(weight_decay, weight_decay_mask),
                     optax.scale_by_learning_rate(learning_rate))


def _member(args: Mapping[str, Any], *,
            step: Optional[Callable[[Routing], optax.GradientTransformation]] = None,
            **direction_args: Any) -> optax.GradientTransformationExtraArgs:
  """The alias whose arguments are `args` (its `locals()`, taken first): `scale_by_muon`
  of its direction arguments and `direction_args` (its components), then `step` of the
  `Routing` (None: decoupled weight decay and the learning rate) for the leaves routed
  to Muon, AdamW for the others, zero for frozen ones: what every alias shares. The
  routing is made a `Routing` here, once, for every part."""
  routing = _routing.as_routing(args["routing"])
  given = {k: args[k] for k in _DIRECTION_ARGS if k in args}
  direction = scale_by_muon(**{**given, **direction_args}, routing=routing, mesh=args["mesh"])
  if step is None:
    then = _decoupled_step(args["learning_rate"], args["weight_decay"], args["weight_decay_mask"])
  else:
    then = step(routing)
  return _family(optax.chain(direction, then), args, routing)


# The aliases' arguments that `scale_by_muon` takes as they are.
_DIRECTION_ARGS = ("beta", "nesterov", "ns", "scale", "mu_dtype")


def _family(hidden: optax.GradientTransformation, args: Mapping[str, Any], routing: Routing
            ) -> optax.GradientTransformationExtraArgs:
  """`hidden` for the leaves routed to Muon, AdamW for the others, zero for frozen ones;
  `args` the alias's arguments."""
  weight_decay_mask, mesh = args.get("weight_decay_mask"), args["mesh"]
  if args["offload_momentum"]:
    hidden = offload.offload_state(hidden)
  adam = _aux_branch(args["adam"], args["adam_learning_rate"])
  if mesh is not None:  # ZeRO-1: the AdamW updates gathered in one collective, not per leaf
    adam = with_packed_gather(adam, as_mesh_layout(mesh))
  transforms = {_routing.MUON: hidden, _routing.ADAM: adam, _routing.FROZEN: optax.set_to_zero()}

  def param_labels(params):
    label_tree = routing.labels(params)
    _routing.check_labels(label_tree, params, routing.view, tuple(transforms))
    return label_tree

  inner = optax.partition(transforms, param_labels)

  def init_fn(params):
    tree_fit.check_mask("weight_decay_mask", weight_decay_mask, params)
    state = offload.commit_like(inner.init(params), params)
    _routing.warn_guessed_views(routing, params)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    # Before labelling, so that a mismatch is named as one: against the params, or the
    # state tree that mirrors them (with placeholders where other branches' leaves are).
    tree_fit.check_updates(updates, params if params is not None else _mirror_of(state))
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mirror_of(state: Any) -> Any:
  """The tree inside a family state that has the params' structure: Muon's momentum, or
  Dion2's error-feedback buffer."""
  mirrors = (MuonMomentumState, RowSelectionState)
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mirrors))
           if isinstance(x, mirrors)]
  return found[0][0]


def _aux_branch(adam: Union[AuxAdam, optax.GradientTransformation, None],
                adam_learning_rate: Optional[ScalarOrSchedule]) -> optax.GradientTransformation:
  adam = AuxAdam() if adam is None else adam
  if adam_learning_rate is None:
    return adam.transform() if isinstance(adam, AuxAdam) else adam
  validate.learning_rate("adam_learning_rate", adam_learning_rate)
  if not isinstance(adam, AuxAdam):
    raise ValueError("adam_learning_rate= applies to AuxAdam settings, not to a custom adam "
                     "transform: give that transform its own learning rate.")
  return dataclasses.replace(adam, learning_rate=adam_learning_rate).transform()


def muon(
    learning_rate: ScalarOrSchedule = 0.02,
    *,
    beta: ArrayLike = 0.95,
    nesterov: bool = True,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "jordan",
    weight_decay: Union[ArrayLike, WeightDecay] = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """Muon for hidden weight matrices, AdamW for everything else, routed by tree path.

  Muon leaves: p ← p − lr·(scale·NS(momentum) + weight_decay·p).
  Other leaves: AdamW with the settings of `adam` (default `AuxAdam()`); leaves
  labelled "frozen" get a zero update.

  Args:
    learning_rate: Muon's learning rate (≥ 0) or schedule.
    beta: the momentum's decay rate (see `scale_by_muon_momentum`).
    nesterov: Nesterov's look-ahead (see `scale_by_muon_momentum`).
    mu_dtype: the momentum's dtype (see `scale_by_muon_momentum`).
    ns: Newton–Schulz settings, a `NewtonSchulz` or a preset name (default "turbo": AOL
      preconditioning and 4 steps, Gram-space from aspect 2).
    scale: "jordan" √max(1, fan_out/fan_in), "moonlight" 0.2·√max(fan_in, fan_out),
      None (see `scale_by_shape`), or "adaptive": ⟨M̂, O⟩ times Jordan's factor, M̂
      the momentum without its start-up bias (see `scale_by_dual_norm`), as
      `optax.contrib.muon(adaptive=True)`.
    weight_decay: decoupled weight decay of the Muon branch: a rate (or schedule), or a
      `WeightDecay` (`WeightDecay(0.1, cautious=True)` decays only where the update and
      the parameter agree in sign; see `add_decayed_weights`).
    weight_decay_mask: where it applies, over the full params, checked at init.
    adam: `AuxAdam` settings, or any optax transform, for the non-Muon leaves.
    adam_learning_rate: overrides `adam.learning_rate`; unlike a rate inside `AuxAdam`,
      `optax.inject_hyperparams` can inject it, like `learning_rate`.
    offload_momentum: keep the Muon branch's state in host memory between steps (see
      `offload_state`); Newton–Schulz still sees whole matrices on the device.
    routing: which leaves Muon updates and how each is a matrix: a `Routing` (from
      `infer_routing`, which reads the computation, or `Routing.from_rules`), or labels
      as `optax.partition` takes them ("muon" / "adam" / "frozen" per leaf, a prefix of
      the params tree, or a callable params -> labels). None: the default name rules
      (`DEFAULT_RULES`), which cannot tell a head named like a hidden layer.
    mesh: orthogonalize whole matrices dealt over the mesh's devices, balanced by flops,
      instead of on every device (see `state_shardings` for the state's layout).

  Returns:
    An `optax.GradientTransformationExtraArgs`. Under `optax.inject_hyperparams` numbers
    (and an (n, 3) `ns` table) are injectable; pass a callable `routing` in `static_args`.

  Raises:
    ValueError: a learning rate that is negative, NaN, or not a number, scalar array or
      schedule; beta outside [0, 1); a negative weight decay; bad Newton–Schulz
      settings. At init: a mask that does not fit the params; a leaf that cannot be
      updated as routed. At update: gradients that do not fit the params.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, muon_optax as mo
    >>> params = {"embed": {"embedding": jnp.ones((10, 4))},
    ...           "mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> tx = mo.muon(0.02, adam=mo.AuxAdam(learning_rate=3e-4))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)

  References:
    Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks".
    Liu et al. 2025, "Muon is scalable for LLM training", arXiv 2502.16982.
  """
  return _member(locals())


def _family_scale(scale: Optional[str]) -> Optional[str]:
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {list(SCALES)} here, got {scale!r} (adaptive "
                     "scaling is muon's: muon(scale='adaptive')).")
  return scale


def normuon(
    learning_rate: ScalarOrSchedule = 0.02,
    *,
    beta: ArrayLike = 0.95,
    nesterov: bool = True,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "jordan",
    b2: ArrayLike = 0.95,
    weight_decay: Union[ArrayLike, WeightDecay] = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """NorMuon: Muon whose orthogonalized update is normalized per output neuron.

  O = NS(momentum); each output neuron (a fan-out index of the matrix view) is divided
  by the root of an EMA (decay `b2`) of its mean square, and the matrix rescaled to
  keep ‖O‖_F (`scale_by_second_moment("neurons", rescale="norm")`); then `scale`.
  Every other argument as in `muon`; the new state (one float32 per neuron) is
  partitioned by `state_shardings` like the rest.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> tx = mo.normuon(0.02, adam=mo.AuxAdam(3e-4))
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491.
  """
  return _member(locals(), scale=_family_scale(scale),
                 normalize=SecondMoment("neurons", b2=b2, eps=1e-10, rescale="norm"))


def adamuon(
    learning_rate: ScalarOrSchedule = 3e-3,
    *,
    beta: ArrayLike = 0.95,
    nesterov: bool = True,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "moonlight",
    b2: ArrayLike = 0.999,
    weight_decay: Union[ArrayLike, WeightDecay] = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """AdaMuon: Muon whose orthogonalized update is normalized element-wise, RMS-aligned.

  O = NS(momentum); each element is divided by the root of an EMA (decay `b2`, debiased)
  of its square, and the matrix rescaled to the Frobenius norm of a semi-orthogonal
  matrix, √min(fan_in, fan_out) (`scale_by_second_moment("elements", rescale="rms")`);
  the default `scale="moonlight"` then gives every matrix the update RMS 0.2 that
  AdamW has, so AdamW's learning rates transfer. Every other argument as in `muon`;
  the new state (a float32 per element) is partitioned like the momentum.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> tx = mo.adamuon(3e-3, adam=mo.AuxAdam(3e-4))
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Si, Zhang, Shen 2025, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005.
  """
  return _member(locals(), scale=_family_scale(scale),
                 normalize=SecondMoment("elements", b2=b2, eps=1e-8, rescale="rms"))


def dion2(
    learning_rate: ScalarOrSchedule = 0.02,
    *,
    fraction: Union[float, RowSelection] = 0.25,
    beta: ArrayLike = 0.95,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "jordan",
    weight_decay: Union[ArrayLike, WeightDecay] = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """Dion2: Muon that orthogonalizes only a `fraction` of each matrix's output neurons.

  An error-feedback buffer B ← B + G; the ⌈fraction·fan_out⌉ output neurons of largest
  L1 norm are orthogonalized together and updated, and their buffer decays by `beta`;
  the others keep accumulating until chosen (`select_rows`). Then `scale` and decoupled
  weight decay on the whole matrix, as in `muon`, whose other arguments it shares.
  `fraction` may be a `RowSelection`, for its scope: `RowSelection(0.25, scope="shard")`
  chooses within each device's shard, so that only the chosen neurons travel.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> tx = mo.dion2(0.02, fraction=0.25, adam=mo.AuxAdam(3e-4))
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Ahn, Amsel, Langford 2025, "Dion2: A simple method to shrink matrix in Muon",
    arXiv 2512.16928.
  """
  return _member(locals(), scale=_family_scale(scale), nesterov=False,
                 select=_selection(fraction))


def _selection(fraction: Union[float, RowSelection]) -> RowSelection:
  return fraction if isinstance(fraction, RowSelection) else RowSelection(fraction)


def nordion2(
    learning_rate: ScalarOrSchedule = 0.02,
    *,
    fraction: Union[float, RowSelection] = 0.25,
    beta: ArrayLike = 0.95,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "jordan",
    b2: ArrayLike = 0.95,
    weight_decay: Union[ArrayLike, WeightDecay] = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """NorDion2 (Dion3): Dion2's selected neurons, normalized as NorMuon normalizes them.

  The selected neurons' orthogonalized update is divided by the root of an EMA (decay
  `b2`) of each neuron's mean square, kept only for the neurons selected that step, and
  the matrix rescaled to keep its norm (`SecondMoment("neurons", selected_only=True)`).
  Every other argument as in `dion2`.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> tx = mo.nordion2(0.02, fraction=0.25, adam=mo.AuxAdam(3e-4))
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Ahn, Amsel, Langford 2025, "Dion2", arXiv 2512.16928; NorDion2 in microsoft/dion.
    Li et al. 2025, "NorMuon", arXiv 2510.05491.
  """
  return _member(locals(), scale=_family_scale(scale), nesterov=False,
                 select=_selection(fraction),
                 normalize=SecondMoment("neurons", b2=b2, eps=1e-10, rescale="norm",
                                        selected_only=True))


def muonh(
    learning_rate: ScalarOrSchedule = 0.01,
    *,
    beta: ArrayLike = 0.95,
    nesterov: bool = True,
    ns: NS = DEFAULT_NS,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """MuonH: Muon's direction, stepped on the hyperball of each matrix's initial norm.

  W' = r·(W − lr·r·O/‖O‖)/‖W − lr·r·O/‖O‖‖ with O Muon's orthogonalized momentum and r
  the matrix's Frobenius norm at init (`hyperball`): `learning_rate` is the step relative
  to the matrix's norm, and there is no weight decay (the sphere bounds the norm). Every
  other argument as in `muon`. Muon matrices must be initialized nonzero.

  Examples:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jax.random.normal(jax.random.key(0), (4, 8)),
    ...                   "bias": jnp.zeros(8)}}
    >>> tx = mo.muonh(0.01, adam=mo.AuxAdam(3e-4))
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    "Hyperball" / MuonH, arXiv 2606.16899; MuonH in microsoft/dion.
  """
  return _member(locals(), scale=None,
                 step=lambda routing: hyperball(learning_rate, routing=routing))


def muonbp(
    learning_rate: ScalarOrSchedule = 0.02,
    *,
    blocks: BlockPeriodic = DEFAULT_BLOCKS,
    beta: ArrayLike = 0.95,
    nesterov: bool = True,
    ns: NS = DEFAULT_NS,
    scale: Optional[str] = "jordan",
    weight_decay: Union[ArrayLike, WeightDecay] = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    offload_momentum: bool = False,
    routing: RoutingLike = None,
    mesh: Union[Mesh, MeshLayout, None] = None,
) -> optax.GradientTransformationExtraArgs:
  """MuonBP: Muon that orthogonalizes each device's block of a matrix alone, with no
  communication, on all but every `blocks.period`-th step (the first included), which
  is Muon's (`orthogonalize_blocks`).

  Block steps are brought to the full steps' update RMS (the paper's rule) and scaled by
  `blocks.block_scale`. On a mesh the blocks are its devices' shards; on one device,
  `BlockPeriodic(devices=n)` takes those of n devices (the results equal a mesh's).
  Every other argument as in `muon`.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((8, 16)), "bias": jnp.zeros(16)}}
    >>> tx = mo.muonbp(0.02, blocks=mo.BlockPeriodic(period=4, devices=2))
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Khaled et al. 2025, "MuonBP: Faster Muon via block-periodic orthogonalization",
    arXiv 2510.16981.
  """
  return _member(locals(), scale=_family_scale(scale), blocks=blocks)
