"""The files of a step directory: an inventory written just before the step is
committed, the completeness check built on it, the removal of unlisted steps, and
which array a failed read names.

Orbax commits a step by renaming its temporary directory to the step's name, and by
default deletes an old step file by file where it stands, so a job killed mid-deletion
leaves a step that is still listed but partly gone. Here a step counts as a checkpoint
only if every file its inventory names is there with the recorded size; old and
incomplete steps leave the listed namespace in one rename, into `TRASH`, before any of
their files is removed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import NamedTuple, Optional

INVENTORY = "muon_optax_files.json"  # relative path -> [size, crc32 or None]
TRASH = ".deleted"  # Orbax's `todelete_subdir`: steps renamed here are emptied by us
# Step-level files Orbax rewrites or adds after the inventory is taken (commit time).
_LATE = {"_CHECKPOINT_METADATA", "commit_success.txt", INVENTORY}
_STEP_NAME = re.compile(r"^(0|[1-9]\d*)$")  # Orbax's standard step directory names
# Final step directory -> what to write into its temporary directory before the commit.
_BEFORE_COMMIT: dict[str, Callable[[str], None]] = {}


def before_commit(step_dir: str, write: Optional[Callable[[str], None]]) -> None:
  """Has the commit of `step_dir` first call `write(temporary step directory)`, in
  Orbax's commit thread, so that what it writes is in the inventory and is committed
  with the step, atomically (None: nothing)."""
  if write is None:
    _BEFORE_COMMIT.pop(os.path.realpath(step_dir), None)
  else:
    _BEFORE_COMMIT[os.path.realpath(step_dir)] = write


def _data_file(relative: str) -> bool:
  """Array data files (OCDBT's `d/` directories) are checked by the array checksums;
  the small metadata files around them get a CRC-32 of their bytes."""
  return "d" in relative.split(os.sep)[:-1]


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      crc = zlib.crc32(chunk, crc)
  return crc


def _walk(step_dir: str) -> Iterable[str]:
  for root, _, names in os.walk(step_dir):
    for name in names:
      yield os.path.relpath(os.path.join(root, name), step_dir)


def write_inventory(step_dir: str) -> None:
  """Records every file of `step_dir` with its size (and CRC-32 unless array data)."""
  files = {}
  for relative in sorted(_walk(step_dir)):
    if relative in _LATE:
      continue
    path = os.path.join(step_dir, relative)
    files[relative] = [os.path.getsize(path), None if _data_file(relative) else _crc32(path)]
  write_json(os.path.join(step_dir, INVENTORY), {"format": 1, "files": files})


def write_json(path: str, record: dict) -> None:
  """`record` as JSON at `path`, on disk (fsynced) before the commit that follows."""
  with open(path, "w") as f:
    json.dump(record, f)
    f.flush()
    os.fsync(f.fileno())


def read_inventory(step_dir: str) -> dict[str, list]:
  """The inventory's relative path -> [size, crc32 or None]; OSError or ValueError if it
  is missing or unreadable."""
  with open(os.path.join(step_dir, INVENTORY)) as f:
    return json.load(f)["files"]


def problems(step_dir: str, *, contents: bool = False, only: str = "") -> list[str]:
  """What keeps `step_dir` from being the complete step it was committed as: a missing
  or unreadable inventory, missing files, wrong sizes and, with `contents`, metadata
  files whose bytes changed. `only` restricts the check to files under that prefix."""
  try:
    inventory = read_inventory(step_dir)
  except (OSError, ValueError, KeyError, TypeError) as e:
    return [f"{os.path.join(step_dir, INVENTORY)}: no readable file inventory ({e})"]
  found = []
  for relative, (size, crc) in inventory.items():
    if not relative.startswith(only):
      continue
    path = os.path.join(step_dir, relative)
    try:
      actual = os.path.getsize(path)
    except OSError:
      found.append(f"{path}: missing")
      continue
    if actual != size:
      found.append(f"{path}: {actual} bytes, {size} when saved")
    elif contents and crc is not None and _crc32(path) != crc:
      found.append(f"{path}: its bytes differ from those saved (CRC-32 mismatch)")
  return found


class ReadFailure(NamedTuple):
  key: str  # the array's key in the store, e.g. "mlp.kernel"
  store: str  # the item directory holding the OCDBT store, e.g. ".../7/params"
  message: str  # TensorStore's own words


# TensorStore's error for a chunk it cannot read or decode.
_READ_ERROR = re.compile(r'Error reading "([^"/]+)/[^"]*" in OCDBT database at local file '
                         r'"([^"]+?)/?"')


def read_failure(error: BaseException) -> Optional[ReadFailure]:
  """The array and store behind a failed read, from an exception or its causes."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    match = _READ_ERROR.search(str(error))
    if match:
      return ReadFailure(match[1], match[2], str(error).split("; at byte")[0])
    error = error.__cause__ or error.__context__
  return None


def leaf_of(key: str, store: str, record: dict) -> tuple[str, str]:
  """(tree, path) of the array a store key names ("mlp.kernel" in .../params ->
  ("params", "mlp/kernel")), as far as the checkpoint's record tells."""
  tree = os.path.basename(store)
  paths = [p for p in record.get(tree, {}) if p.replace("/", ".") == key]
  return tree, paths[0] if len(paths) == 1 else key


def step_dirs(directory: str) -> dict[int, str]:
  """Step -> path of every directory named like a committed step."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return {}
  return {int(n): os.path.join(directory, n) for n in names
          if _STEP_NAME.match(n) and os.path.isdir(os.path.join(directory, n))}


def set_aside(step_dir: str) -> None:
  """Moves a step out of the listed namespace in one rename; `purge` removes it."""
  trash = os.path.join(os.path.dirname(step_dir), TRASH)
  os.makedirs(trash, exist_ok=True)
  os.rename(step_dir, os.path.join(trash, f"{os.path.basename(step_dir)}.{uuid.uuid4().hex}"))


def purge(directory: str) -> None:
  """Removes the trash: steps set aside by `set_aside` or retired by Orbax."""
  shutil.rmtree(os.path.join(directory, TRASH), ignore_errors=True)


@functools.cache
def temporary_path_class():
  """Orbax's atomic-rename commit, taking the inventory just before the rename, and
  recognizing a committed step only if its inventory checks out."""
  import orbax.checkpoint as ocp

  # Orbax commits each item directory (params, opt_state, meta) with the same class;
  # only step directories take an inventory.
  class InventoriedRename(ocp.path.atomicity.AtomicRenameTemporaryPath):

    async def finalize(self):
      if _STEP_NAME.match(self.get_final().name):
        write = _BEFORE_COMMIT.pop(os.path.realpath(os.fspath(self.get_final())), None)
        if write is not None:
          await asyncio.to_thread(write, os.fspath(self.get()))
        await asyncio.to_thread(write_inventory, os.fspath(self.get()))
      await super().finalize()

    @classmethod
    async def validate_final(cls, final_path):
      await super().validate_final(final_path)
      missing = problems(os.fspath(final_path)) if _STEP_NAME.match(final_path.name) else []
      if missing:
        raise ocp.path.atomicity_types.ValidationError(
            f"{final_path} is not a complete checkpoint: {'; '.join(missing[:3])}")

  return InventoriedRename
