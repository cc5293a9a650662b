"""The JSON record saved with each checkpoint, and its comparison with a restore target
and with the checksums of the restored arrays.

Pure: it reads shapes, dtypes, routing labels and state types, never arrays or files,
so it is tested without Orbax.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from muon_optax import _routing
from muon_optax._adamw.backends import STATE_TYPES
from muon_optax._placement.shardings import mirrored_param
from muon_optax._util import paths
from muon_optax._version import __version__

FORMAT = 1  # version of the JSON record; bumped on incompatible changes
MAX_LISTED = 20  # differences listed in a mismatch error before "and N more"
_BACKEND_OF = {t: name for name, t in STATE_TYPES.items()}


def leaves(tree: Any) -> dict[str, dict]:
  """'/'-joined path -> {"shape", "dtype"} of every array leaf."""
  out = {}
  for path, x in paths.leaves_with_path(tree):
    if path in out:
      raise ValueError(f"two leaves share the path {path!r}; checkpoint paths must be unique.")
    out[path] = {"shape": list(jnp.shape(x)), "dtype": jnp.dtype(jnp.result_type(x)).name}
  return out


def adam_states(state: Any) -> dict[str, str]:
  """Path -> backend name of every AdamW state inside `state`."""
  is_adam = lambda x: type(x) in _BACKEND_OF
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_adam)
  return {paths.path_str(p): _BACKEND_OF[type(x)] for p, x in flat if is_adam(x)}


def _partitions(state: Any) -> list[tuple[str, optax.PartitionState]]:
  """(path, state) of every `muon(...)` partition inside `state`."""
  is_part = lambda x: (isinstance(x, optax.PartitionState)
                       and {_routing.MUON, _routing.ADAM} <= set(x.inner_states))
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_part)
  return [(paths.path_str(p), x) for p, x in flat if is_part(x)]


def _check_labels_fit_state(labels: dict[str, str], params: dict, state: Any) -> None:
  """Every branch whose state mirrors parameters (momentum, Adam moments) mirrors
  exactly the parameters with its label."""
  shapes = {name: rec["shape"] for name, rec in params.items()}
  for _, part in _partitions(state):
    for branch, inner in part.inner_states.items():
      held = {mirrored_param(path, jnp.shape(x), shapes)
              for path, x in paths.leaves_with_path(inner)} - {None}
      for name in params if held else ():  # a stateless branch: nothing to compare
        if (name in held) != (labels[name] == branch):
          raise ValueError(
              f"parameter {name!r} is labelled {labels[name]!r} by the checkpointer's labels, "
              f"but the optimizer state keeps it {'in' if name in held else 'out of'} "
              f"the {branch!r} branch. Give Checkpointer(routing=...) the routing given to "
              "muon(...).")


def _routing_record(params: Any, state: Any, routing: _routing.Routing) -> Optional[dict]:
  """Path -> {"label", "view"} of every parameter, or None if `state` holds no muon(...) state."""
  if not _partitions(state):
    return None
  try:
    label_tree = routing.labels(params)
    flat_labels = dict(paths.leaves_with_path(label_tree))
  except ValueError as e:
    raise ValueError(
        f"{e} (Checkpointer(routing=...) must be the routing given to muon(...).)") from None
  _check_labels_fit_state(flat_labels, leaves(params), state)
  record = {}
  for path, x in paths.leaves_with_path(params):
    view = routing.view(path, tuple(jnp.shape(x))) if flat_labels[path] == _routing.MUON else None
    if view is not None:
      # `blocks` only where the view cuts the fan-out: older records have no such field.
      fields = {k: v for k, v in view._asdict().items() if k != "blocks" or v != 1}
      view = {**fields, "matrices": view.describe(jnp.shape(x))}
    record[path] = {"label": flat_labels[path], "view": view}
  return record


def record(params: Any, opt_state: Any, routing: _routing.Routing) -> dict:
  """The JSON record of (params, opt_state): shape and dtype per path, routing label and
  matrix view per parameter, AdamW backend per AdamW state, format and version."""
  return {
      "format": FORMAT,
      "muon_optax_version": __version__,
      "params": leaves(params),
      "opt_state": leaves(opt_state),
      "routing": _routing_record(params, opt_state, routing),
      "adam_backends": adam_states(opt_state),
  }


def differences(what: str, saved: dict, current: dict, fields: tuple[str, ...]) -> list[str]:
  """Every difference between two path -> record maps, one line each, in path order."""
  lines = []
  for path in sorted(saved.keys() | current.keys()):
    if path not in current:
      lines.append(f"{what} {path!r} is in the checkpoint only")
    elif path not in saved:
      lines.append(f"{what} {path!r} is in the target only")
    else:
      for field in fields:
        old, new = saved[path].get(field), current[path].get(field)
        if old != new:
          lines.append(f"{what} {path!r} has {field} {_show(old)} in the checkpoint but "
                       f"{_show(new)} in the target")
  return lines


def _show(value: Any) -> str:
  return str(tuple(value)) if isinstance(value, list) else repr(value)


def listing(lines: list[str], noun: str = "difference") -> str:
  """'N <noun>s:' and the first MAX_LISTED lines, one per line, then how many more."""
  shown = "\n  ".join(lines[:MAX_LISTED])
  more = f"\n  ... and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else ""
  return f"{len(lines)} {noun}{'s' if len(lines) > 1 else ''}:\n  {shown}{more}"


def check_params_fit(saved: dict, params: dict, where: str) -> None:
  """Raises a ValueError listing what keeps the checkpoint's params from restoring into a
  params target of record `params` (`leaves`): tree, shapes, dtypes."""
  _check_format(saved, where)
  lines = differences("parameter", saved["params"], params, ("shape", "dtype"))
  if lines:
    raise ValueError(where + "does not fit the restore target: " + listing(lines))


def _check_format(saved: dict, where: str) -> None:
  if saved.get("format", 0) > FORMAT:
    raise ValueError(
        f"{where}was written by muon_optax {saved.get('muon_optax_version')} in a newer "
        "format; upgrade muon_optax to read it.")


# What follows a state mismatch when the params agree: most often another optimizer.
FRESH_STATE = ("The params agree, so the optimizer state is another optimizer's (or another "
               "chain's): to keep the params and start this optimizer afresh, restore the "
               "params alone, restore(params_target=...) without opt_state_target, then "
               "tx.init(params).")


def check_fits(saved: dict, current: dict, where: str) -> None:
  """Raises a ValueError listing what keeps checkpoint record `saved` from restoring into
  a target whose record is `current`: newer format, different
  params (tree, shape, dtype), routing labels, AdamW state places or state leaves."""
  _check_format(saved, where)
  lines = differences("parameter", saved["params"], current["params"], ("shape", "dtype"))
  if saved["routing"] and current["routing"]:  # labels of the parameters both trees hold
    both = saved["routing"].keys() & current["routing"].keys()
    lines += differences("parameter", {p: saved["routing"][p] for p in both},
                         {p: current["routing"][p] for p in both}, ("label",))
  hint = ""
  if not lines and saved["adam_backends"].keys() != current["adam_backends"].keys():
    lines.append(f"AdamW states at {sorted(saved['adam_backends'])} in the checkpoint but at "
                 f"{sorted(current['adam_backends'])} in the target")
    hint = "\n" + FRESH_STATE
  if not lines:  # state leaves differ only through the params; list them when those agree
    lines = differences("optimizer state leaf", saved["opt_state"], current["opt_state"],
                        ("shape", "dtype"))
    hint = "\n" + FRESH_STATE if lines else ""
  if lines:
    raise ValueError(where + "does not fit the restore target: " + listing(lines) + hint)


def checksum_differences(saved: dict, restored: dict) -> list[str]:
  """One line per array whose checksum after restore differs from the one saved; both
  map "params" and "opt_state" to path -> checksum."""
  lines = []
  for tree in [t for t in ("params", "opt_state") if t in saved]:
    for path, expected in sorted(saved[tree].items()):
      actual = restored[tree].get(path)
      if actual != expected:
        found = "no such leaf" if actual is None else f"checksum {actual:#010x}"
        lines.append(f"{tree} leaf {path!r}: {found} after restore, {expected:#010x} when saved")
  return lines
