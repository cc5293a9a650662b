"""Checkpoints: restore on any device count, bit-exact resume, backend and preset
changes, clear errors for what does not fit."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_trees_close
from checkpoint_case import (
  HIDDEN,
  VOCAB,
  D,
  assert_equal,
  fill,
  make_mesh,
  make_params,
  make_tx,
  run,
  trainer,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from muon_optax.checkpoint import Checkpointer, _checksum, abstract_target

pytest.importorskip("orbax.checkpoint")


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
    # The checksums saved on 8 devices, so restore checks them on this mesh.
    assert _checksum.read(os.path.join(directory, str(K)))["params"]
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


def test_another_optimizer_is_named_and_the_params_restore_alone(tmp_path):
  params = make_params()
  state = fill(jax.eval_shape(make_tx().init, params), 0)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, params, state)
    ckpt.wait()
    adamuon = mo.adamuon(0.02, adam=mo.AuxAdam(1e-3))
    target = abstract_target(adamuon, params)
    with pytest.raises(ValueError, match=r"(?s)optimizer state leaf.*another optimizer's.*"
                       r"restore the params alone"):
      ckpt.restore(params_target=target[0], opt_state_target=target[1])
    restored = ckpt.restore(params_target=target[0])  # the params; a fresh adamuon state
  assert restored.opt_state is None
  assert_equal(restored.params, params)
  fresh = adamuon.init(restored.params)
  updates, _ = jax.jit(adamuon.update)(params, fresh, restored.params)
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
