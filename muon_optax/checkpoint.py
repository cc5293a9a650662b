"""Checkpoints of params and optimizer state with Orbax, restorable on any mesh.

A thin layer over `orbax.checkpoint.CheckpointManager`: every step directory holds
`params` and `opt_state` in Orbax's standard PyTree format, and `meta`, a JSON record
of both trees (shape and dtype per path, routing label and matrix view per parameter,
AdamW backend, muon_optax version) next to the user's own metadata.

Restoring reads arrays straight into an abstract target, `jax.eval_shape(tx.init,
params)` with the shardings of whatever mesh the job runs on now (`abstract_target`
builds it), so a checkpoint written on 8 devices restores on 4, 1, or fully replicated.
Before any array is read the record is checked against the target: a different tree,
shape, dtype or routing label is a ValueError naming the path and both values (Orbax
itself would silently cast a bfloat16 momentum to float32). A different AdamW backend
is converted with `convert_adam_state`. The state does not depend on the Newton–Schulz
preset, so `ns="jordan"` restores under `ns="polar_express"`.

Saves are atomic (Orbax writes into a temporary directory and renames it when done):
a job killed mid-save leaves the previous checkpoints intact; the half-written one is
never listed, and the next `Checkpointer` on the directory deletes it (in the background,
finished before its first save).

Orbax is imported on first use: `pip install orbax-checkpoint`.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from muon_optax import _adam_backends, _paths, _routing, _state_sharding
from muon_optax._matrix_view import ViewFn, view_fn

__all__ = ["Checkpointer", "Restored", "abstract_target"]

FORMAT = 1  # version of the JSON record; bumped on incompatible changes
_BACKEND_OF = {t: name for name, t in _adam_backends._STATE_TYPES.items()}


def _ocp():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError("muon_optax.checkpoint needs Orbax: pip install orbax-checkpoint") from e
  return ocp


class Restored(NamedTuple):
  """What `Checkpointer.restore` returns."""
  step: int
  params: Any  # the params target's structure, shardings and dtypes
  opt_state: Any  # the optimizer-state target's structure, shardings and dtypes
  metadata: dict  # the `metadata` given to `save`


# --- abstract targets ------------------------------------------------------------------

def _abstract(tree: Any) -> Any:
  """Arrays and ShapeDtypeStructs -> ShapeDtypeStructs that all carry a sharding."""
  default = SingleDeviceSharding(jax.devices()[0])

  def leaf(x):
    sharding = getattr(x, "sharding", None) or default
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)

  return jax.tree.map(leaf, tree)


def abstract_target(tx: optax.GradientTransformation, params: Any, mesh: Optional[Mesh] = None,
                    *, data_axis: str = "data") -> tuple[Any, Any]:
  """Abstract (params, opt_state) to restore into: shapes, dtypes and shardings only.

  Without a mesh everything lands on the default device. With a mesh, a parameter
  keeps its `NamedSharding` if it has one on this mesh (FSDP) and is replicated
  otherwise (ZeRO-1); the optimizer state is laid out by `state_shardings`. State
  that `tx` keeps in host memory (offload) is restored into host memory.

  Args:
    tx: the optimizer the job runs with now.
    params: params or `jax.ShapeDtypeStruct`s (only shapes, dtypes and shardings on
      `mesh` are used, so a freshly initialized model will do).
    mesh: the device mesh to restore onto, or None for one device.
    data_axis: the data-parallel axis of `mesh`.

  Returns:
    (params, opt_state) as pytrees of `jax.ShapeDtypeStruct` with shardings.

  Example:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> p, s = mo.checkpoint.abstract_target(mo.muon(mesh=mesh), params, mesh)
    >>> p["mlp"]["kernel"].sharding.spec
    PartitionSpec()
  """
  if mesh is None:
    device = SingleDeviceSharding(jax.devices()[0])
    param_sharding = lambda x: device
  else:
    def param_sharding(x):
      sharding = getattr(x, "sharding", None)
      keep = isinstance(sharding, NamedSharding) and sharding.mesh == mesh
      return sharding if keep else NamedSharding(mesh, P())

  abstract_params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=param_sharding(x)),
      params)
  state, on_host = _init_shapes(tx, abstract_params)
  if mesh is None:
    shardings = jax.tree.map(lambda _: device, state)
  else:
    shardings = _state_sharding.state_shardings(tx, abstract_params, mesh, data_axis)
  abstract_state = jax.tree.map(
      lambda x, s, host: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=s.with_memory_kind("pinned_host") if host else s),
      state, shardings, on_host)
  return abstract_params, abstract_state


def _init_shapes(tx: optax.GradientTransformation, params: Any) -> tuple[Any, Any]:
  """`tx.init(params)` abstractly, and per leaf whether init puts it in host memory.

  Offloaded state (`adam_backend="offload"`, `offload_momentum=True`) must be read
  back into host memory: it may not fit on the device. `jax.eval_shape` drops the
  memory space; the traced program keeps it.
  """
  traced = jax.jit(tx.init).trace(params)
  on_host = [getattr(a, "memory_space", None) == jax.memory.Space.Host
             for a in traced.jaxpr.out_avals]
  return traced.out_info, jax.tree.structure(traced.out_info).unflatten(on_host)


# --- the JSON record -------------------------------------------------------------------

def _leaves(tree: Any) -> dict[str, dict]:
  """'/'-joined path -> {"shape", "dtype"} of every array leaf."""
  out = {}
  for path, x in _paths.leaves_with_path(tree):
    if path in out:
      raise ValueError(f"two leaves share the path {path!r}; checkpoint paths must be unique.")
    out[path] = {"shape": list(jnp.shape(x)), "dtype": jnp.dtype(jnp.result_type(x)).name}
  return out


def _adam_states(state: Any) -> dict[str, str]:
  """Path -> backend name of every AdamW state inside `state`."""
  is_adam = lambda x: type(x) in _BACKEND_OF
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_adam)
  return {_paths.path_str(p): _BACKEND_OF[type(x)] for p, x in flat if is_adam(x)}


def _partitions(state: Any) -> list[tuple[str, optax.PartitionState]]:
  """(path, state) of every `muon(...)` partition inside `state`."""
  is_part = lambda x: (isinstance(x, optax.PartitionState)
                       and {_routing.MUON, _routing.ADAM} <= set(x.inner_states))
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_part)
  return [(_paths.path_str(p), x) for p, x in flat if is_part(x)]


def _check_labels_fit_state(labels: dict[str, str], params: dict, state: Any) -> None:
  """Every branch whose state mirrors parameters (momentum, per-leaf Adam moments)
  mirrors exactly the parameters with its label."""
  for _, part in _partitions(state):
    for branch, inner in part.inner_states.items():
      held = set()
      for path, x in _paths.leaves_with_path(inner):
        parts = path.split("/")
        for k in range(len(parts)):  # the longest suffix naming a parameter of this shape
          name = "/".join(parts[k:])
          if name in params and params[name]["shape"] == list(jnp.shape(x)):
            held.add(name)
            break
      for name in params if held else ():  # flat buffers or no state: nothing to compare
        if (name in held) != (labels[name] == branch):
          raise ValueError(
              f"parameter {name!r} is labelled {labels[name]!r} by the checkpointer's labels, "
              f"but the optimizer state keeps it {'in' if name in held else 'out of'} "
              f"the {branch!r} branch. Give Checkpointer(labels=...) the labels given to "
              "muon(...).")


def _routing_record(params: Any, state: Any, labels: _routing.Labels, views: ViewFn
                    ) -> Optional[dict]:
  """Path -> {"label", "view"} of every parameter, or None if `state` holds no muon(...) state."""
  if not _partitions(state):
    return None
  try:
    label_tree = _routing.resolve_labels(labels, params)
    flat_labels = dict(_paths.leaves_with_path(label_tree))
  except ValueError as e:
    raise ValueError(
        f"{e} (Checkpointer(labels=...) must be the labels given to muon(...).)") from None
  _check_labels_fit_state(flat_labels, _leaves(params), state)
  record = {}
  for path, x in _paths.leaves_with_path(params):
    view = views(path, tuple(jnp.shape(x))) if flat_labels[path] == _routing.MUON else None
    if view is not None:
      view = {**view._asdict(), "matrices": view.describe(jnp.shape(x))}
    record[path] = {"label": flat_labels[path], "view": view}
  return record


def _mismatch(what: str, saved: dict, current: dict, fields: tuple[str, ...]) -> Optional[str]:
  """The first difference between two path -> record maps, in words, or None."""
  missing = [p for p in saved if p not in current]
  extra = [p for p in current if p not in saved]
  if missing or extra:
    more = " (first 5 shown)" if max(len(missing), len(extra)) > 5 else ""
    return (f"{what} trees differ: in the checkpoint only: {missing[:5]}; in the target "
            f"only: {extra[:5]}{more}")
  for path, rec in saved.items():
    for field in fields:
      if rec.get(field) != current[path].get(field):
        return (f"{what} {path!r} has {field} {_show(rec.get(field))} in the checkpoint but "
                f"{_show(current[path].get(field))} in the target")
  return None


def _show(value: Any) -> str:
  return str(tuple(value)) if isinstance(value, list) else repr(value)


# --- the checkpointer ------------------------------------------------------------------

class Checkpointer:
  """Saves and restores (params, optimizer state) with Orbax, keeping the last few steps.

  Args:
    directory: where step directories are written (created if needed).
    max_to_keep: how many of the most recent checkpoints to keep; None keeps all.
    async_save: write in a background thread; `save` returns once the arrays are
      copied off the devices. `wait()` blocks until the writes are committed.
    routing (or its shorthands labels, views, per_head): the routing given to `muon`
      (None: the defaults), e.g. from `infer_routing`. It is recorded with each
      checkpoint and used to convert the AdamW state between backends on restore.
    data_axis: the data-parallel mesh axis along which state converted from another
      AdamW backend is laid out while it is read.

  Example:
    >>> import jax, jax.numpy as jnp, tempfile, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> tx = mo.muon(0.02)
    >>> state = tx.init(params)
    >>> with mo.checkpoint.Checkpointer(tempfile.mkdtemp()) as ckpt:
    ...   ckpt.save(100, params, state, metadata={"loss": 1.5})
    ...   ckpt.wait()
    ...   p, s = mo.checkpoint.abstract_target(tx, params)  # or with a mesh
    ...   step, params, state, meta = ckpt.restore(params_target=p, opt_state_target=s)
    >>> step, meta
    (100, {'loss': 1.5})
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: Optional[int] = 3,
               async_save: bool = True, labels: _routing.Labels = None,
               views: Optional[ViewFn] = None, per_head: bool = False, data_axis: str = "data",
               routing: Optional[_routing.Routing] = None):
    ocp = _ocp()
    self.directory = os.path.abspath(os.fspath(directory))
    routing = _routing.as_routing(routing=routing, labels=labels, views=views, per_head=per_head)
    self.labels, self.data_axis = routing, data_axis
    self.views = routing.view
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)  # drop what a killed save left behind
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def record(self, params: Any, opt_state: Any) -> dict:
    """The JSON record `save` writes beside (params, opt_state), without user metadata."""
    from muon_optax import __version__
    return {
        "format": FORMAT,
        "muon_optax_version": __version__,
        "params": _leaves(params),
        "opt_state": _leaves(opt_state),
        "routing": _routing_record(params, opt_state, self.labels, self.views),
        "adam_backends": _adam_states(opt_state),
    }

  def save(self, step: int, params: Any, opt_state: Any, *,
           metadata: Optional[dict] = None) -> None:
    """Saves params, optimizer state and the JSON record (plus `metadata`) as `step`.

    With `async_save` the arrays are written in the background; call `wait()` before
    reading the checkpoint back or exiting. Older checkpoints beyond `max_to_keep`
    are deleted once this one is committed.
    """
    ocp = _ocp()
    record = {**self.record(params, opt_state), "step": int(step), "user": metadata or {}}
    try:
      json.dumps(record)
    except TypeError as e:
      raise ValueError(f"checkpoint metadata must be JSON-serializable: {e}") from None
    self._manager.save(int(step), args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(record)))

  def metadata(self, step: Optional[int] = None) -> dict:
    """The JSON record of checkpoint `step` (default: the latest); its "user" entry
    holds the `metadata` given to `save`."""
    ocp = _ocp()
    step = self._step(step)
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: Optional[int] = None, *, params_target: Any, opt_state_target: Any
              ) -> Restored:
    """Reads checkpoint `step` (default: the latest) into the given targets.

    Args:
      step: which checkpoint; None for the latest.
      params_target, opt_state_target: arrays or `jax.ShapeDtypeStruct`s giving the
        structure, dtypes and shardings to restore into, e.g. from `abstract_target`.
        A leaf without a sharding lands on the default device.

    Returns:
      `Restored(step, params, opt_state, metadata)`.

    Raises:
      FileNotFoundError: no such checkpoint.
      ValueError: the checkpoint's tree, a shape, a dtype or a routing label differs
        from the target's; the message names the path and both values.
    """
    ocp = _ocp()
    step = self._step(step)
    saved = self.metadata(step)
    if saved.get("format", 0) > FORMAT:
      raise ValueError(
          f"checkpoint step {step} in {self.directory} was written by muon_optax "
          f"{saved.get('muon_optax_version')} in a newer format; upgrade muon_optax to read it.")
    params_t, state_t = _abstract(params_target), _abstract(opt_state_target)
    current = self.record(params_t, state_t)
    where = f"checkpoint step {step} in {self.directory} does not fit the restore target: "
    problem = _mismatch("parameter", saved["params"], current["params"], ("shape", "dtype"))
    if problem is None and saved["routing"] and current["routing"]:
      problem = _mismatch("parameter", saved["routing"], current["routing"], ("label",))
    if problem:
      raise ValueError(where + problem)

    layout, convert_to = state_t, None
    if saved["adam_backends"] != current["adam_backends"]:
      layout, convert_to = self._saved_layout(saved, current, params_t, state_t, where)
    problem = _mismatch("optimizer state leaf", saved["opt_state"], _leaves(layout),
                        ("shape", "dtype"))
    if problem:
      raise ValueError(where + problem)

    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_t), opt_state=ocp.args.StandardRestore(layout)))
    opt_state = restored["opt_state"]
    if convert_to is not None:
      opt_state = _adam_backends.convert_adam_state(
          opt_state, params_t, convert_to, labels=self._label_tree(params_t))
      opt_state = jax.device_put(opt_state, jax.tree.map(lambda x: x.sharding, state_t))
    return Restored(step, restored["params"], opt_state, saved.get("user", {}))

  def _label_tree(self, params: Any) -> Any:
    return _routing.resolve_labels(self.labels, params)

  def _saved_layout(self, saved: dict, current: dict, params: Any, state: Any, where: str
                    ) -> tuple[Any, str]:
    """The target in the checkpoint's AdamW backend, and the backend to convert back to."""
    old, new = set(saved["adam_backends"].values()), set(current["adam_backends"].values())
    same_places = saved["adam_backends"].keys() == current["adam_backends"].keys()
    if not same_places or len(old) != 1 or len(new) != 1:
      raise ValueError(
          where + f"AdamW states {saved['adam_backends']} in the checkpoint, "
          f"{current['adam_backends']} in the target; only one backend changing for another "
          "at the same places can be converted.")
    (old,), (new,) = old, new
    labels = self._label_tree(params)
    unsharded = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    layout = jax.eval_shape(
        lambda s: _adam_backends.convert_adam_state(s, unsharded(params), old, labels=labels),
        unsharded(state))
    return _paths.map_with_path(self._reading_sharding(state), layout), new

  def _reading_sharding(self, target: Any):
    """Sharding of a leaf of the checkpoint's layout while it is read and converted.

    Leaves the conversion keeps get the target's sharding, others are laid out along
    the data axis; both on an Auto-typed copy of the target's mesh, because the
    conversion's reshapes have no output sharding to give on an Explicit one.
    """
    shardings = {p: (x.shape, x.sharding) for p, x in _paths.leaves_with_path(target)}
    fallback = next((s for _, s in shardings.values()), SingleDeviceSharding(jax.devices()[0]))
    mesh = next((s.mesh for _, s in shardings.values() if isinstance(s, NamedSharding)), None)
    if mesh is not None:
      mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))

    def sharding(path, leaf):
      shape, s = shardings.get(path, (None, fallback))
      if mesh is None:
        s = s if shape == leaf.shape else fallback
      elif shape == leaf.shape and isinstance(s, NamedSharding):
        s = NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)
      elif self.data_axis in mesh.axis_names:
        spec = _state_sharding._add_data_axis(leaf.shape, P(), mesh, self.data_axis)
        s = NamedSharding(mesh, spec)
      else:
        s = NamedSharding(mesh, P())
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)

    return sharding

  def _step(self, step: Optional[int]) -> int:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    elif step not in self.all_steps():
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory}; it has {list(self.all_steps())}")
    return int(step)

  def latest_step(self) -> Optional[int]:
    """The newest committed step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every committed step still kept, oldest first."""
    return sorted(self._manager.all_steps())

  def wait(self) -> None:
    """Blocks until every pending save is written and committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases Orbax's resources."""
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
