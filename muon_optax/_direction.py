"""The family's direction built from component values, as optimistix builds a solver from
a descent and a search: each component fills one stage (how the gradients become an
orthogonal direction, a normalization, a scale) and adds its transforms to the chain.
A new member of the family is one component and one short alias."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Optional, Union

import optax
from jax.sharding import Mesh
from jax.typing import ArrayLike

from muon_optax._momentum import scale_by_muon_momentum
from muon_optax._newton_schulz.settings import NS
from muon_optax._orthogonalize import orthogonalize
from muon_optax._placement.mesh_layout import MeshLayout, as_mesh_layout
from muon_optax._placement.packed_gather import with_packed_gather
from muon_optax._routing.value import Routing
from muon_optax._scaling import SCALES, scale_by_dual_norm, scale_by_shape

Chain = tuple[optax.GradientTransformation, ...]
# The stages in chain order, and what the component of each decides.
STAGES = {"orthogonal": "how the gradients become an orthogonal direction",
          "normalize": "a normalization of the orthogonal direction",
          "scale": "the update's scale"}
ADAPTIVE = "adaptive"


@dataclasses.dataclass(frozen=True)
class Shared:
  """What every component of one direction is built with: `scale_by_muon`'s arguments
  other than the components, `routing` already a `Routing`."""

  beta: ArrayLike
  nesterov: Optional[bool]  # None: the momentum's look-ahead where there is a momentum
  ns: NS
  mu_dtype: Optional[Any]
  routing: Routing
  mesh: Union[Mesh, MeshLayout, None]


class Component:
  """One part of the family's direction. `stage` says which it fills (one component a
  stage); `extend` adds its transforms to the chain built by the stages before it;
  `check` refuses the components it does not combine with; `gathers` says it keeps
  statistics of sharded state, whose updates reach replicated params in one packed
  all-gather under ZeRO-1."""

  stage: ClassVar[str]

  @property
  def gathers(self) -> bool:
    return False

  def check(self, chosen: Mapping[str, Component], shared: Shared) -> None:
    del chosen, shared

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class WholeMatrices(Component):
  """Muon's: the momentum (`scale_by_muon_momentum`), each matrix orthogonalized whole."""

  stage: ClassVar[str] = "orthogonal"

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    return (*chain, momentum_of(shared),
            orthogonalize(shared.ns, routing=shared.routing, mesh=shared.mesh))


def momentum_of(shared: Shared) -> optax.GradientTransformation:
  """Muon's momentum, with Nesterov's look-ahead unless it is turned off."""
  return scale_by_muon_momentum(shared.beta, nesterov=shared.nesterov is not False,
                                mu_dtype=shared.mu_dtype)


@dataclasses.dataclass(frozen=True)
class ShapeScale(Component):
  """A factor of each matrix's shape (`scale_by_shape`)."""

  scale: Optional[str] = "jordan"
  stage: ClassVar[str] = "scale"

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    return (*chain, scale_by_shape(self.scale, routing=shared.routing))


@dataclasses.dataclass(frozen=True)
class AdaptiveScale(Component):
  """⟨M̂, O⟩ times Jordan's shape factor, M̂ the momentum without its start-up bias
  (`scale_by_dual_norm` around the orthogonalization), as
  `optax.contrib.muon(adaptive=True)`."""

  stage: ClassVar[str] = "scale"

  @property
  def gathers(self) -> bool:
    return True

  def check(self, chosen: Mapping[str, Component], shared: Shared) -> None:
    if "normalize" in chosen:
      raise ValueError("scale='adaptive' and normalize= are two ways to set the update's "
                       "magnitude; choose one.")
    if not isinstance(chosen["orthogonal"], WholeMatrices):
      raise ValueError(f"scale='adaptive' reads Muon's momentum and its whole-matrix "
                       f"orthogonalization: it does not combine with "
                       f"{type(chosen['orthogonal']).__name__} (select= or blocks=).")

  def extend(self, chain: Chain, shared: Shared) -> Chain:
    *before, orthogonal = chain  # WholeMatrices' orthogonalization: `check` made sure
    nesterov = shared.nesterov is not False
    return (*before, scale_by_dual_norm(orthogonal, routing=shared.routing),
            optax.scale_by_schedule(_debias(shared.beta, nesterov)),
            scale_by_shape("jordan", routing=shared.routing))


def _debias(beta: ArrayLike, nesterov: bool) -> Callable:
  """1 / (the weight the momentum puts on gradients so far) at step `count` + 1: the EMA
  holds 1 − βᵗ, its Nesterov look-ahead (1 − β)·g + β·m holds 1 − βᵗ⁺¹."""
  return lambda count: 1 / (1 - beta ** (count + 1 + int(nesterov)))


def scale_component(scale: Optional[str]) -> Component:
  """The scale stage of `scale_by_muon(scale=...)`."""
  if scale == ADAPTIVE:
    return AdaptiveScale()
  if scale not in SCALES:
    raise ValueError(f"unknown scale {scale!r}; choose one of {[*SCALES, ADAPTIVE]}.")
  return ShapeScale(scale)


def direction(components: Sequence[Optional[Component]], shared: Shared
              ) -> optax.GradientTransformation:
  """The chain of `components` (None: that stage not used) in stage order, each checked
  against the others."""
  chosen: dict[str, Component] = {}
  for component in (c for c in components if c is not None):
    if component.stage in chosen:
      raise ValueError(
          f"{type(chosen[component.stage]).__name__} and {type(component).__name__} both "
          f"decide {STAGES[component.stage]}: they do not combine; choose one.")
    chosen[component.stage] = component
  missing = set(STAGES) - set(chosen) - {"normalize"}
  if missing:
    raise ValueError(f"a direction needs a component for {sorted(missing)}.")
  for component in chosen.values():
    component.check(chosen, shared)
  chain: Chain = ()
  for stage in STAGES:
    if stage in chosen:
      chain = chosen[stage].extend(chain, shared)
  gathered = optax.chain(*chain)
  if shared.mesh is not None and any(c.gathers for c in chosen.values()):
    # Statistics of sharded state: under ZeRO-1 the updates that use them reach the
    # replicated params in one packed all-gather, not one per leaf (Muon's own come
    # back from the exchange already laid out).
    gathered = with_packed_gather(gathered, as_mesh_layout(shared.mesh))
  return gathered
