"""A step's files: a listed step always restores after a kill, the inventory finds
missing, resized and changed files, and a damaged array or record is named with its
step, leaf and file."""

import json
import os
import re
import shutil
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest
from checkpoint_case import (
  assert_equal,
  fill,
  kill_when_marked,
  make_params,
  make_tx,
  saved_at,
  tree_equal,
)

from muon_optax._util import paths
from muon_optax.checkpoint import (
  Checkpointer,
  CorruptCheckpointError,
  _checksum,
  _files,
  abstract_target,
)

pytest.importorskip("orbax.checkpoint")


# The writer saves step 1, then stalls the commit of step 2 (all data written, the
# directory not yet renamed) and signals; the test kills it there with SIGKILL.
WRITER = """
import asyncio, pathlib, sys
sys.path.insert(0, {tests!r})
import jax, orbax.checkpoint as ocp
import checkpoint_case as t
directory, marker = sys.argv[1:]
params, tx = t.make_params(), t.make_tx()
ckpt = t.Checkpointer(directory)
ckpt.save(1, params, tx.init(params))
ckpt.wait()

async def stall(self):
  pathlib.Path(marker).touch()
  await asyncio.sleep(600)

ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = stall
ckpt.save(2, jax.tree.map(lambda x: x + 1, params), tx.init(params))
ckpt.wait()
"""


def test_killed_save_leaves_the_previous_checkpoint(tmp_path):
  directory, marker = tmp_path / "ckpt", tmp_path / "stalled"
  script = WRITER.format(tests=os.path.dirname(__file__))
  with open(tmp_path / "writer.log", "w+") as log:  # a file: a full pipe would stall it
    proc = subprocess.Popen([sys.executable, "-c", script, str(directory), str(marker)],
                            stdout=log, stderr=subprocess.STDOUT)
    kill_when_marked(proc, marker, log)

  leftovers = [p.name for p in directory.iterdir() if p.name != "1"]
  assert any(name.startswith("2.") and "tmp" in name for name in leftovers), leftovers
  params, tx = make_params(), make_tx()
  target = abstract_target(tx, params)
  with Checkpointer(directory) as ckpt:
    assert ckpt.all_steps() == [1]
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
    assert restored.step == 1
    assert_equal(restored.params, params)
    assert_equal(restored.opt_state, tx.init(params))
    ckpt.save(2, params, tx.init(params))  # the resumed job writes step 2 again
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
  # Removal starts when a Checkpointer opens the directory and ends before its first save.
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


def test_incomplete_steps_are_not_listed_and_do_not_block_saving(tmp_path):
  params, tx = make_params(), make_tx()
  target = abstract_target(tx, params)
  states = {step: fill(target[1], step) for step in range(2, 7)}
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    for step in (2, 3, 4):
      ckpt.save(step, params, states[step])
  # Step 2 partly deleted, as a kill during Orbax's in-place deletion leaves it; step 5
  # partly written (a copy cut short); step 6 a copy that lacks its file inventory.
  for path in sorted((tmp_path / "2" / "opt_state").rglob("*"))[::2]:
    if path.is_file():
      path.unlink()
  shutil.copytree(tmp_path / "4", tmp_path / "5")
  for path in (tmp_path / "5" / "params").rglob("*"):
    if path.is_file() and path.parent.name == "d":
      path.unlink()
  shutil.copytree(tmp_path / "4", tmp_path / "6")
  (tmp_path / "6" / _files.INVENTORY).unlink()
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
    assert restored.step == 4
    assert_equal(restored.opt_state, states[4])
    ckpt.save(5, params, states[5])  # the step a partial copy had taken
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4, 5]
    assert_equal(ckpt.restore(5, params_target=target[0], opt_state_target=target[1]).opt_state,
                 states[5])
    lost = next(p for p in (tmp_path / "3" / "params").rglob("*") if p.parent.name == "d")
    lost.unlink()  # a listed step damaged after the listing: named, not read
    with pytest.raises(CorruptCheckpointError, match=f"step 3 .*damaged file:\n  {lost}: missing"):
      ckpt.restore(3, params_target=target[0], opt_state_target=target[1])
  assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4", "5"]


def flip_bytes(directory, where):
  """Flips bytes of the largest array data file under `directory`: a few in the middle
  (the stored values change) or the first (the file no longer decodes)."""
  path = max((p for p in directory.rglob("*") if p.parent.name == "d"),
             key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  for offset in {"middle": (middle // 2, middle, middle + 5), "start": (0,)}[where]:
    data[offset] ^= 0x5A
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("tree, where", [
    ("params", "middle"), ("opt_state", "middle"), ("params", "start")])
def test_flipped_bytes_of_an_array_file_are_detected(tmp_path, tree, where):
  params, tx = make_params(), make_tx()
  target = abstract_target(tx, params)
  saved = {"params": params, "opt_state": fill(target[1], 0)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(7, saved["params"], saved["opt_state"])
    ckpt.wait()
  flip_bytes(tmp_path / "7" / tree, where)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError) as error:
      ckpt.restore(params_target=target[0], opt_state_target=target[1])
    message = str(error.value)
    if where == "middle":  # without the checksums the wrong values go unnoticed
      unverified = ckpt.restore(params_target=target[0], opt_state_target=target[1], verify=False)
      assert not tree_equal(unverified._asdict()[tree], saved[tree])
  assert message.startswith(f"checkpoint step 7 in {tmp_path} is corrupted: ")
  saved_paths = dict(paths.leaves_with_path(saved[tree]))
  named = re.findall(rf"{tree} leaf '([^']+)'", message)
  assert named and set(named) <= set(saved_paths), message
  store = tmp_path / "7" / tree
  assert str(store) in message
  if where == "start":
    assert f"leaf {named[0]!r} could not be read from {store} (" in message


@pytest.mark.parametrize("damage", ["changed bytes", "invalid JSON"])
def test_a_corrupt_record_names_its_file_and_step(tmp_path, damage):
  params, tx = make_params(), make_tx()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, params, tx.init(params))
    ckpt.wait()
  record = tmp_path / "3" / "meta" / "metadata"
  text = record.read_bytes()
  record.write_bytes(b"{" + text[2:] + b" ")  # same size
  if damage == "invalid JSON":  # written wrong before the commit: its CRC-32 agrees
    inventory = tmp_path / "3" / _files.INVENTORY
    files = json.loads(inventory.read_text())
    files["files"]["meta/metadata"][1] = zlib.crc32(record.read_bytes())
    inventory.write_text(json.dumps(files))
  expected = {"changed bytes": f"{record}: its bytes differ from those saved",
              "invalid JSON": f"its record {record} is not valid JSON"}[damage]
  target = abstract_target(tx, params)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError, match=f"(?s)step 3 in {tmp_path} is corrupted: .*"
                       + re.escape(expected)):
      ckpt.metadata()
    with pytest.raises(CorruptCheckpointError, match=re.escape(expected)):
      ckpt.restore(params_target=target[0], opt_state_target=target[1])


def rewrite_in_inventory(step_dir, relative: str, data: bytes) -> None:
  """Writes `data` to a step's file and records its size and CRC-32 in the inventory, as
  if the step had been saved so."""
  (step_dir / relative).write_bytes(data)
  inventory = step_dir / _files.INVENTORY
  files = json.loads(inventory.read_text())
  files["files"][relative] = [len(data), zlib.crc32(data)]
  inventory.write_text(json.dumps(files))


def test_the_checksums_are_committed_with_the_step_and_checked(tmp_path):
  params, tx = make_params(), make_tx()
  target = abstract_target(tx, params)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(4, params, tx.init(params))
    ckpt.wait()
  sums = tmp_path / "4" / _checksum.FILE
  assert json.loads(sums.read_text())["params"] == _checksum.checksums(params)
  assert _checksum.FILE in _files.read_inventory(tmp_path / "4")  # its CRC-32 is checked
  text = sums.read_bytes()
  sums.write_bytes(text[:-2] + b"0}")  # same size
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError, match=re.escape(
        f"{sums}: its bytes differ from those saved")):
      ckpt.restore(params_target=target[0], opt_state_target=target[1])


def test_arrays_donated_as_soon_as_save_returns_still_check_out(tmp_path):
  # The checksums are still being computed when save returns; donating the arrays to the
  # next step must not change what they hash.
  params, tx = make_params(), make_tx()
  state = tx.init(params)
  target = abstract_target(tx, params)
  saved = jax.tree.map(lambda x: np.array(x, copy=True), params)
  step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 + 7, p), donate_argnums=0)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(6, params, state)
    step(params)  # the saved arrays donated while their checksums may still be computed
    ckpt.wait()
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  assert_equal(restored.params, saved)


def test_checksums_held_in_the_record_are_still_checked(tmp_path):
  """Checkpoints whose JSON record holds the checksums itself (as saved before they
  moved to a file of their own) verify as before."""
  params, tx = make_params(), make_tx()
  state = tx.init(params)
  target = abstract_target(tx, params)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, params, state, checksums=False)
    ckpt.wait()
  record = json.loads((tmp_path / "5" / "meta" / "metadata").read_text())
  sums = _checksum.checksums_of([params, state])
  inline = {"algorithm": _checksum.ALGORITHM, "params": sums[0], "opt_state": sums[1]}
  rewrite_in_inventory(tmp_path / "5", "meta/metadata",
                       json.dumps({**record, "checksums": inline}).encode())
  with Checkpointer(tmp_path) as ckpt:
    assert_equal(ckpt.restore(params_target=target[0], opt_state_target=target[1]).params,
                 params)
  leaf = next(iter(sums[0]))
  inline["params"][leaf] ^= 1
  rewrite_in_inventory(tmp_path / "5", "meta/metadata",
                       json.dumps({**record, "checksums": inline}).encode())
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"params leaf {leaf!r}")):
      ckpt.restore(params_target=target[0], opt_state_target=target[1])


# Saves steps `latest + 1, latest + 2, ...` until killed: params + step and a state
# filled from the step, so any restored step can be checked against what was saved.
SAVER = """
import pathlib, sys
sys.path.insert(0, {tests!r})
import checkpoint_case as t
directory, marker = sys.argv[1:]
params, tx = t.make_params(), t.make_tx()
target = t.abstract_target(tx, params)
ckpt = t.Checkpointer(directory, max_to_keep=2)
step = (ckpt.latest_step() or 0) + 1
ckpt.save(step, *t.saved_at(step, params, target[1]))
ckpt.wait()
pathlib.Path(marker).touch()  # a step of this run is committed: kill from now on
while True:
  step += 1
  ckpt.save(step, *t.saved_at(step, params, target[1]))
"""


@pytest.mark.slow
def test_every_listed_step_restores_after_kills_at_random_moments(tmp_path):
  rng = np.random.default_rng(0)
  directory, marker = tmp_path / "ckpt", tmp_path / "saved"
  script = SAVER.format(tests=os.path.dirname(__file__))
  params, tx = make_params(), make_tx()
  target = abstract_target(tx, params)
  latest = 0
  for _ in range(4):
    marker.unlink(missing_ok=True)
    with open(tmp_path / "saver.log", "w+") as log:  # a file: a full pipe would stall it
      proc = subprocess.Popen([sys.executable, "-c", script, str(directory), str(marker)],
                              stdout=log, stderr=subprocess.STDOUT)
      # Somewhere in a save, a commit or a deletion.
      kill_when_marked(proc, marker, log, pause=rng.uniform(0, 1.5))
    with Checkpointer(directory, max_to_keep=2) as ckpt:
      # The step the run committed before the kill window survives (or a later one).
      assert ckpt.latest_step() > latest, (ckpt.all_steps(), latest)
      latest = ckpt.latest_step()
      for step in ckpt.all_steps():
        restored = ckpt.restore(step, params_target=target[0], opt_state_target=target[1])
        assert_equal((restored.params, restored.opt_state), saved_at(step, params, target[1]))


def test_the_inventory_finds_missing_resized_and_changed_files(tmp_path):
  (tmp_path / "params" / "d").mkdir(parents=True)
  (tmp_path / "params" / "_METADATA").write_text('{"tree": 1}')
  (tmp_path / "params" / "d" / "chunk").write_bytes(b"\0" * 64)
  _files.write_inventory(str(tmp_path))
  assert _files.problems(str(tmp_path), contents=True) == []
  (tmp_path / "params" / "_METADATA").write_text('{"tree": 2}')  # same size
  (tmp_path / "params" / "d" / "chunk").write_bytes(b"\0" * 32)
  assert _files.problems(str(tmp_path)) == [f"{tmp_path}/params/d/chunk: 32 bytes, 64 when saved"]
  assert _files.problems(str(tmp_path), contents=True)[0] == (
      f"{tmp_path}/params/_METADATA: its bytes differ from those saved (CRC-32 mismatch)")
  (tmp_path / "params" / "d" / "chunk").unlink()
  assert _files.problems(str(tmp_path), only="params/d") == [
      f"{tmp_path}/params/d/chunk: missing"]
  (tmp_path / _files.INVENTORY).unlink()
  assert "no readable file inventory" in _files.problems(str(tmp_path))[0]
