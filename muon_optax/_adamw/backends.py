"""The aux AdamW: its settings, `AuxAdam`, computed by one of three interchangeable backends.

Every backend computes the same AdamW (decoupled weight decay with a mask, optional
Nesterov, learning rate and weight decay constant or scheduled); they differ only in
where the two moments are stored and who writes the maths:

| backend     | state                    | moments                                            |
|-------------|--------------------------|----------------------------------------------------|
| "optax"     | `optax.ScaleByAdamState` | optax's own `scale_by_adam`, fused by XLA per leaf |
| "offload"   | `OffloadAdamState`       | in host memory, brought to the device for a step   |
| "reference" | `ReferenceAdamState`     | AdamW written out here, the test oracle            |

The three states hold the same (count, mu, nu) trees, shaped like the params, so
`convert_adam_state` moves a state between backends and a checkpoint written under
one restores under another.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from muon_optax._adamw import offload
from muon_optax._util import paths, tree_fit, validate
from muon_optax._util.types import Mask, ScalarOrSchedule

BACKENDS = ("optax", "offload", "reference")


class ReferenceAdamState(NamedTuple):
  """State of the "reference" backend."""
  count: jax.Array  # int32 scalar: steps taken.
  mu: optax.Updates  # first moment: params' shapes, dtype mu_dtype or the params'.
  nu: optax.Updates  # second moment: params' shapes and `nu_dtype`s (|g|² EMA, real-valued).


class OffloadAdamState(NamedTuple):
  """State of the "offload" backend: `ReferenceAdamState` with the moments in host memory."""
  count: jax.Array  # int32 scalar on the device: steps taken.
  mu: optax.Updates  # first moment, as ReferenceAdamState.mu, memory kind pinned_host.
  nu: optax.Updates  # second moment, as ReferenceAdamState.nu, memory kind pinned_host.


# The "optax" backend keeps optax's own documented state, optax.ScaleByAdamState.
STATE_TYPES = {
    "optax": optax.ScaleByAdamState,
    "offload": OffloadAdamState,
    "reference": ReferenceAdamState,
}


def check_backend(backend: Any) -> str:
  """`backend` if it names a backend, else a ValueError saying which names exist."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown AdamW backend {backend!r}; use one of {BACKENDS}.")
  return backend


def describe_state(state: Any) -> str:
  """'a <type> with fields [...]', for error messages."""
  kind = type(state).__name__
  if hasattr(state, "_fields"):
    return f"a {kind} with fields {list(state._fields)}"
  if isinstance(state, Mapping):
    return f"a {kind} with keys {list(state)}"
  return f"a {kind}"


def check_state(state: Any, backend: str) -> None:
  """A wrong state layout becomes a ValueError here, not a KeyError deep in the update."""
  expected = STATE_TYPES[backend]
  if isinstance(state, expected):
    return
  raise ValueError(
      f"the AdamW backend {backend!r} expects a {expected.__name__} but got "
      f"{describe_state(state)}. Convert the state first: "
      f"muon_optax.convert_adam_state(state, params, {backend!r}).")


@dataclasses.dataclass(frozen=True)
class AuxAdam:
  """AdamW settings: the branch of `muon` (and its family) that updates every non-Muon
  leaf, or, with `.transform()`, a standalone AdamW. Checked when built.

      m ← b1·m + (1 − b1)·g,   v ← b2·v + (1 − b2)·|g|²,   t ← t + 1
      m̂ = m / (1 − b1ᵗ)   (Nesterov: b1·m / (1 − b1ᵗ⁺¹) + (1 − b1)·g / (1 − b1ᵗ))
      u = −lr(t−1)·(m̂ / (√(v / (1 − b2ᵗ)) + eps) + wd(t−1)·mask·p)

  This is `optax.adamw` (with `eps_root=0`), complex leaves included: |g|² = g·ḡ is
  real, so v holds real values. Leaves of fewer than 32 bits are updated in float32 and
  cast back; float16 leaves keep v in float32, whose squares of small gradients would
  underflow float16. Nothing is shared with the Muon branch unless you pass it here.

  Args:
    learning_rate: a number ≥ 0 or a schedule of the step count.
    b1: the first moment's decay rate, in [0, 1).
    b2: the second moment's decay rate, in [0, 1).
    eps: denominator guard, > 0.
    weight_decay: decoupled weight decay ≥ 0, or a schedule.
    mask: a pytree of bools over the full params (or a prefix of them), or a callable
      params -> such a pytree; True leaves are decayed. Checked against the params at init.
    nesterov: use Nesterov momentum (NAdamW).
    mu_dtype: floating dtype of the first moment; None keeps the params'.
    backend: "optax" (optax's `scale_by_adam`, fused by XLA), "offload" (moments in
      host memory, `pinned_host`, brought to the device for the step; see
      `offload_state`) or "reference" (AdamW written out, the test oracle).

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.AuxAdam(0.1, backend="reference").transform()
    >>> p = {"z": jnp.array([1.0 + 0j])}
    >>> u, s = tx.update({"z": jnp.array([0.3 - 1j])}, tx.init(p), p)
    >>> u["z"].round(4)
    Array([-0.0287+0.0958j], dtype=complex64)

  References:
    Loshchilov & Hutter 2019, "Decoupled weight decay regularization".
    Dozat 2016, "Incorporating Nesterov momentum into Adam".
  """

  learning_rate: ScalarOrSchedule = 3e-4
  b1: ArrayLike = 0.9
  b2: ArrayLike = 0.999
  eps: ArrayLike = 1e-8
  weight_decay: ScalarOrSchedule = 0.0
  mask: Mask = None
  nesterov: bool = False
  mu_dtype: Optional[Any] = None
  backend: str = "optax"

  def __post_init__(self):
    validate.learning_rate("AuxAdam learning_rate", self.learning_rate)
    validate.decay_rate("AuxAdam b1", self.b1)
    validate.decay_rate("AuxAdam b2", self.b2)
    validate.positive("AuxAdam eps", self.eps)
    validate.weight_decay("AuxAdam weight_decay", self.weight_decay)
    object.__setattr__(self, "mu_dtype", validate.floating_dtype("AuxAdam mu_dtype",
                                                                  self.mu_dtype))
    check_backend(self.backend)

  @classmethod
  def from_adamw(cls, learning_rate: ScalarOrSchedule, *, backend: str = "optax",
                 **adamw_kwargs: Any) -> AuxAdam:
    """The `AuxAdam` of `optax.adamw(learning_rate, **adamw_kwargs)`: optax.adamw's own
    argument names and defaults (read from its signature: weight decay 1e-4 where
    `AuxAdam`'s is 0), so that an AdamW configuration carries over in one line and
    updates the leaves it reaches as `optax.adamw` does. `backend` is AuxAdam's own.

    Raises:
      ValueError: a name optax.adamw does not take, or one AuxAdam cannot honour
        (`eps_root` other than 0): pass `adam=optax.adamw(...)` itself for that.

    Examples:
      >>> import muon_optax as mo
      >>> adamw_kwargs = dict(learning_rate=3e-3, b1=0.9, b2=0.95, weight_decay=0.1)
      >>> tx = mo.muon(0.02, adam=mo.AuxAdam.from_adamw(**adamw_kwargs))
    """
    known = inspect.signature(optax.adamw).parameters
    unknown = sorted(set(adamw_kwargs) - set(known))
    if unknown:
      raise ValueError(f"{unknown} are not optax.adamw arguments; it takes {list(known)}.")
    settings = {name: p.default for name, p in known.items() if p.default is not p.empty}
    settings.update(adamw_kwargs)
    fields = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(set(settings) - fields):  # optax.adamw's, not AuxAdam's: at default
      value, default = settings.pop(name), known[name].default
      if not (isinstance(value, (int, float)) and value == default):
        raise ValueError(f"AuxAdam has no {name} (it is {default!r}); to keep "
                         f"{name}={value!r}, pass the transform itself: "
                         f"adam=optax.adamw(..., {name}={value!r}).")
    return cls(learning_rate, backend=backend, **settings)

  def transform(self) -> optax.GradientTransformation:
    """AdamW with these settings; its state is the backend's NamedTuple. The mask is
    checked against the params at init; `optax.MaskedNode` leaves (an `optax.partition`
    branch's placeholders for other branches' leaves) are skipped."""
    mask = tree_fit.branch_mask(self.mask)  # a full-params mask, inside a branch too
    tx = _build(dict(learning_rate=self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps,
                     weight_decay=self.weight_decay, mask=mask, nesterov=self.nesterov,
                     mu_dtype=self.mu_dtype), self.backend)

    def init_fn(params):
      tree_fit.check_mask("the AuxAdam mask", self.mask, params)
      return offload.commit_like(tx.init(params), params)

    return optax.GradientTransformation(init_fn, tx.update)


def _build(hp: dict, backend: str) -> optax.GradientTransformation:
  if backend == "optax":
    return _optax_backend(hp)
  if backend == "offload":
    return offload.offload_state(_written_out(hp, "offload"))
  return _written_out(hp, "reference")


def nu_dtype(param_dtype: Any) -> jnp.dtype:
  """The second moment's dtype: the params', but float32 for float16, whose squares of
  small gradients underflow (eps 1e-8 itself is 0 in float16)."""
  dtype = jnp.dtype(param_dtype)
  return jnp.dtype(jnp.float32) if dtype == jnp.float16 else dtype


def _nu_zeros(params: Any) -> Any:
  return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=nu_dtype(jnp.result_type(p))), params)


def _wide(x: jax.Array) -> jax.Array:
  """`x` in float32 when it has fewer bits: the arithmetic of low-precision leaves."""
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 else x


def _at(value: ScalarOrSchedule, count: jax.Array) -> Any:
  """A hyperparameter at step `count` (schedules are indexed from 0, as in optax)."""
  return value(count) if callable(value) else value


def _decays(weight_decay: ScalarOrSchedule) -> bool:
  """False only when weight decay is statically zero, so the decay term can be skipped."""
  return callable(weight_decay) or not (isinstance(weight_decay, (int, float)) and weight_decay == 0)


def _decay_flags(mask: Mask, tree: Any) -> Any:
  """`tree`'s structure with a Python bool per leaf: whether weight decay applies."""
  if mask is None:
    return jax.tree.map(lambda _: True, tree)
  mask_tree = mask(tree) if callable(mask) else mask
  # Broadcast a prefix mask over the subtrees it stands for.
  full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub, is_leaf=paths.is_masked),
                      mask_tree, tree, is_leaf=paths.is_masked)

  def as_bool(m):
    try:
      return bool(m)
    except jax.errors.ConcretizationTypeError:
      raise ValueError("the weight-decay mask must hold concrete bools, not traced values") from None

  return jax.tree.map(as_bool, full)


def _leaf_step(g_in, m_in, v_in, p, count, lr, wd, hp):
  """One AdamW step on one leaf -> (update, m, v); `p` None where no decay applies."""
  b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
  g, m, v = _wide(g_in), _wide(m_in), _wide(v_in)
  p = None if p is None else _wide(p)
  t = optax.safe_increment(count)
  m_new = (1 - b1) * g + b1 * m
  v_new = (1 - b2) * (g * jnp.conj(g)).real + b2 * v  # |g|², real for complex g
  bc1 = (1 - b1 ** t).astype(m_new.dtype)
  if hp["nesterov"]:
    m_hat = b1 * (m_new / (1 - b1 ** optax.safe_increment(t)).astype(m_new.dtype)) + (1 - b1) * (
        g / bc1.astype(g.dtype))
  else:
    m_hat = m_new / bc1
  v_hat = v_new / (1 - b2 ** t).astype(v_new.dtype)
  d = m_hat / (jnp.sqrt(v_hat) + eps)
  if p is not None:
    d = d + wd * p
  return (-lr * d).astype(g_in.dtype), m_new.astype(m_in.dtype), v_new.astype(v_in.dtype)


def _written_out(hp: dict, backend: str) -> optax.GradientTransformation:
  """AdamW written out leaf by leaf, with the state type of `backend`."""
  state_type = STATE_TYPES[backend]

  def init_fn(params):
    return state_type(jnp.zeros([], jnp.int32),
                      optax.tree.zeros_like(params, dtype=hp["mu_dtype"]), _nu_zeros(params))

  def update_fn(updates, state, params=None):
    check_state(state, backend)
    count = state.count
    lr, wd = _at(hp["learning_rate"], count), _at(hp["weight_decay"], count)
    decays = _decays(hp["weight_decay"])
    if decays and params is None:
      raise ValueError("AdamW with weight decay needs params: call update(updates, state, params).")
    flags = _decay_flags(hp["mask"], params) if decays else jax.tree.map(lambda _: False, updates)
    params = updates if params is None else params  # unused without weight decay
    leaf = lambda g, m, v, p, f: _leaf_step(g, m, v, p if f else None, count, lr, wd, hp)
    out = jax.tree.map(leaf, updates, state.mu, state.nu, params, flags)
    treedef = jax.tree.structure(updates)
    triples = treedef.flatten_up_to(out)
    u, mu, nu = (jax.tree.unflatten(treedef, [t[k] for t in triples]) for k in range(3))
    return u, state_type(optax.safe_increment(count), mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _optax_backend(hp: dict) -> optax.GradientTransformation:
  """optax's `scale_by_adam` and `add_decayed_weights`: the pieces of `optax.adamw`.

  Unlike `optax.adamw`'s chain state, the schedules read the Adam count, so the state
  is one `optax.ScaleByAdamState` whatever the settings.
  """
  adam = optax.scale_by_adam(hp["b1"], hp["b2"], hp["eps"], mu_dtype=hp["mu_dtype"],
                             nesterov=hp["nesterov"])

  def init_fn(params):
    return adam.init(params)._replace(nu=_nu_zeros(params))

  def update_fn(updates, state, params=None):
    check_state(state, "optax")
    count = state.count
    wide = lambda tree: jax.tree.map(_wide, tree)
    out, new = adam.update(wide(updates), state._replace(mu=wide(state.mu), nu=wide(state.nu)),
                           params)
    new = new._replace(mu=optax.tree.cast_like(new.mu, state.mu),
                       nu=optax.tree.cast_like(new.nu, state.nu))
    if _decays(hp["weight_decay"]):
      decay = optax.add_decayed_weights(_at(hp["weight_decay"], count), hp["mask"])
      out, _ = decay.update(out, decay.init(params), params)
    out = optax.scale_by_learning_rate(_at(hp["learning_rate"], count)).update(
        out, optax.EmptyState())[0]
    return optax.tree.cast_like(out, updates), new

  return optax.GradientTransformation(init_fn, update_fn)
