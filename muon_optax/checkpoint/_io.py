"""Orbax I/O of checkpoints: `Checkpointer` and `abstract_target`."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from muon_optax import _routing
from muon_optax._placement.shardings import state_shardings
from muon_optax.checkpoint import _checksum, _files, _record


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

  Examples:
    >>> import jax, jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> p, s = mo.checkpoint.abstract_target(mo.muon(mesh=mesh), params, mesh)
    >>> p["mlp"]["kernel"].sharding.spec == jax.P()
    True
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
    shardings = state_shardings(tx, abstract_params, mesh, data_axis)
  abstract_state = jax.tree.map(
      lambda x, s, host: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=s.with_memory_kind("pinned_host") if host else s),
      state, shardings, on_host)
  return abstract_params, abstract_state


def _init_shapes(tx: optax.GradientTransformation, params: Any) -> tuple[Any, Any]:
  """`tx.init(params)` abstractly, and per leaf whether init puts it in host memory.

  Offloaded state (`AuxAdam(backend="offload")`, `offload_momentum=True`) must be read
  back into host memory: it may not fit on the device. `jax.eval_shape` drops the
  memory space; the traced program keeps it.
  """
  traced = jax.jit(tx.init).trace(params)
  on_host = [getattr(a, "memory_space", None) == jax.memory.Space.Host
             for a in traced.jaxpr.out_avals]
  return traced.out_info, jax.tree.structure(traced.out_info).unflatten(on_host)


class CorruptCheckpointError(OSError):
  """A listed checkpoint whose files or arrays differ from what `save` wrote."""


class Checkpointer:
  """Saves and restores (params, optimizer state) with Orbax, keeping the last few steps.

  Args:
    directory: where step directories are written (created if needed).
    max_to_keep: how many of the most recent checkpoints to keep; None keeps all.
    async_save: write in a background thread; `save` returns once the arrays are
      copied off the devices. `wait()` blocks until the writes are committed.
    routing: the `routing=` given to `muon` (a `Routing`, e.g. from `infer_routing`, or
      labels as `optax.partition` takes them; None: the default name rules). It is
      recorded with each checkpoint and checked on restore.

  Examples:
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
               async_save: bool = True, routing: Any = None):
    ocp = _ocp()
    self.directory = os.path.abspath(os.fspath(directory))
    self.routing = _routing.as_routing(routing)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # drop what a killed save left behind
        todelete_subdir=_files.TRASH,  # retire an old step in one rename, not file by file
        temporary_path_class=_files.temporary_path_class())  # list complete steps only
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._async = async_save
    self._primary = jax.process_index() == 0  # the host that commits and deletes
    if self._primary:
      self._remove_unlisted()

  def _remove_unlisted(self) -> None:
    """Removes step directories that are not listed (incomplete: a killed job's), which
    would otherwise block saving their step, and what earlier runs left in the trash."""
    listed = set(self.all_steps())
    for step, path in _files.step_dirs(self.directory).items():
      if step not in listed:
        _files.set_aside(path)
    _files.purge(self.directory)

  def record(self, params: Any, opt_state: Any) -> dict:
    """The JSON record `save` writes beside (params, opt_state), without user metadata."""
    return _record.record(params, opt_state, self.routing)

  def save(self, step: int, params: Any, opt_state: Any, *,
           metadata: Optional[dict] = None, checksums: bool = True) -> None:
    """Saves params, optimizer state and the JSON record (plus `metadata`) as `step`.

    With `async_save` the arrays are written in the background; call `wait()` before
    reading the checkpoint back or exiting. Older checkpoints beyond `max_to_keep`
    are retired once this one is committed. With `checksums` (the default) the record
    holds a checksum of every array, which `restore` verifies; computing them reads
    each array once on the devices that hold it.
    """
    ocp = _ocp()
    record = {**self.record(params, opt_state), "step": int(step), "user": metadata or {}}
    try:
      json.dumps(record)
    except TypeError as e:
      raise ValueError(f"checkpoint metadata must be JSON-serializable: {e}") from None
    self._settle()
    if checksums:
      # Hashed on the devices while Orbax writes; the sums go into the step just before
      # its commit (where the inventory records their file's CRC-32).
      pending = _checksum.dispatch([params, opt_state])
      record["checksums"] = {"algorithm": _checksum.ALGORITHM, "file": _checksum.FILE}
      if self._primary:
        _files.before_commit(self._step_dir(step), functools.partial(
            _checksum.write, trees=("params", "opt_state"), pending=pending))
    saved = self._manager.save(int(step), args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(record)))
    if not saved:  # Orbax declined the step: nothing will be committed
      _files.before_commit(self._step_dir(step), None)
    if not self._async:
      self._settle()

  def _settle(self) -> None:
    """Waits for the save in flight, then empties the trash of the steps it retired.
    Nothing renames into the trash while no save is in flight."""
    self._manager.wait_until_finished()
    if self._primary:
      _files.purge(self.directory)

  def metadata(self, step: Optional[int] = None) -> dict:
    """The JSON record of checkpoint `step` (default: the latest); its "user" entry
    holds the `metadata` given to `save`.

    Raises:
      FileNotFoundError: no such checkpoint.
      CorruptCheckpointError: the record's bytes changed since it was saved, or it is
        not valid JSON; the message names the file and the step.
    """
    ocp = _ocp()
    step = self._step(step)
    self._check_files(step, contents=True, only="meta" + os.sep)
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CorruptCheckpointError(
          f"checkpoint step {step} in {self.directory} is corrupted: its record "
          f"{self._record_file(step)} is not valid JSON ({e})") from None

  def _record_file(self, step: int) -> str:
    """The file holding the JSON record of `step` (its directory if that is unclear)."""
    directory = os.path.join(self._step_dir(step), "meta")
    names = [n for n in sorted(os.listdir(directory)) if n != "commit_success.txt"]
    return os.path.join(directory, names[0]) if len(names) == 1 else directory

  def restore(self, step: Optional[int] = None, *, params_target: Any,
              opt_state_target: Any = None, verify: bool = True) -> Restored:
    """Reads checkpoint `step` (default: the latest) into the given targets.

    Args:
      step: which checkpoint; None for the latest.
      params_target: arrays or `jax.ShapeDtypeStruct`s giving the structure, dtypes
        and shardings to restore into, e.g. from `abstract_target`. A leaf without a
        sharding lands on the default device. With no
        `opt_state_target`, the params alone are read (and `opt_state` is None): the
        way to keep a run's params and start another optimizer afresh, with
        `tx.init(params)`.
      opt_state_target: the same for the optimizer state.
      verify: check the restored arrays against the checksums saved with them (if
        `save` wrote any), and the checkpoint's metadata files against their CRC-32s.

    Returns:
      `Restored(step, params, opt_state, metadata)`.

    Raises:
      FileNotFoundError: no such checkpoint.
      ValueError: the checkpoint's tree, a shape, a dtype or a routing label differs
        from the target's; the message lists each differing path with both values
        (the first 20, then how many more).
      CorruptCheckpointError: a file of the checkpoint is missing, or it or an array
        read from it differs from what was saved; the message names the step, each
        differing leaf path or file, and the directory holding the arrays.
    """
    step = self._step(step)
    self._check_files(step, contents=verify)
    saved = self.metadata(step)
    where = f"checkpoint step {step} in {self.directory} "
    params_t = _abstract(params_target)
    trees = {"params": params_t}
    if opt_state_target is None:
      _record.check_params_fit(saved, _record.leaves(params_t), where)
    else:
      trees["opt_state"] = _abstract(opt_state_target)
      # The AdamW backends share one (count, mu, nu) layout, so a state saved under one
      # reads straight into another's target.
      _record.check_fits(saved, self.record(params_t, trees["opt_state"]), where)
    restored = self._read(step, trees, saved)
    if verify and "checksums" in saved:
      self._verify(step, saved["checksums"], restored)
    return Restored(step, restored["params"], restored.get("opt_state"), saved.get("user", {}))

  def _read(self, step: int, trees: dict, saved: dict) -> dict:
    """The trees of checkpoint `step`, each read into its target."""
    ocp = _ocp()
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          **{tree: ocp.args.StandardRestore(target) for tree, target in trees.items()}))
    except Exception as e:  # a data file that no longer decodes; anything else as it is
      failure = _files.read_failure(e)
      if failure is None:
        raise
      tree, path = _files.leaf_of(failure.key, failure.store, saved)
      raise CorruptCheckpointError(
          f"checkpoint step {step} in {self.directory} is corrupted: {tree} leaf {path!r} "
          f"could not be read from {failure.store} ({failure.message})") from e

  def _verify(self, step: int, saved: dict, restored: dict) -> None:
    """A CorruptCheckpointError listing the restored arrays whose checksum differs."""
    if saved.get("algorithm") != _checksum.ALGORITHM:
      raise ValueError(f"checkpoint step {step} in {self.directory} has checksums of kind "
                       f"{saved.get('algorithm')!r}; restore with verify=False, or upgrade "
                       "muon_optax to check them.")
    if "file" in saved:
      try:
        saved = _checksum.read(self._step_dir(step))
      except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"checkpoint step {step} in {self.directory} is corrupted: its checksums "
            f"cannot be read ({e})") from None
    trees = [t for t in ("params", "opt_state") if t in restored]
    computed = dict(zip(trees, _checksum.checksums_of([restored[t] for t in trees])))
    lines = _record.checksum_differences({t: saved[t] for t in trees}, computed)
    if lines:
      trees = sorted({line.split(" ", 1)[0] for line in lines})
      where = " and ".join(os.path.join(self._step_dir(step), t) for t in trees)
      raise CorruptCheckpointError(
          f"checkpoint step {step} in {self.directory} is corrupted: arrays read back differ "
          f"from those saved ({where} holds them, in OCDBT data files under d/ and "
          f"ocdbt.process_*/d/): " + _record.listing(lines, "damaged array"))

  def _check_files(self, step: int, *, contents: bool, only: str = "") -> None:
    """A CorruptCheckpointError naming the files of `step` that are missing, resized or,
    with `contents`, changed (metadata files only; arrays are checked by checksum)."""
    lines = _files.problems(self._step_dir(step), contents=contents, only=only)
    if lines:
      raise CorruptCheckpointError(
          f"checkpoint step {step} in {self.directory} is corrupted: "
          + _record.listing(lines, "damaged file"))

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

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
    """The newest complete step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every complete step still kept, oldest first."""
    return sorted(self._manager.all_steps())

  def wait(self) -> None:
    """Blocks until every pending save is written and committed."""
    self._settle()

  def close(self) -> None:
    """Waits for pending saves and releases Orbax's resources."""
    self._manager.close()
    if self._primary:
      _files.purge(self.directory)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
