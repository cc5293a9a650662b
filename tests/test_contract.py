"""Every public transform through optax's optimizer contract.

The checks of optax's own alias and contrib tests: convergence on a parabola and on
Rosenbrock, `optax.inject_hyperparams`, dtypes, `optax.MultiSteps` and no
recompilation, each run on every transform a user can build from this library.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax as mo

EPS32 = float(jnp.finfo(jnp.float32).eps)


def _chain(inner: Callable[[], optax.GradientTransformation]):
  """A factory `learning_rate -> chain(inner, scale_by_learning_rate)`, injectable by name."""

  def factory(learning_rate):
    return optax.chain(inner(), optax.scale_by_learning_rate(learning_rate))

  factory.__name__ = inner.__name__
  return factory


def _offloaded_muon(learning_rate, adam_learning_rate):
  return mo.offload_state(mo.muon(learning_rate, adam_learning_rate=adam_learning_rate))


@dataclasses.dataclass(frozen=True)
class Case:
  """One public transform: its factory and the learning rates each problem uses."""

  name: str
  factory: Callable[..., optax.GradientTransformation]
  parabola: dict  # learning-rate keyword -> initial rate of the decaying schedule
  rosenbrock: dict
  matrices_only: bool = False  # it sees every leaf as a matrix, so no vector leaf
  static_args: tuple = ()  # what `optax.inject_hyperparams` must keep static
  # Plain (momentum) gradient descent, and steps scaled by the gradient's size (the dual
  # norm): Rosenbrock's valley is ~2500 times more curved
  # across than along at the minimum, so a stable step (≤ 2/1000) needs ~10⁴ steps to
  # walk it. These cases assert a large decrease instead of convergence.
  gradient_descent: bool = False
  # Host offload needs params committed to a device (see `offload_state`); the other
  # transforms, like optax's own, are stepped from plain arrays as optax's tests do.
  commit_params: bool = False
  # Row selection moves a fraction of a matrix's neurons per step (2 of the kernel's 6
  # here): the same loss takes it more steps.
  parabola_steps: int = 300

  def make(self, schedules: bool, problem: str = "parabola", steps: int = 1):
    rates = getattr(self, problem)
    if schedules:
      rates = {k: optax.cosine_decay_schedule(v, steps) for k, v in rates.items()}
    return self.factory(**rates)


def _aux_adam(backend: str):
  def adamw(learning_rate):
    return mo.AuxAdam(learning_rate, backend=backend).transform()
  return adamw


def _adaptive_muon(learning_rate, adam_learning_rate):
  return mo.muon(learning_rate, scale="adaptive", adam_learning_rate=adam_learning_rate)


def _muonbp(learning_rate, adam_learning_rate):
  return mo.muonbp(learning_rate, adam_learning_rate=adam_learning_rate,
                   blocks=mo.BlockPeriodic(period=2, devices=2))


def _cautious_muon(learning_rate, adam_learning_rate):
  return mo.muon(learning_rate, adam_learning_rate=adam_learning_rate,
                 weight_decay=mo.WeightDecay(1e-3, cautious=True))


def _normalized():
  return optax.chain(mo.orthogonalize(), mo.scale_by_second_moment("elements"))


def _dual_norm():
  return mo.scale_by_dual_norm(mo.orthogonalize())


MUON_RATES = dict(parabola={"learning_rate": 0.1, "adam_learning_rate": 0.1},
                  rosenbrock={"learning_rate": 0.03, "adam_learning_rate": 0.3})
CASES = [
    Case("muon", mo.muon, **MUON_RATES),
    Case("normuon", mo.normuon, **MUON_RATES),
    Case("dion2", mo.dion2, **MUON_RATES, static_args=("fraction",), parabola_steps=3000),
    Case("muonbp", _muonbp, **MUON_RATES),
    Case("nordion2", mo.nordion2, **MUON_RATES, static_args=("fraction",), parabola_steps=3000),
    Case("muon(weight_decay=WeightDecay(cautious=True))", _cautious_muon, **MUON_RATES),
    Case("adamuon", mo.adamuon, {"learning_rate": 0.5, "adam_learning_rate": 0.1},
         {"learning_rate": 0.15, "adam_learning_rate": 0.3}),
    Case("muon(scale='adaptive')", _adaptive_muon, {"learning_rate": 0.05, "adam_learning_rate": 0.1},
         {"learning_rate": 1e-3, "adam_learning_rate": 0.3}, gradient_descent=True),
    Case("scale_by_second_moment", _chain(_normalized), {"learning_rate": 0.1},
         {"learning_rate": 0.03}, matrices_only=True),
    Case("scale_by_dual_norm", _chain(_dual_norm), {"learning_rate": 0.05},
         {"learning_rate": 1e-3}, matrices_only=True, gradient_descent=True),
    Case("scale_by_muon", _chain(mo.scale_by_muon), {"learning_rate": 0.1},
         {"learning_rate": 0.03}, matrices_only=True),
    Case("scale_by_muon_momentum", _chain(mo.scale_by_muon_momentum), {"learning_rate": 0.3},
         {"learning_rate": 2e-3}, gradient_descent=True),
    Case("orthogonalize", _chain(mo.orthogonalize), {"learning_rate": 0.1},
         {"learning_rate": 0.03}, matrices_only=True),
    Case("scale_by_shape", _chain(mo.scale_by_shape), {"learning_rate": 0.1},
         {"learning_rate": 2e-3}, matrices_only=True, gradient_descent=True),
    *[Case(f"AuxAdam({b!r})", _aux_adam(b), {"learning_rate": 0.1},
           {"learning_rate": 0.3}, commit_params=b == "offload") for b in mo.BACKENDS],
    Case("offload_state(muon)", _offloaded_muon, **MUON_RATES, commit_params=True),
]
cases = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)

_rng = np.random.default_rng(0)
TARGET = {"kernel": _rng.standard_normal((4, 6)), "bias": _rng.standard_normal(6)}
# Rosenbrock start: three (x, y) points, one per column, so the gradient matrix has
# full rank and Newton–Schulz sees a genuine 2×3 matrix, not a normalized vector.
ROSEN_START = np.array([[-1.2, -0.5, 0.3], [1.0, 0.0, -0.6]])


def problem_params(case: Case, problem: str, dtype=jnp.float32) -> dict:
  """{"dense": {"kernel", "bias"}}: the default rules send the kernel to Muon and the
  bias to AdamW; transforms that see only matrices get the kernel alone."""
  if problem == "parabola":
    p = {"kernel": np.zeros((4, 6)), "bias": np.zeros(6)}
  else:
    p = {"kernel": ROSEN_START, "bias": ROSEN_START.reshape(-1)}
  if case.matrices_only:
    del p["bias"]
  params = {"dense": jax.tree.map(lambda x: jnp.asarray(x, dtype), p)}
  return jax.device_put(params, jax.devices()[0]) if case.commit_params else params


def parabola(params):
  return sum(jnp.sum((params["dense"][k] - TARGET[k]) ** 2) for k in params["dense"])


def rosenbrock(params):
  """Σ (1 − x)² + 100 (y − x²)² over columns, each leaf seen as rows (x, y); minimum 0 at 1."""
  total = 0.0
  for leaf in jax.tree.leaves(params):
    x, y = leaf.reshape(2, -1)
    total += jnp.sum((1 - x) ** 2 + 100 * (y - x ** 2) ** 2)
  return total


def minimize(tx, loss, params, steps):
  """`steps` jitted gradient steps in one scan -> final loss."""

  def body(carry, _):
    p, s = carry
    u, s = tx.update(jax.grad(loss)(p), s, p)
    return (optax.apply_updates(p, u), s), None

  @jax.jit
  def run(p):
    (p, _), _ = jax.lax.scan(body, (p, tx.init(p)), length=steps)
    return loss(p)

  return float(run(params))


@cases
def test_converges_on_a_parabola(case):
  steps = case.parabola_steps
  params = problem_params(case, "parabola")
  tx = case.make(schedules=True, problem="parabola", steps=steps)
  start = float(parabola(params))
  final = minimize(tx, parabola, params, steps)
  assert final < 1e-6 * start, f"{case.name}: loss {start:.3g} -> {final:.3g}"


@cases
def test_converges_on_rosenbrock(case):
  steps = 1000
  params = problem_params(case, "rosenbrock")
  tx = case.make(schedules=True, problem="rosenbrock", steps=steps)
  start = float(rosenbrock(params))
  final = minimize(tx, rosenbrock, params, steps)
  if case.gradient_descent:  # see Case.gradient_descent
    assert final < start / 10, f"{case.name}: loss {start:.3g} -> {final:.3g}"
  else:  # below 1e-2 every x is within 0.1 of 1 and every y within 0.01 of x²
    assert final < 1e-2, f"{case.name}: loss {start:.3g} -> {final:.3g}"


def gradients(params, shift):
  """Two distinct parabola gradients, at params and at params + shift, stacked on a
  leading step axis."""
  g1 = jax.grad(parabola)(params)
  g2 = jax.grad(parabola)(jax.tree.map(lambda p: p + shift, params))
  return jax.tree.map(lambda a, b: jnp.stack([a, b]), g1, g2)


def run_steps(tx, params, grads):
  """Applies tx to each gradient of `grads` (stacked on a leading step axis) in turn, in
  one scan -> (updates stacked the same way, final state)."""

  def body(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), u

  (_, state), updates = jax.lax.scan(body, (params, tx.init(params)), grads)
  return updates, state


def assert_within_rounding(actual, fn: Callable[[Any], Any], grads, what: str) -> None:
  """`actual` equals `fn(grads)` leaf by leaf within twice float32's rounding floor of
  `fn` at `grads`: how far that leaf moves when every gradient entry moves by 8 ulps
  with a random sign (as a different order of the same float32 operations moves it),
  plus 8 ulps of the leaf's largest entry. Integer leaves (step counts) must be equal."""
  rng = np.random.default_rng(1)
  nudged = jax.tree.map(
      lambda g: g * (1 + 8 * EPS32 * jnp.asarray(rng.choice([-1.0, 1.0], g.shape), g.dtype)),
      grads)
  expected, moved = fn(grads), fn(nudged)
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
  e_leaves, e_def = jax.tree.flatten(expected)
  assert a_def == e_def, f"{what}: tree structures differ:\n{a_def}\n{e_def}"
  for (path, a), e, m in zip(a_leaves, e_leaves, jax.tree.leaves(moved)):
    floating = jnp.issubdtype(e.dtype, jnp.floating)
    a, e, m = (np.asarray(x, np.float64) for x in (a, e, m))
    tol = 2 * (np.max(np.abs(e - m), initial=0) + 8 * EPS32 * np.max(np.abs(e), initial=0))
    tol = tol if floating else 0
    np.testing.assert_allclose(a, e, rtol=0, atol=tol,
                               err_msg=f"{what} at {jax.tree_util.keystr(path)}")


def float32_hyperparams(case: Case) -> dict:
  """The factory's float hyperparameters (learning rates and defaults such as b2) rounded
  to float32, as `optax.inject_hyperparams` hands them to the factory. The rounding is
  the injection's: 0.999 is 0.99900001 in float32, which moves 1 − b2 by 1.3e-5."""
  defaults = {name: p.default for name, p in inspect.signature(case.factory).parameters.items()
              if isinstance(p.default, float) and name not in case.static_args}
  return {k: float(np.float32(v)) for k, v in {**defaults, **case.parabola}.items()}


@cases
def test_inject_hyperparams_matches_and_scales(case):
  params = problem_params(case, "parabola")
  grads = gradients(params, 0.5)
  rates = case.parabola
  plain = case.factory(**float32_hyperparams(case))
  injected = optax.inject_hyperparams(case.factory, static_args=case.static_args)(**rates)

  run_plain = jax.jit(lambda g: run_steps(plain, params, g))
  u_inj, s_inj = jax.jit(lambda g: run_steps(injected, params, g))(grads)
  assert_within_rounding(u_inj, lambda g: run_plain(g)[0], grads, f"{case.name} updates")
  assert_within_rounding(s_inj.inner_state, lambda g: run_plain(g)[1], grads,
                         f"{case.name} state")

  # Doubling every injected learning rate doubles the next update: the rate enters
  # through one multiplication, and doubling is exact in binary floating point.
  doubled = s_inj._replace(hyperparams={
      k: 2 * v if k in rates else v for k, v in s_inj.hyperparams.items()})
  step = jax.jit(lambda g, s: injected.update(g, s, params)[0])
  g = jax.tree.map(lambda x: x[0], grads)
  u1, u2 = step(g, s_inj), step(g, doubled)
  assert float(optax.tree.norm(u1)) > 0
  for a, b in zip(jax.tree.leaves(u2), jax.tree.leaves(u1)):
    np.testing.assert_allclose(np.asarray(a), 2 * np.asarray(b), rtol=2 * EPS32, atol=0,
                               err_msg=case.name)


@cases
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_dtypes_are_kept(case, dtype):
  params = problem_params(case, "parabola", dtype)
  dtypes = jax.tree.map(lambda p: p.dtype, params)
  grads = gradients(params, 0.5)
  txs = (case.make(schedules=False), optax.MultiSteps(case.make(schedules=False), 2))
  for updates, _ in jax.jit(lambda g: [run_steps(tx, params, g) for tx in txs])(grads):
    new_params = optax.apply_updates(params, jax.tree.map(lambda u: u[-1], updates))
    for tree in (updates, new_params):
      assert jax.tree.map(lambda x: x.dtype, tree) == dtypes, case.name
      assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)), case.name
    assert float(optax.tree.norm(updates)) > 0, case.name


@cases
def test_multi_steps_equal_one_step_with_the_mean(case):
  """k micro-steps that all see g equal one step with g, for two outer steps (g1, g2):
  the mean of k copies of g is g exactly (MultiSteps keeps acc + (g − acc)/(n + 1))."""
  k = 3
  params = problem_params(case, "parabola")
  grads = gradients(params, 0.5)
  plain = case.make(schedules=False)
  multi = optax.MultiSteps(case.make(schedules=False), every_k_schedule=k)

  run_plain = jax.jit(lambda g: run_steps(plain, params, g))
  u_multi, s_multi = jax.jit(lambda g: run_steps(multi, params, g))(
      jax.tree.map(lambda g: jnp.repeat(g, k, axis=0), grads))
  applied = jax.tree.map(lambda u: u.reshape(2, k, *u.shape[1:]), u_multi)
  # Nothing is applied until the k-th micro-step.
  assert all(not bool(jnp.any(u[:, :-1])) for u in jax.tree.leaves(applied)), case.name
  assert_within_rounding(jax.tree.map(lambda u: u[:, -1], applied), lambda g: run_plain(g)[0],
                         grads, f"{case.name} updates")
  assert_within_rounding(s_multi.inner_opt_state, lambda g: run_plain(g)[1], grads,
                         f"{case.name} state")


class _CompileLog(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    if "compil" in record.getMessage().lower():
      self.messages.append(record.getMessage())


@cases
def test_second_update_does_not_recompile(case):
  params = problem_params(case, "parabola")
  tx = case.make(schedules=False)
  traces = []

  @jax.jit
  def step(p, s):
    traces.append(None)  # runs once per trace
    u, s = tx.update(jax.grad(parabola)(p), s, p)
    return optax.apply_updates(p, u), s

  params, state = step(params, tx.init(params))
  log, jax_logger = _CompileLog(), logging.getLogger("jax")
  jax_logger.addHandler(log)
  try:
    with jax.log_compiles(True):
      for _ in range(2):
        params, state = step(params, state)
      jax.block_until_ready(params)
  finally:
    jax_logger.removeHandler(log)
  assert len(traces) == 1, f"{case.name}: traced {len(traces)} times"
  assert not log.messages, f"{case.name} recompiled:\n" + "\n".join(log.messages)
