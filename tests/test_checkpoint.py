"""Checkpoints: restore on any device count, bit-exact resume, crash safety, corruption
detection, clear errors."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from muon_optax import _paths
from muon_optax.checkpoint import Checkpointer, CorruptCheckpointError, _files, abstract_target

pytest.importorskip("orbax.checkpoint")

VOCAB, D, HIDDEN, BATCH = 32, 16, 32, 16


def make_params(hidden=HIDDEN):
  rng = np.random.default_rng(0)  # numpy: no per-shape compiles for a few random arrays
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) / shape[0]**0.5)
  return {
      "embed": {"embedding": normal(VOCAB, D)},
      "mlp_in": {"kernel": normal(D, hidden), "bias": jnp.zeros(hidden)},
      "mlp_out": {"kernel": normal(hidden, D)},
      "lm_head": {"kernel": normal(D, VOCAB)},
  }


def loss_fn(params, step):
  """Next-token cross-entropy of a one-block model on a batch fixed by `step`."""
  x = jax.random.randint(jax.random.fold_in(jax.random.key(1), step), (BATCH,), 0, VOCAB)
  h = params["embed"]["embedding"][x]
  mlp_in, mlp_out = params["mlp_in"], params["mlp_out"]
  h = h + jnp.tanh(h @ mlp_in["kernel"] + mlp_in["bias"]) @ mlp_out["kernel"]
  logits = h @ params["lm_head"]["kernel"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, (3 * x + 1) % VOCAB).mean()


def make_tx(mesh=None, adam_backend="reference", labels=None, **kw):
  adam = mo.AuxAdam(3e-3, weight_decay=0.1, backend=adam_backend)
  return mo.muon(0.02, weight_decay=0.01, adam=adam, mesh=mesh, routing=labels, **kw)


def make_mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@functools.cache
def trainer(n):
  """(tx, target, jitted step) on an n-device mesh: params replicated, state sharded."""
  mesh = make_mesh(n)
  tx = make_tx(mesh)
  target = abstract_target(tx, make_params(), mesh)
  shardings = jax.tree.map(lambda x: x.sharding, target)

  @functools.partial(jax.jit, in_shardings=(*shardings, None), out_shardings=shardings)
  def step(params, state, i):
    grads = jax.grad(loss_fn)(params, i)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, target, step


def run(n, params, state, start, stop):
  step = trainer(n)[2]
  for i in range(start, stop):
    params, state = step(params, state, jnp.int32(i))
  return params, state


def fill(tree, seed):
  """Random non-negative values (a valid second moment) of each leaf's shape and dtype."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(np.abs(rng.standard_normal(x.shape)) * 100, x.dtype), tree)


def tree_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


K = 3  # steps before the checkpoint, and after it


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """K steps on 8 devices, saved; then K more steps: the uninterrupted run."""
  directory = tmp_path_factory.mktemp("ckpt")
  _, (p, s), _ = trainer(8)
  params = jax.device_put(make_params(), jax.tree.map(lambda x: x.sharding, p))
  state = jax.jit(trainer(8)[0].init, out_shardings=jax.tree.map(lambda x: x.sharding, s))(params)
  params, state = run(8, params, state, 0, K)
  with Checkpointer(directory) as ckpt:
    ckpt.save(K, params, state, metadata={"data_position": K})
  final = run(8, params, state, K, 2 * K)
  return directory, params, state, final


@pytest.mark.parametrize("n", [8, 4, 2, 1, "replicated"])
def test_restore_on_any_device_count(saved, n):
  directory, params, state, _ = saved
  if n == "replicated":
    mesh = make_mesh(8)
    replicate = lambda t: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), t)
    target = replicate(params), replicate(jax.eval_shape(make_tx().init, params))
  else:
    target = abstract_target(trainer(n)[0], params, make_mesh(n))
  with Checkpointer(directory) as ckpt:
    assert ckpt.metadata()["checksums"]["params"]  # so restore checks them on this mesh
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  assert restored.step == K and restored.metadata == {"data_position": K}
  assert_equal(restored.params, params)
  assert_equal(restored.opt_state, state)
  for x, t in zip(jax.tree.leaves((restored.params, restored.opt_state)), jax.tree.leaves(target)):
    assert x.sharding.is_equivalent_to(t.sharding, x.ndim)


@pytest.mark.parametrize("n", [8, 2])
def test_resume_matches_the_uninterrupted_run(saved, n):
  directory, _, _, final = saved
  _, target, _ = trainer(n)
  with Checkpointer(directory) as ckpt:
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  resumed = run(n, restored.params, restored.opt_state, restored.step, 2 * K)
  if n == 8:  # same devices, same program: bit-exact
    assert_equal(resumed, final)
  else:
    assert_trees_close(resumed, final, rtol=0, atol=1e-6)


def test_keeps_the_last_k_and_restores_any_kept_step(tmp_path):
  params = make_params()
  tx = make_tx()
  target = abstract_target(tx, params)
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    for step in range(1, 5):
      ckpt.save(step, params, fill(target[1], step))
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    restored = ckpt.restore(3, params_target=target[0], opt_state_target=target[1])
  assert_equal(restored.opt_state, fill(target[1], 3))
  with pytest.raises(FileNotFoundError, match="step 1 "), Checkpointer(tmp_path) as ckpt:
    ckpt.restore(1, params_target=target[0], opt_state_target=target[1])


def test_bf16_momentum_round_trips_as_bf16(tmp_path):
  params = make_params()
  tx = make_tx(mu_dtype=jnp.bfloat16)
  target = abstract_target(tx, params)
  state = fill(target[1], 0)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, params, state)
    ckpt.wait()
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  momentum = restored.opt_state.inner_states["muon"].inner_state[0][0].mu["mlp_in"]["kernel"]
  assert momentum.dtype == jnp.bfloat16
  assert_equal(restored.opt_state, state)


def test_jordan_checkpoint_restores_under_polar_express(tmp_path):
  params = make_params()
  state = fill(jax.eval_shape(make_tx(ns="jordan").init, params), 0)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, params, state)
    ckpt.wait()
    tx = make_tx(ns="polar_express")
    target = abstract_target(tx, params)
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  assert_equal(restored.opt_state, state)
  updates, _ = jax.jit(tx.update)(params, restored.opt_state, params)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(updates))


@pytest.mark.parametrize("backend", ["optax", "offload"])
def test_adam_backend_change_restores(tmp_path, backend):
  """The backends share one state layout: a state saved under one reads into another."""
  params = make_params()
  state = fill(jax.eval_shape(make_tx(adam_backend="reference").init, params), 0)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, params, state)
    ckpt.wait()
    mesh = make_mesh(4)
    tx = make_tx(mesh, adam_backend=backend, offload_momentum=backend == "offload")
    target = abstract_target(tx, params, mesh)
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  assert type(restored.opt_state.inner_states["adam"].inner_state).__name__ == {
      "optax": "ScaleByAdamState", "offload": "OffloadAdamState"}[backend]
  assert_equal(restored.opt_state, mo.convert_adam_state(state, params, backend))
  for x, t in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(target[1])):
    assert x.sharding.is_equivalent_to(t.sharding, x.ndim)
    assert x.sharding.memory_kind == t.sharding.memory_kind
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(restored.opt_state) if x.ndim}
  assert kinds == {"pinned_host" if backend == "offload" else "device"}


MLP_OUT_TO_ADAM = mo.Routing.from_rules([("mlp_out", "adam"), *mo.DEFAULT_RULES])


def mismatch_cases():
  bf16 = dict(mu_dtype=jnp.bfloat16)
  return {
      "shape": (make_params(), make_params(hidden=48), {}, {},
                rf"parameter 'mlp_in/bias' has shape \({HIDDEN},\) in the checkpoint but \(48,\)"),
      "dtype": (make_params(), make_params(), bf16, {},
                r"optimizer state leaf 'inner_states/muon/inner_state/0/0/mu/mlp_in/kernel' "
                r"has dtype 'bfloat16' in the checkpoint but 'float32'"),
      "tree": (make_params(), {**make_params(), "extra": {"kernel": jnp.ones((4, 4))}}, {}, {},
               r"1 difference:\n  parameter 'extra/kernel' is in the target only"),
      "labels": (make_params(), make_params(), {}, {"labels": MLP_OUT_TO_ADAM},
                 r"parameter 'mlp_out/kernel' has label 'muon' in the checkpoint but 'adam'"),
  }


@pytest.mark.parametrize("case", ["shape", "dtype", "tree", "labels"])
def test_mismatch_is_a_clear_error(tmp_path, case):
  saved_params, target_params, saved_kw, target_kw, message = mismatch_cases()[case]
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, saved_params, make_tx(**saved_kw).init(saved_params))
    ckpt.wait()
  target = abstract_target(make_tx(**target_kw), target_params)
  with pytest.raises(ValueError, match=message), Checkpointer(
      tmp_path, routing=target_kw.get("labels")) as ckpt:
    ckpt.restore(params_target=target[0], opt_state_target=target[1])


def test_mismatch_lists_every_changed_kernel(tmp_path):
  params = make_params()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, params, make_tx().init(params))
    ckpt.wait()
  changed = {**params, "embed": {"embedding": jnp.ones((VOCAB, D), jnp.bfloat16)},
             "mlp_out": {"kernel": jnp.ones((HIDDEN, 2 * D))},
             "lm_head": {"kernel": jnp.ones((2 * D, VOCAB))}}
  target = abstract_target(make_tx(), changed)
  with pytest.raises(ValueError) as error, Checkpointer(tmp_path) as ckpt:
    ckpt.restore(params_target=target[0], opt_state_target=target[1])
  message = str(error.value)
  assert "3 differences:" in message
  assert "parameter 'embed/embedding' has dtype 'float32' in the checkpoint but 'bfloat16'" in message
  assert f"parameter 'lm_head/kernel' has shape ({D}, {VOCAB}) in the checkpoint but " \
         f"({2 * D}, {VOCAB})" in message
  assert f"parameter 'mlp_out/kernel' has shape ({HIDDEN}, {D}) in the checkpoint but " \
         f"({HIDDEN}, {2 * D})" in message


def test_labels_that_do_not_fit_the_state_are_an_error(tmp_path):
  params = make_params()
  # The "optax" AdamW backend keeps per-parameter moments, so the state shows the routing.
  state = make_tx(adam_backend="optax", labels=MLP_OUT_TO_ADAM).init(params)
  with pytest.raises(ValueError, match=r"'mlp_out/kernel' is labelled 'muon' by the checkpointer's "
                     r"labels, but the optimizer state keeps it out of the 'muon' branch"), \
      Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, params, state)


# The writer saves step 1, then stalls the commit of step 2 (all data written, the
# directory not yet renamed) and signals; the test kills it there with SIGKILL.
WRITER = """
import asyncio, pathlib, sys
sys.path.insert(0, {tests!r})
import jax, orbax.checkpoint as ocp
import test_checkpoint as t
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
  proc = subprocess.Popen([sys.executable, "-c", script, str(directory), str(marker)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 240
    while not marker.exists():
      if proc.poll() is not None:
        pytest.fail("the writer exited before stalling:\n" + proc.stdout.read().decode()[-3000:])
      if time.monotonic() > deadline:
        pytest.fail("the writer never reached the commit of step 2")
      time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=60)
    proc.stdout.close()

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
  paths = dict(_paths.leaves_with_path(saved[tree]))
  named = re.findall(rf"{tree} leaf '([^']+)'", message)
  assert named and set(named) <= set(paths), message
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


# Saves steps `latest + 1, latest + 2, ...` until killed: params + step and a state
# filled from the step, so any restored step can be checked against what was saved.
SAVER = """
import pathlib, sys
sys.path.insert(0, {tests!r})
import test_checkpoint as t
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


def saved_at(step, params, state_target):
  return jax.tree.map(lambda x: x + step, params), fill(state_target, step)


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
      try:
        deadline = time.monotonic() + 240
        while not marker.exists():
          if proc.poll() is not None:
            log.seek(0)
            pytest.fail("the saver exited:\n" + log.read()[-3000:])
          assert time.monotonic() < deadline, "the saver never committed a step"
          time.sleep(0.05)
        time.sleep(rng.uniform(0, 1.5))  # somewhere in a save, a commit or a deletion
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
      finally:
        if proc.poll() is None:
          proc.kill()
          proc.wait(timeout=60)
    with Checkpointer(directory, max_to_keep=2) as ckpt:
      # The step the run committed before the kill window survives (or a later one).
      assert ckpt.latest_step() > latest, (ckpt.all_steps(), latest)
      latest = ckpt.latest_step()
      for step in ckpt.all_steps():
        restored = ckpt.restore(step, params_target=target[0], opt_state_target=target[1])
        assert_equal((restored.params, restored.opt_state), saved_at(step, params, target[1]))
