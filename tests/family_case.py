"""The family's shared test case: small params (a stack among them), random gradients,
the exact polar factor, per-leaf float32 tolerances, and one run on 8 devices against 1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from sharded_case import param_shardings

import muon_optax as mo
from muon_optax._util.paths import leaves_with_path

EPS32 = np.finfo(np.float32).eps
STEPS = 4
LR, WD, BETA = 0.05, 0.01, 0.9


def svd_polar(x):
  u, _, vt = jnp.linalg.svd(x, full_matrices=False)
  return u @ vt


# The optimizers orthogonalize with the exact polar factor, so the references below test
# the family's own steps, independently of any Newton–Schulz polynomial.
EXACT = mo.NewtonSchulz(fn=svd_polar)


def make_params():
  ks = jax.random.split(jax.random.key(0), 4)
  return {"embed": {"embedding": jax.random.normal(ks[0], (24, 16))},
          "fc": {"kernel": 0.1 * jax.random.normal(ks[1], (16, 48)), "bias": jnp.zeros(48)},
          "proj": {"kernel": 0.1 * jax.random.normal(ks[2], (48, 16))},
          "stack": {"kernel": 0.1 * jax.random.normal(ks[3], (2, 16, 16))}}


def grads_at(step, params):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(100 + step), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def matrices(x):
  """A leaf as a stack of (fan_in, fan_out) matrices: the default views of these leaves."""
  return x.reshape(-1, *x.shape[-2:])


def polar64(x):
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  return u @ vt


def assert_close_per_leaf(got, want, what):
  """Each leaf within float32 rounding of its own size, step after step: every step is
  float32 arithmetic on O(1) quantities whose results a different order of the same sums
  (or float64) moves by some ulps; 64 per step, of the leaf's largest entry."""
  for path, value in got.items():
    tol = 64 * STEPS * EPS32 * np.abs(want[path]).max()
    np.testing.assert_allclose(value, want[path], rtol=0, atol=tol, err_msg=f"{what} {path}")


def flat(tree):
  return {k: np.asarray(v, np.float64) for k, v in leaves_with_path(tree)}


def mesh_of(types=AxisType.Auto):
  return jax.make_mesh((8,), ("data",), axis_types=(types,))


def run_on_one_and_eight(make, layout="fsdp", types=AxisType.Auto, steps=STEPS):
  """(params, state) after `steps` steps of `make()` on one device, and of
  `make(mesh=mesh)` on 8 (params FSDP-sharded or replicated as `layout` says, the state
  as `state_shardings` lays it out), with one compilation for all steps."""
  mesh, params = mesh_of(types), make_params()
  pshard = param_shardings(params, mesh, layout)
  results = []
  for tx, shard in ((make(), None), (make(mesh=mesh), pshard)):
    p = params if shard is None else jax.device_put(params, shard)
    if shard is None:
      state, update = tx.init(p), jax.jit(tx.update)
    else:
      sshard = mo.state_shardings(tx, p, mesh)
      state = jax.jit(tx.init, out_shardings=sshard)(p)
      update = jax.jit(tx.update, out_shardings=(shard, sshard))
    for step in range(steps):
      g = grads_at(step, params)
      u, state = update(g if shard is None else jax.device_put(g, shard), state, p)
      p = optax.apply_updates(p, u)
    results.append((p, state))
    if shard is not None:
      assert update._cache_size() == 1  # one compilation for every step
  return results


def plain_adamw_step(s: dict, g, x, t: int, lr: float = 1e-2):
  """Plain AdamW (b1 0.9, b2 0.999, eps 1e-8, no decay) on one leaf at step t ≥ 1 in
  float64, `s` its moments ("m", "nu"): the references' update of the other leaves."""
  s["m"] = 0.9 * s.get("m", 0) + 0.1 * g
  s["nu"] = 0.999 * s.get("nu", 0) + 0.001 * g * g
  m_hat, v_hat = s["m"] / (1 - 0.9**t), s["nu"] / (1 - 0.999**t)
  return x - lr * m_hat / (np.sqrt(v_hat) + 1e-8)


def train_beside(tx, reference, params, steps: int = STEPS):
  """`steps` jitted steps of `tx` and of `reference.step` (float64, leaf by leaf) on the
  same gradients: (the optimizer's params, the reference's), both flat."""
  ref_params, state, update = flat(params), tx.init(params), jax.jit(tx.update)
  for step in range(steps):
    grads = grads_at(step, params)
    u, state = update(grads, state, params)
    params = optax.apply_updates(params, u)
    ref_params = reference.step(ref_params, flat(grads))
  return flat(params), ref_params


def assert_checkpoint_restores(tx, params, state, directory) -> None:
  """The state saved with `Checkpointer` restores bit for bit into `tx`'s target."""
  with mo.checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(2, params, state)
    ckpt.wait()
    target = mo.checkpoint.abstract_target(tx, params)
    restored = ckpt.restore(params_target=target[0], opt_state_target=target[1])
  for a, b in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
