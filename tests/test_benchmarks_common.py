"""benchmarks.common: the helpers benchmarks and examples share. Run from the repository
root (`python -m pytest`), which makes `benchmarks` importable."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
