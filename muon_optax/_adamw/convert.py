"""Conversion of AdamW state between backends: `convert_adam_state`."""

from __future__ import annotations

from typing import Any

import jax
import optax

from muon_optax._adamw import offload
from muon_optax._adamw.backends import (
  STATE_TYPES,
  OffloadAdamState,
  check_backend,
  describe_state,
)
from muon_optax._util import paths

_FIELDS = ("count", "mu", "nu")


def convert_adam_state(state: Any, params: Any, to_backend: str, *, branch: str = "adam") -> Any:
  """Converts the AdamW state inside `state` to the layout of another backend.

  Works on a whole `muon(...)` state (also chained or wrapped: the AdamW state is the
  `branch` entry of its `optax.PartitionState`) or on a standalone `adamw(...)` state;
  every AdamW state found is converted, everything else is returned unchanged. The
  next update with the new backend equals the one the old backend would have made.
  An `optax.adamw` chain state in the branch is migrated; an unknown, incomplete or
  removed layout raises a ValueError naming what is wrong.

  The moments mirror the params (with `optax.MaskedNode` where a leaf belongs to
  another branch), so no routing labels are needed: `params` only checks the fit.

  Args:
    state: the optimizer state to convert (restore checkpoints with the abstract state
      of the optimizer that wrote them, then convert).
    params: the params the state belongs to (arrays or `jax.ShapeDtypeStruct`s).
    to_backend: "optax", "offload" or "reference".
    branch: the `optax.partition` label of the AdamW branch ("adam" in `muon`).

  Returns:
    `state` with its AdamW state in the layout of `to_backend`.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> state = mo.muon(adam=mo.AuxAdam(backend="reference")).init(params)
    >>> state = mo.convert_adam_state(state, params, "optax")
    >>> tx = mo.muon(adam=mo.AuxAdam(backend="optax"))
    >>> u, state = tx.update(params, state, params)
  """
  backend = check_backend(to_backend)
  found = []

  def visit(node, path):
    if isinstance(node, optax.PartitionState) and branch in node.inner_states:
      where = f"{path}.inner_states[{branch!r}]"
      masked = node.inner_states[branch]
      if not isinstance(masked, optax.MaskedState):
        raise _layout_error(masked, where)
      inner = _adamw_chain_state(masked.inner_state)
      found.append(where)
      inner = _convert_one(inner, params, backend, where + ".inner_state")
      return node._replace(inner_states={**node.inner_states, branch: optax.MaskedState(inner)})
    if isinstance(node, tuple(STATE_TYPES.values())):
      found.append(path)
      return _convert_one(node, params, backend, path)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      return type(node)(*(visit(v, f"{path}.{f}") for f, v in zip(node._fields, node)))
    if isinstance(node, (tuple, list)):
      return type(node)(visit(v, f"{path}[{i}]") for i, v in enumerate(node))
    if isinstance(node, dict):
      return {k: visit(v, f"{path}[{k!r}]") for k, v in node.items()}
    return node

  out = visit(state, "state")
  if not found:
    raise ValueError(
        f"found no AdamW state in {describe_state(state)}: expected a muon(...) state (an "
        f"optax.PartitionState with an {branch!r} branch) or one of "
        f"{[t.__name__ for t in STATE_TYPES.values()]}.")
  return out


def _adamw_chain_state(state: Any) -> Any:
  """The `optax.ScaleByAdamState` of an `optax.adamw` chain state; anything else as it is.

  optax.adamw chains scale_by_adam, add_decayed_weights and a learning-rate scale;
  its schedule counts equal the Adam count, so the Adam state carries everything.
  """
  if (isinstance(state, tuple) and not hasattr(state, "_fields") and state
      and isinstance(state[0], optax.ScaleByAdamState)):
    return state[0]
  return state


def _convert_one(state: Any, params: Any, backend: str, where: str) -> Any:
  if not isinstance(state, tuple(STATE_TYPES.values())):
    raise _layout_error(state, where)
  for field in ("mu", "nu"):
    _check_mirrors(getattr(state, field), params, f"{where}.{field}")
  if backend == "offload":
    offload.check_host_memory()
    return offload.commit_scalars(
        OffloadAdamState(state.count, offload.to_host(state.mu), offload.to_host(state.nu)))
  mu, nu = offload.to_device(state.mu), offload.to_device(state.nu)
  return STATE_TYPES[backend](state.count, mu, nu)


def _check_mirrors(moment: Any, params: Any, where: str) -> None:
  """Each moment leaf is a MaskedNode or has the shape of the parameter at its place."""
  m_leaves, m_def = jax.tree.flatten(moment, is_leaf=paths.is_masked)
  p_leaves, p_def = jax.tree.flatten(params, is_leaf=paths.is_masked)
  fits = m_def == p_def and all(
      paths.is_masked(m) or jax.numpy.shape(m) == jax.numpy.shape(p)
      for m, p in zip(m_leaves, p_leaves))
  if not fits:
    raise ValueError(
        f"{where} does not fit these params (tree structure or shapes differ). Pass the "
        "params the state was built for.")


def _layout_error(state: Any, where: str) -> ValueError:
  known = ", ".join(f"{t.__name__} ({b!r})" for b, t in STATE_TYPES.items())
  fields = getattr(state, "_fields", None)
  if fields is None:
    return ValueError(
        f"{where}: expected an AdamW state, got {describe_state(state)}. Known: {known}.")
  missing = [f for f in _FIELDS if f not in fields]
  unexpected = [f for f in fields if f not in _FIELDS]
  detail = (f"missing field(s) {missing}, unexpected field(s) {unexpected}"
            if missing or unexpected else "an unknown layout with the right field names")
  return ValueError(
      f"{where}: cannot read AdamW state {describe_state(state)}: {detail}. Known layouts: {known}"
      " (an optax.adamw chain state is migrated too). Restore a checkpoint with the abstract "
      "state of the optimizer that wrote it, jax.eval_shape(tx.init, params), then convert it.")
