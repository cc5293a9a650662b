"""benchmarks.common: the helpers the benchmarks share. Run from the repository root
(`python -m pytest`), which makes `benchmarks` importable."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo
from benchmarks import common


def test_gpt2_tree_has_gpt2_small_shapes_and_counts():
  tree = common.gpt2_tree(2, jax.random.key(0))
  assert tree["wte"]["embedding"].shape == (50257, 768)
  assert tree["h_1"]["mlp"]["fc_proj"]["kernel"].shape == (3072, 768)
  # GPT-2 small per block: 12·d² kernel weights + 13·d biases and norms (d = 768).
  d = 768
  per_block = 12 * d * d + 13 * d
  assert common.num_params(tree) == 50257 * d + 1024 * d + 2 * d + 2 * per_block
  abstract = common.gpt2_tree(2, d=64, vocab=100, ctx=0, small_leaves=False)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
  assert common.num_params(abstract) == 100 * 64 + 2 * 12 * 64 * 64
  assert common.tree_bytes(abstract) == 4 * common.num_params(abstract)


def test_make_step_donates_its_own_copy_and_time_steps_times_every_arm():
  params = {"w": jnp.ones((4, 4))}
  step, carry = common.make_step(optax.sgd(0.5), params)
  carry[:] = step(*carry, params)
  np.testing.assert_array_equal(carry[0]["w"], 0.5)  # 1 − 0.5·1
  np.testing.assert_array_equal(params["w"], 1.0)  # the caller's array is untouched
  times, states = common.time_steps({"sgd": optax.sgd(0.1), "adam": optax.adam(0.1)},
                                    params, params, warmup=1, steps=3)
  assert {k: len(v) for k, v in times.items()} == {"sgd": 3, "adam": 3}
  assert all(t > 0 for v in times.values() for t in v)
  assert int(states["adam"][0].count) == 4  # 1 warm-up + 3 timed steps


def test_commit_commits_every_array():
  tree = common.commit({"a": jnp.zeros(3), "b": jax.device_put(jnp.ones(2), jax.devices()[0])})
  assert all(x.committed for x in jax.tree.leaves(tree))


def test_machine_names_the_backend_and_versions():
  line = common.machine()
  assert f"jax {jax.__version__}" in line and f"optax {optax.__version__}" in line
  assert common.machine_info()["backend"] == jax.default_backend()


def test_optimizer_arms_route_the_same_kernels_and_run():
  params = common.gpt2_tree(1, jax.random.key(0), d=16, vocab=32, ctx=4)
  labels = jax.tree.leaves(common.kernel_labels(params))
  assert labels.count("muon") == 4 and len(labels) == len(jax.tree.leaves(params))
  assert list(common.kernels(params)) == ["h_0/attn/proj", "h_0/attn/qkv", "h_0/mlp/fc",
                                          "h_0/mlp/fc_proj"]
  grads = common.random_like(params, jax.random.key(1), 1e-3)
  arms = common.optimizer_arms(params)
  assert "optax.contrib.muon" in arms and "muon_optax.normuon" in arms
  updates = {name: tx.update(grads, tx.init(params), params)[0] for name, tx in arms.items()}
  for name, tree in updates.items():
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(tree)), name
  # muon_optax's arms leave the embedding to the same AdamW: the same first update there
  # (optax.contrib.muon's AdamW takes its Muon's Nesterov momentum).
  for name, tree in updates.items():
    if name.startswith("muon_optax"):
      np.testing.assert_allclose(tree["wte"]["embedding"],
                                 updates["optax.adamw"]["wte"]["embedding"], rtol=1e-6,
                                 err_msg=name)
  assert list(common.optimizer_arms(params, names=["optax.adamw"])) == ["optax.adamw"]
  with pytest.raises(ValueError, match="unknown arms"):
    common.optimizer_arms(params, names=["sgd"])


def test_optax_orthogonalize_runs_the_jordan_iteration_ours_does():
  x = jax.random.normal(jax.random.key(0), (3, 16, 40))
  ours = mo.newton_schulz(x, common.JORDAN5_STANDARD)
  theirs = common.optax_orthogonalize(x, mo.PRESETS["jordan"].table[0], 5)
  np.testing.assert_allclose(theirs, ours, atol=2e-5)
  polar = common.polar_factor(x)
  assert common.polar_error(polar, polar) == 0
  assert 0.1 < common.polar_error(ours, polar) < 0.3  # jordan's band is not 1


@pytest.mark.parametrize("shape, dtype", [((16, 40), "float32"), ((40, 16), "float32"),
                                          ((3, 16, 40), "float32"), ((2, 24, 24), "bfloat16")])
def test_optax_orthogonalize_is_optax_contribs_own_iteration_to_the_bit(shape, dtype):
  # The reference: the iteration optax.contrib.muon calls, private in optax 0.2.8.
  from optax.contrib._muon import orthogonalize_via_newton_schulz
  x = jax.random.normal(jax.random.key(1), shape).astype(dtype)
  coeffs = mo.PRESETS["polar_express"].table[:5]
  dims = None if x.ndim == 2 else optax.contrib.MuonDimensionNumbers(1, 2)
  want = jax.jit(lambda x: orthogonalize_via_newton_schulz(x, jnp.asarray(coeffs), 5,
                                                             dimension_numbers=dims))(x)
  got = jax.jit(lambda x: common.optax_orthogonalize(x, coeffs, 5))(x)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_parse_shapes_and_spectrum():
  assert common.parse_shapes("768x3072,12X768x768", 0.25) == [(192, 768), (12, 192, 192)]
  s = np.linalg.svd(np.asarray(common.with_spectrum((8, 20), 1e-3)), compute_uv=False)
  np.testing.assert_allclose(s, np.logspace(0, -3, 8), rtol=1e-4)


def test_load_note_says_when_the_machine_was_busy():
  assert "otherwise idle" in common.load_note(0.1, 0.2, cores=2)
  assert "BUSY" in common.load_note(1.5, 0.2, cores=2)
  # The CPU other processes used decides over the load average, which counts the run itself.
  assert "otherwise idle" in common.load_note(1.9, 2.0, cores=2, others=0.02)
  assert "BUSY" in common.load_note(0.1, 0.1, cores=2, others=0.5)
  assert "other processes used 50% of the CPUs" in common.load_note(0, 0, others=0.5)


def test_load_watch_measures_what_other_processes_used(monkeypatch):
  with common.LoadWatch() as load:
    pass
  assert load.before >= 0 and load.after >= 0
  assert load.others is None  # too short to measure in clock ticks
  assert load.note().startswith("load average ")
  # (wall s, machine busy CPU s, this process's CPU s, CPUs): over 2 s on 2 CPUs, this
  # process used 1.5 s and the machine 2.5 s, so others used 1 s of 4: a quarter.
  samples = iter([(10.0, 100.0, 5.0, 2), (12.0, 102.5, 6.5, 2)])
  monkeypatch.setattr(common, "_cpu_times", lambda: next(samples))
  with common.LoadWatch() as load:
    pass
  assert load.others == 0.25 and "BUSY" in load.note()


def test_ratio_table_has_min_median_ratios_and_extra_columns():
  table = common.ratio_table({"a": [0.002, 0.004, 0.003], "b": [0.001, 0.001, 0.009]}, "a",
                             extra={"state": {"a": "8.00"}})
  head, _, a, b = table.splitlines()
  assert head == ("| arm | min ms | median ms | min / a | median / a | N | state |")
  assert a == "| a | 2.00 | 3.00 | 1.00× | 1.00× | 3 | 8.00 |"
  assert b == "| b | 1.00 | 1.00 | 0.50× | 0.33× | 3 |  |"


def test_header_names_the_command_and_the_machine():
  command, machine = common.header("benchmarks.x", ["--steps", "2"]).splitlines()
  assert command == "# python -m benchmarks.x --steps 2"
  assert machine.startswith("machine: ")
