"""Optimizer state kept in host memory between steps: `offload_state`."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax


def check_host_memory() -> None:
  """A ValueError unless the default device has a host memory space to offload into."""
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  if not kinds & {"pinned_host", "unpinned_host"}:
    raise ValueError(
        f"host offload needs a host memory space, but {jax.devices()[0]} offers only "
        f"{sorted(kinds)}; use another AdamW backend or offload_momentum=False.")


def to_host(tree: Any) -> Any:
  """Every array of `tree` with at least one dimension moved to host memory."""
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if jnp.ndim(x) else x,
                      tree)


def to_device(tree: Any) -> Any:
  """Every array of `tree` with at least one dimension moved to device memory."""
  return jax.tree.map(
      lambda x: jax.device_put(x, jax.memory.Space.Device) if jnp.ndim(x) else x, tree)


def _concrete(x: Any) -> bool:
  """Whether `x` is an array with a placement (not a tracer, which has none yet)."""
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _committed_sharding(tree: Any) -> Any:
  """Where the committed concrete arrays of `tree` live, as the sharding a scalar should
  take there (the device, or replicated on the mesh); None if none is committed."""
  for x in jax.tree.leaves(tree):
    if _concrete(x) and x.committed:
      sharding = x.sharding
      if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
      if len(sharding.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
      return None
  return None


def commit_like(state: Any, params: Any) -> Any:
  """`state` with its uncommitted arrays committed where the params are, if they are.

  jit specializes on whether each argument is committed, and its outputs are committed
  when any input is: a fresh state of uncommitted zeros (step counts) next to committed
  params would come back committed from step 1 and make step 2 compile again.
  """
  target = _committed_sharding(params)
  if target is None:
    return state
  return jax.tree.map(
      lambda x: jax.device_put(x, target) if _concrete(x) and not x.committed else x, state)


def commit_scalars(state: Any) -> Any:
  """Commits the scalar leaves (step counts) of `state` where its other arrays live."""
  return commit_like(state, [x for x in jax.tree.leaves(state) if jnp.ndim(x)])


def warn_if_uncommitted(params: Any, state: Any) -> None:
  """Offloaded state is committed (it lives in a memory space), and so is everything a
  jitted step returns next to it: uncommitted params would make step 2 compile again.
  (A state made under a trace is placed by that trace: nothing to warn of.)"""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    return
  arrays = [x for x in jax.tree.leaves(params) if _concrete(x)]
  if arrays and not any(x.committed for x in arrays):
    warnings.warn(
        "host offload: the params are not committed to a device, so a jitted step will "
        "compile twice (its offloaded state is committed, and so are the params it "
        "returns). Commit them first: params = jax.device_put(params, jax.devices()[0]) "
        "(or their mesh shardings).", stacklevel=3)


def offload_state(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Keeps `inner`'s state in host memory; each update brings it in and puts it back.

  Only where the state lives changes: the state type, the maths and the results are
  `inner`'s. Scalars (step counts) stay on the device. `muon(..., offload_momentum=True)`
  wraps the Muon branch with it (the momentum is still orthogonalized as whole matrices
  on the device), and `adamw(backend="offload")` the AdamW moments.

  Commit the params to a device before the first step (`jax.device_put(params,
  device)`, or create them under jit): jit specializes on whether its inputs are
  committed, and next to committed host-memory state a fresh, uncommitted input makes
  the second step compile again. `init` warns when it sees such params.

  Args:
    inner: any optax transform.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `inner`'s state, in memory kind
    `pinned_host`.

  Examples:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.offload_state(mo.scale_by_muon_momentum(0.9))
    >>> params = jax.device_put({"w": jnp.ones((2, 2))}, jax.devices()[0])  # committed
    >>> s = tx.init(params)
    >>> s.mu["w"].sharding.memory_kind
    'pinned_host'
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    check_host_memory()
    state = inner.init(params)
    warn_if_uncommitted(params, state)
    return commit_scalars(to_host(state))

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = inner.update(updates, to_device(state), params, **extra_args)
    return updates, to_host(state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
