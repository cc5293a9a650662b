"""The same Muon code under jax.distributed: 2 processes × 4 CPU devices vs one device, on
Auto axes with replicated params and on Explicit axes with FSDP-split ones."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _env import script_env
from distributed_case import STEPS, grads_at, make_params, optimizer

from muon_optax._util import paths

HERE = Path(__file__).parent

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def single_device_run():
  params = make_params()
  tx = optimizer()
  state, step = tx.init(params), jax.jit(tx.update)
  for i in range(STEPS):
    updates, state = step(grads_at(i, make_params()), state, params)
    params = optax.apply_updates(params, updates)
  return {path: np.asarray(x) for path, x in paths.leaves_with_path(params)}


@pytest.mark.parametrize("layout", ["auto-replicated", "explicit-fsdp"])
def test_two_processes_match_one(tmp_path, layout):
  port, out = free_port(), tmp_path / "params.npz"
  env = script_env(PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
  procs = [subprocess.Popen([sys.executable, str(HERE / "multiprocess_worker.py"), str(port),
                             str(i), str(out), layout], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    logs = [p.communicate(timeout=240)[0] for p in procs]
  except subprocess.TimeoutExpired:
    pytest.fail("the 2-process run did not finish within 240 s")
  finally:
    for p in procs:  # never leave a process behind
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  got = dict(np.load(out))
  want = single_device_run()
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_allclose(got[path], want[path], rtol=0, atol=1e-5, err_msg=path)
