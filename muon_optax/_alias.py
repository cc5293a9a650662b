"""The Muon chain and the `muon` alias: Muon for hidden matrices, AdamW for the rest."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import optax
from jax.sharding import Mesh
from jax.typing import ArrayLike

from muon_optax import _adamw, _offload, _paths, _routing, _validate
from muon_optax._matrix_view import ViewFn
from muon_optax._momentum import scale_by_muon_momentum
from muon_optax._ns_plan import DEFAULT_NS, Schedule
from muon_optax._orthogonalize import orthogonalize
from muon_optax._packed_gather import with_packed_gather
from muon_optax._scaling import scale_by_shape

ScalarOrSchedule = Union[ArrayLike, Callable[[ArrayLike], ArrayLike]]
Mask = Union[None, Any, Callable[[Any], Any]]


def scale_by_muon(
    beta: ArrayLike = 0.95,
    *,
    nesterov: bool = True,
    ns: Schedule = DEFAULT_NS,
    ns_steps: Optional[int] = None,
    scale: Optional[str] = "jordan",
    mu_dtype: Optional[Any] = None,
    views: Optional[ViewFn] = None,
    per_head: bool = False,
    compute_dtype: Any = "auto",
    gram: Optional[bool] = None,
    precondition: Optional[str] = None,
    mesh: Optional[Mesh] = None,
    data_axis: str = "data",
) -> optax.GradientTransformation:
  """The Muon direction without learning rate or weight decay:
  momentum → Newton–Schulz orthogonalization → shape scaling.

  Every leaf it sees must have a matrix view; route other leaves elsewhere
  (see `muon`, which does that for you).

  Example:
    >>> import jax, optax, muon_optax as mo
    >>> tx = optax.chain(mo.scale_by_muon(), optax.scale(-0.02))
    >>> p = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> u, s = tx.update(p, tx.init(p))

  References:
    Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks".
  """
  return optax.chain(
      scale_by_muon_momentum(beta, nesterov=nesterov, mu_dtype=mu_dtype),
      orthogonalize(ns, ns_steps, views=views, per_head=per_head, compute_dtype=compute_dtype,
                    gram=gram, precondition=precondition, mesh=mesh, data_axis=data_axis),
      scale_by_shape(scale, views=views, per_head=per_head),
  )


@dataclasses.dataclass(frozen=True)
class AuxAdam:
  """Settings of the AdamW branch that updates every non-Muon leaf.

  They are its own: nothing is shared with the Muon branch unless you pass it here.
  `mask` (a pytree of bools over the full params, or a callable) limits weight decay.
  """

  learning_rate: ScalarOrSchedule = 3e-4
  b1: ArrayLike = 0.9
  b2: ArrayLike = 0.999
  eps: ArrayLike = 1e-8
  weight_decay: ArrayLike = 0.0
  mask: Mask = None
  nesterov: bool = False
  mu_dtype: Optional[Any] = None
  backend: str = "optax"  # "optax", "offload" or "reference"; see `adamw`.

  def __post_init__(self):
    _validate.learning_rate("AuxAdam learning_rate", self.learning_rate)
    _validate.decay_rate("AuxAdam b1", self.b1)
    _validate.decay_rate("AuxAdam b2", self.b2)
    _validate.positive("AuxAdam eps", self.eps)
    _validate.weight_decay("AuxAdam weight_decay", self.weight_decay)

  def transform(self) -> optax.GradientTransformation:
    return _adamw.adamw(
        self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps,
        weight_decay=self.weight_decay, mask=branch_mask(self.mask),
        nesterov=self.nesterov, mu_dtype=self.mu_dtype, backend=self.backend)


def branch_mask(mask: Mask) -> Mask:
  """A mask over the full params, made usable inside an `optax.partition` branch,
  whose params hold `optax.MaskedNode` where the leaf belongs to another branch."""
  if mask is None or callable(mask):
    return mask
  return lambda params: jax.tree.map(
      lambda m, p: p if _paths.is_masked(p) else m, mask, params, is_leaf=_paths.is_masked)


def muon(
    learning_rate: ScalarOrSchedule = 0.02,
    *,
    beta: ArrayLike = 0.95,
    nesterov: bool = True,
    ns: Schedule = DEFAULT_NS,
    ns_steps: Optional[int] = None,
    scale: Optional[str] = "jordan",
    weight_decay: ArrayLike = 0.0,
    weight_decay_mask: Mask = None,
    mu_dtype: Optional[Any] = None,
    adam: Union[AuxAdam, optax.GradientTransformation, None] = None,
    adam_learning_rate: Optional[ScalarOrSchedule] = None,
    adam_backend: Optional[str] = None,
    offload_momentum: bool = False,
    labels: _routing.Labels = None,
    views: Optional[ViewFn] = None,
    per_head: bool = False,
    compute_dtype: Any = "auto",
    gram: Optional[bool] = None,
    precondition: Optional[str] = None,
    mesh: Optional[Mesh] = None,
    data_axis: str = "data",
    routing: Optional[_routing.Routing] = None,
    rules: Optional[Sequence[_routing.Rule]] = None,
) -> optax.GradientTransformationExtraArgs:
  """Muon for hidden weight matrices, AdamW for everything else, routed by tree path.

  Muon leaves: p ← p − lr·(scale(shape)·NS(momentum) + weight_decay·p).
  Other leaves: AdamW with the settings of `adam` (default `AuxAdam()`); leaves
  labelled "frozen" get a zero update.

  Args:
    learning_rate: Muon's learning rate or schedule.
    beta, nesterov, mu_dtype: momentum settings (see `scale_by_muon_momentum`).
    ns, ns_steps: Newton–Schulz preset or (n, 3) schedule, and iterations (None: the
      preset's; the default "turbo" runs 4 after AOL preconditioning).
    scale: "jordan", "moonlight" or None (see `scale_by_shape`).
    weight_decay, weight_decay_mask: decoupled weight decay of the Muon branch.
    adam: `AuxAdam` settings, or any optax transform, for the non-Muon leaves.
    adam_learning_rate: overrides `adam.learning_rate` (a number, scalar array or
      schedule); unlike a rate inside `AuxAdam`, it can be injected with
      `optax.inject_hyperparams`, like `learning_rate`.
    adam_backend: overrides `adam.backend`: "optax", "offload" or "reference" (see
      `adamw`; `convert_adam_state` moves a state between them).
    offload_momentum: keep the Muon momentum in host memory between steps (see
      `offload_state`); Newton–Schulz still sees whole matrices on the device.
    routing: a `Routing` (labels, matrix views and reasons), e.g. from
      `infer_routing(f, params, *args)`, which reads them from the computation.
      `describe(params, routing=routing)` shows it.
    labels: shorthand: a pytree of "muon" / "adam" / "frozen" strings (or a prefix
      of the params tree, as `optax.partition` takes) or a callable params -> labels.
    rules: shorthand: name rules, (regex, label) pairs or callables (path, leaf) ->
      label | None, first match wins. None of routing / labels / rules: the default
      name rules (`DEFAULT_RULES`), which cannot tell a head named like a hidden
      layer (Dense_2, out) from one; `infer_routing` can.
    views, per_head: shorthand: how leaves are seen as matrices (see `default_view`).
    compute_dtype: dtype of the Newton–Schulz matmul operands (float32 accumulation);
      "auto" is bfloat16 on GPU/TPU and float32 on CPU.
    gram: Gram-space Newton–Schulz on, off, or None to choose per matrix shape (see
      `newton_schulz`).
    precondition: "frobenius", "aol", or None for the preset's own.
    mesh, data_axis: orthogonalize whole matrices dealt over the mesh's devices,
      balanced by flops, instead of on every device (see `state_shardings` for the
      matching optimizer-state layout).

  Returns:
    An `optax.GradientTransformationExtraArgs`. Under `optax.inject_hyperparams`
    pass `static_args=("ns_steps",)` (and any callable option such as `labels`).

  Raises:
    ValueError: a learning rate that is not a number, scalar array or schedule; beta
      outside [0, 1); ns_steps not a positive int; a negative weight decay.

  Example:
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
  _validate.learning_rate("learning_rate", learning_rate)
  _validate.decay_rate("beta", beta)
  _validate.weight_decay("weight_decay", weight_decay)
  if adam_learning_rate is not None:
    _validate.learning_rate("adam_learning_rate", adam_learning_rate)
  routing = _routing.as_routing(routing=routing, labels=labels, rules=rules, views=views,
                                per_head=per_head)
  views = routing.view
  muon_branch = optax.chain(
      scale_by_muon(beta, nesterov=nesterov, ns=ns, ns_steps=ns_steps, scale=scale,
                    mu_dtype=mu_dtype, views=views, compute_dtype=compute_dtype,
                    gram=gram, precondition=precondition, mesh=mesh, data_axis=data_axis),
      optax.add_decayed_weights(weight_decay, branch_mask(weight_decay_mask)),
      optax.scale_by_learning_rate(learning_rate),
  )
  if offload_momentum:
    muon_branch = _offload.offload_state(muon_branch)
  adam = AuxAdam() if adam is None else adam
  if adam_backend is not None:
    if not isinstance(adam, AuxAdam):
      raise ValueError("adam_backend= applies to AuxAdam settings, not to a custom adam transform.")
    adam = dataclasses.replace(adam, backend=adam_backend)
  if adam_learning_rate is not None:
    if not isinstance(adam, AuxAdam):
      raise ValueError("adam_learning_rate= applies to AuxAdam settings, not to a custom adam "
                       "transform: give that transform its own learning rate.")
    adam = dataclasses.replace(adam, learning_rate=adam_learning_rate)
  adam_branch = adam.transform() if isinstance(adam, AuxAdam) else adam
  if mesh is not None:  # ZeRO-1: the AdamW updates gathered in one collective, not per leaf
    adam_branch = with_packed_gather(adam_branch)
  transforms = {
      _routing.MUON: muon_branch,
      _routing.ADAM: adam_branch,
      _routing.FROZEN: optax.set_to_zero(),
  }

  def param_labels(params):
    label_tree = routing.labels(params)
    _routing.check_labels(label_tree, params, views, tuple(transforms))
    return label_tree

  return optax.partition(transforms, param_labels)
