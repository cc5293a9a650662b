"""The aux AdamW in four interchangeable backends, and conversion of state between them.

Every backend computes the same AdamW (decoupled weight decay with a mask, optional
Nesterov, learning rate and weight decay constant or scheduled); they differ only in
where and how the two moments are stored:

| backend     | state                    | moments stored as                                   |
|-------------|--------------------------|-----------------------------------------------------|
| "optax"     | `optax.ScaleByAdamState` | per-leaf trees; optax's own `scale_by_adam`         |
| "flat"      | `FlatAdamState`          | one contiguous 1-D buffer per dtype (multi-tensor)  |
| "offload"   | `OffloadAdamState`       | per-leaf trees in host memory, moved in for a step  |
| "reference" | `ReferenceAdamState`     | per-leaf trees; AdamW written out, the ground truth |

With "offload" (and `offload_state`), commit the params to a device before the first
step (`jax.device_put(params, device)`, or create them under jit): jit specializes on
whether its inputs are committed, and next to committed host-memory state a fresh,
uncommitted input makes the second step compile again.

"auto" picks a backend for the platform (see `resolve_backend`). The state layouts
depend only on the params (and `mu_dtype`), never on the other settings, so
`convert_adam_state` can turn any of them into any other.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from muon_optax import _paths, _routing

ScalarOrSchedule = Union[ArrayLike, Callable[[ArrayLike], ArrayLike]]
Mask = Union[None, Any, Callable[[Any], Any]]

BACKENDS = ("optax", "flat", "offload", "reference")
_FIELDS = ("count", "mu", "nu")


class ReferenceAdamState(NamedTuple):
  """State of the "reference" backend."""
  count: jax.Array  # int32 scalar: steps taken.
  mu: optax.Updates  # first moment: params' shapes, dtype mu_dtype or the params'.
  nu: optax.Updates  # second moment: params' shapes and dtypes.


class OffloadAdamState(NamedTuple):
  """State of the "offload" backend: `ReferenceAdamState` with the moments in host memory."""
  count: jax.Array  # int32 scalar on the device: steps taken.
  mu: optax.Updates  # first moment, as ReferenceAdamState.mu, memory kind pinned_host.
  nu: optax.Updates  # second moment, as ReferenceAdamState.nu, memory kind pinned_host.


class FlatAdamState(NamedTuple):
  """State of the "flat" backend: each moment is one 1-D buffer per parameter dtype.

  Buffer `mu[name]` holds every non-masked leaf of dtype `name` ("float32", ...) raveled
  and concatenated in tree order (`jax.tree.flatten` order of the params).
  """
  count: jax.Array  # int32 scalar: steps taken.
  mu: dict[str, jax.Array]  # dtype name -> (total size,), dtype mu_dtype or that dtype.
  nu: dict[str, jax.Array]  # dtype name -> (total size,), that dtype.


# The "optax" backend keeps optax's own documented state, optax.ScaleByAdamState
# (count, mu, nu as in ReferenceAdamState).
_STATE_TYPES = {
    "optax": optax.ScaleByAdamState,
    "flat": FlatAdamState,
    "offload": OffloadAdamState,
    "reference": ReferenceAdamState,
}


def resolve_backend(backend: str) -> str:
  """The concrete backend name for `backend`: "auto" is "optax" on every platform.

  Measured on CPU (`benchmarks/adam_backends.py`, 128 × 16,384 float32), all four
  backends run within noise of `optax.adamw` (0.95–1.07× in two runs on a shared
  2-core machine). "flat" cannot save work while params and updates stay per-leaf
  trees: the gradients are concatenated and the update split back, which costs about
  what the single loop saves. So "auto" keeps optax's own state, which optax tools
  read. Not measured on GPU/TPU, where XLA fuses each leaf's update into one kernel
  and "flat" would add the same concatenation.
  """
  if backend == "auto":
    return "optax"
  if backend not in BACKENDS:
    raise ValueError(f"unknown AdamW backend {backend!r}; use one of {BACKENDS + ('auto',)}.")
  return backend


def adamw(
    learning_rate: ScalarOrSchedule = 3e-4,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Mask = None,
    *,
    nesterov: bool = False,
    mu_dtype: Optional[Any] = None,
    backend: str = "auto",
) -> optax.GradientTransformation:
  """AdamW with decoupled weight decay, computed by the chosen backend.

      m ← b1·m + (1 − b1)·g,   v ← b2·v + (1 − b2)·g²,   t ← t + 1
      m̂ = m / (1 − b1ᵗ)   (Nesterov: b1·m / (1 − b1ᵗ⁺¹) + (1 − b1)·g / (1 − b1ᵗ))
      u = −lr(t−1)·(m̂ / (√(v / (1 − b2ᵗ)) + eps) + wd(t−1)·mask·p)

  This is `optax.adamw` (with `eps_root=0`); all backends agree with each other to
  float rounding.

  Args:
    learning_rate: a scalar or a schedule of the step count.
    b1, b2, eps: Adam's decay rates and denominator guard.
    weight_decay: decoupled weight decay, a scalar or a schedule.
    mask: a pytree of bools over the params (or a prefix of them), or a callable
      params -> such a pytree; True leaves are decayed. `optax.MaskedNode` leaves,
      as in an `optax.partition` branch, are skipped.
    nesterov: use Nesterov momentum (NAdamW).
    mu_dtype: dtype of the first moment; None keeps the params'.
    backend: "optax" (optax's `scale_by_adam` per leaf), "flat" (each moment one
      contiguous buffer per dtype, updated in one loop), "offload" (moments in host
      memory, `pinned_host`, brought to the device for the step), "reference" (AdamW
      written out, the ground truth) or "auto" (see `resolve_backend`).

  Returns:
    An `optax.GradientTransformation` whose state is the backend's NamedTuple.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.adamw(1e-3, weight_decay=0.1, backend="flat")
    >>> p = {"b": jnp.ones(3), "w": jnp.ones((2, 3))}
    >>> u, s = tx.update(p, tx.init(p), p)
    >>> type(s).__name__, s.mu["float32"].shape
    ('FlatAdamState', (9,))

  References:
    Loshchilov & Hutter 2019, "Decoupled weight decay regularization".
    Dozat 2016, "Incorporating Nesterov momentum into Adam".
  """
  backend = resolve_backend(backend)
  mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)
  hp = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
            mask=mask, nesterov=nesterov, mu_dtype=mu_dtype)
  return {"optax": _optax_backend, "flat": _flat_backend, "offload": _offload_backend,
          "reference": _reference_backend}[backend](**hp)


# --- shared pieces ---------------------------------------------------------------------

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
  full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub, is_leaf=_paths.is_masked),
                      mask_tree, tree, is_leaf=_paths.is_masked)

  def as_bool(m):
    try:
      return bool(m)
    except jax.errors.ConcretizationTypeError:
      raise ValueError("the weight-decay mask must hold concrete bools, not traced values") from None

  return jax.tree.map(as_bool, full)


def _check_state(state: Any, backend: str) -> None:
  """A wrong state layout becomes a ValueError here, not a KeyError deep in the update."""
  expected = _STATE_TYPES[backend]
  if not isinstance(state, expected):
    raise ValueError(
        f"the AdamW backend {backend!r} expects a {expected.__name__} but got "
        f"{_describe(state)}. Convert the state first: "
        f"muon_optax.convert_adam_state(state, params, {backend!r}).")


def _adam_direction(g, m, v, count, hp):
  """Adam's bias-corrected direction on one array (a leaf or a flat buffer) -> (d, m, v)."""
  b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
  t = optax.safe_increment(count)
  m_new = (1 - b1) * g + b1 * m
  v_new = (1 - b2) * (g * g) + b2 * v
  bc1 = (1 - b1 ** t).astype(m_new.dtype)
  if hp["nesterov"]:
    m_hat = b1 * (m_new / (1 - b1 ** optax.safe_increment(t)).astype(m_new.dtype)) + (1 - b1) * (
        g / bc1.astype(g.dtype))
  else:
    m_hat = m_new / bc1
  v_hat = v_new / (1 - b2 ** t).astype(v_new.dtype)
  return m_hat / (jnp.sqrt(v_hat) + eps), m_new.astype(m.dtype), v_new.astype(v.dtype)


def _adamw_update(d, p, lr, wd, dtype):
  """−lr·(d + wd·p), with `p` None where no weight decay applies."""
  if p is not None:
    d = d + wd * p
  return (-lr * d).astype(dtype)


def _moments_init(params, mu_dtype):
  return (optax.tree.zeros_like(params, dtype=mu_dtype), optax.tree.zeros_like(params))


def _tree_step(updates, mu, nu, params, count, hp):
  """One AdamW step on every leaf -> (updates, mu, nu) trees."""
  lr, wd = _at(hp["learning_rate"], count), _at(hp["weight_decay"], count)
  decays = _decays(hp["weight_decay"])
  if decays and params is None:
    raise ValueError("AdamW with weight decay needs params: call update(updates, state, params).")
  flags = _decay_flags(hp["mask"], params) if decays else jax.tree.map(lambda _: False, updates)
  params = updates if params is None else params  # unused without weight decay

  def leaf(g, m, v, p, f):
    d, m, v = _adam_direction(g, m, v, count, hp)
    return _adamw_update(d, p if f else None, lr, wd, g.dtype), m, v

  out = jax.tree.map(leaf, updates, mu, nu, params, flags)
  treedef = jax.tree.structure(updates)
  triples = treedef.flatten_up_to(out)
  return tuple(jax.tree.unflatten(treedef, [t[k] for t in triples]) for k in range(3))


# --- backends --------------------------------------------------------------------------

def _reference_backend(**hp) -> optax.GradientTransformation:
  def init_fn(params):
    return ReferenceAdamState(jnp.zeros([], jnp.int32), *_moments_init(params, hp["mu_dtype"]))

  def update_fn(updates, state, params=None):
    _check_state(state, "reference")
    u, mu, nu = _tree_step(updates, state.mu, state.nu, params, state.count, hp)
    return u, ReferenceAdamState(optax.safe_increment(state.count), mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _optax_backend(**hp) -> optax.GradientTransformation:
  """optax's `scale_by_adam` and `add_decayed_weights`: the pieces of `optax.adamw`.

  Unlike `optax.adamw`'s chain state, the schedules read the Adam count, so the state
  is one `optax.ScaleByAdamState` whatever the settings.
  """
  adam = optax.scale_by_adam(hp["b1"], hp["b2"], hp["eps"], mu_dtype=hp["mu_dtype"],
                             nesterov=hp["nesterov"])

  def update_fn(updates, state, params=None):
    _check_state(state, "optax")
    count = state.count
    updates, state = adam.update(updates, state, params)
    if _decays(hp["weight_decay"]):
      decay = optax.add_decayed_weights(_at(hp["weight_decay"], count), hp["mask"])
      updates, _ = decay.update(updates, decay.init(params), params)
    updates = optax.scale_by_learning_rate(_at(hp["learning_rate"], count)).update(
        updates, optax.EmptyState())[0]
    return updates, state

  return optax.GradientTransformation(adam.init, update_fn)


def _offload_backend(**hp) -> optax.GradientTransformation:
  def init_fn(params):
    _check_host_memory()
    mu, nu = _moments_init(params, hp["mu_dtype"])
    return _commit_scalars(OffloadAdamState(jnp.zeros([], jnp.int32), _to_host(mu), _to_host(nu)))

  def update_fn(updates, state, params=None):
    _check_state(state, "offload")
    u, mu, nu = _tree_step(updates, _to_device(state.mu), _to_device(state.nu), params,
                           state.count, hp)
    return u, OffloadAdamState(optax.safe_increment(state.count), _to_host(mu), _to_host(nu))

  return optax.GradientTransformation(init_fn, update_fn)


def _flat_backend(**hp) -> optax.GradientTransformation:
  def init_fn(params):
    sizes = {name: sum(x.size for _, x in items) for name, items in _groups(params).items()}
    mu_dtype = hp["mu_dtype"]
    return FlatAdamState(
        jnp.zeros([], jnp.int32),
        {n: jnp.zeros(s, mu_dtype or n) for n, s in sizes.items()},
        {n: jnp.zeros(s, n) for n, s in sizes.items()})

  def update_fn(updates, state, params=None):
    _check_state(state, "flat")
    count = state.count
    lr, wd = _at(hp["learning_rate"], count), _at(hp["weight_decay"], count)
    decays = _decays(hp["weight_decay"])
    if decays and params is None:
      raise ValueError("AdamW with weight decay needs params: call update(updates, state, params).")
    layout = _groups(params if params is not None else updates)
    _check_flat(state, layout, "the flat AdamW state")
    flat_g, treedef = jax.tree.flatten(updates, is_leaf=_paths.is_masked)
    flat_p = jax.tree.leaves(params, is_leaf=_paths.is_masked) if decays else None
    flags = (jax.tree.leaves(_decay_flags(hp["mask"], params), is_leaf=_paths.is_masked)
             if decays else None)
    out, mu, nu = list(flat_g), {}, {}
    for name, items in layout.items():
      idx = [i for i, _ in items]
      # One loop over the dtype's buffer for the moments and the direction; weight decay
      # and the learning rate are applied per leaf, so params are never concatenated.
      d, mu[name], nu[name] = _adam_direction(
          _ravel([flat_g[i] for i in idx]), state.mu[name], state.nu[name], count, hp)
      for i, piece in zip(idx, _unravel(d, [x.shape for _, x in items])):
        p = flat_p[i] if decays and flags[i] else None
        out[i] = _adamw_update(piece, p, lr, wd, flat_g[i].dtype)
    return jax.tree.unflatten(treedef, out), FlatAdamState(optax.safe_increment(count), mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


# --- flat layout -----------------------------------------------------------------------

def _groups(tree: Any) -> dict[str, list[tuple[int, Any]]]:
  """dtype name -> [(index in the flattened tree, leaf)] of the non-masked leaves."""
  groups: dict[str, list[tuple[int, Any]]] = {}
  for i, x in enumerate(jax.tree.leaves(tree, is_leaf=_paths.is_masked)):
    if not _paths.is_masked(x):
      groups.setdefault(jnp.dtype(x.dtype).name, []).append((i, x))
  return groups


def _whole(x: jax.Array) -> jax.Array:
  """`x` replicated if it is split over Explicit mesh axes, where raveling a split array
  (or reshaping a split buffer) is a ShardingTypeError: the flat layout cannot keep a
  leaf's split, so on a sharded mesh prefer the "optax" backend."""
  sharding = jax.typeof(x).sharding
  explicit = getattr(sharding.mesh, "explicit_axes", ())
  if explicit and any(axis is not None for axis in sharding.spec):
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
  return x


def _ravel(xs: list) -> jax.Array:
  xs = [jnp.ravel(_whole(x)) for x in xs]
  return jnp.concatenate(xs) if len(xs) > 1 else xs[0]


def _unravel(buf: jax.Array, shapes: list) -> list:
  buf = _whole(buf)
  offsets, pieces = 0, []
  for shape in shapes:
    n = math.prod(shape)
    pieces.append(buf[offsets:offsets + n].reshape(shape))
    offsets += n
  return pieces


def _check_flat(state: FlatAdamState, layout: dict, what: str) -> None:
  want = {n: sum(x.size for _, x in items) for n, items in layout.items()}
  for field in ("mu", "nu"):
    got = {n: int(b.size) for n, b in getattr(state, field).items()}
    if got != want:
      raise ValueError(
          f"{what} does not fit these params: {field} holds buffers {got} (dtype: elements) "
          f"but the params' leaves need {want}. Were other params or labels used to build it?")


def _to_flat(per_leaf: Any, params: Any) -> dict[str, jax.Array]:
  flat = jax.tree.leaves(per_leaf, is_leaf=_paths.is_masked)
  return {n: _ravel([flat[i] for i, _ in items]) for n, items in _groups(params).items()}


def _from_flat(buffers: Mapping[str, jax.Array], params: Any) -> Any:
  flat, treedef = jax.tree.flatten(params, is_leaf=_paths.is_masked)
  out = list(flat)
  for name, items in _groups(params).items():
    for (i, _), piece in zip(items, _unravel(buffers[name], [x.shape for _, x in items])):
      out[i] = piece
  return jax.tree.unflatten(treedef, out)


# --- host offload ----------------------------------------------------------------------

def _check_host_memory() -> None:
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  if not kinds & {"pinned_host", "unpinned_host"}:
    raise ValueError(
        f"host offload needs a host memory space, but {jax.devices()[0]} offers only "
        f"{sorted(kinds)}; use another AdamW backend.")


def _to_host(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def _to_device(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def _commit_scalars(state: Any) -> Any:
  """Commits the scalar leaves (step counts) to the devices of the first array in `state`.

  A fresh count is uncommitted, the one a step returns is committed; next to committed
  host-memory arrays that difference makes jit compile the step a second time.
  """
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array) and x.ndim]
  if not leaves or isinstance(leaves[0], jax.core.Tracer):
    return state
  sharding = leaves[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    target = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  elif len(sharding.device_set) == 1:
    target = jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
  else:
    return state
  return jax.tree.map(
      lambda x: jax.device_put(x, target) if isinstance(x, jax.Array) and not x.ndim else x, state)


def offload_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Keeps `inner`'s state in host memory; each update brings it in and puts it back.

  Only where the state lives changes: the state type, the maths and the results are
  `inner`'s. Scalars (step counts) stay on the device. Used by `muon(...,
  offload_momentum=True)` for the Muon momentum, which is still orthogonalized as
  whole matrices on the device.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> tx = mo.offload_state(mo.scale_by_muon_momentum(0.9))
    >>> s = tx.init({"w": jnp.ones((2, 2))})
    >>> s.mu["w"].sharding.memory_kind
    'pinned_host'
  """
  move = lambda f: (lambda tree: jax.tree.map(lambda x: f(x) if jnp.ndim(x) else x, tree))
  to_host = move(lambda x: jax.device_put(x, jax.memory.Space.Host))
  to_device = move(lambda x: jax.device_put(x, jax.memory.Space.Device))
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    _check_host_memory()
    return _commit_scalars(to_host(inner.init(params)))

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = inner.update(updates, to_device(state), params, **extra_args)
    return updates, to_host(state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --- conversion ------------------------------------------------------------------------

def _describe(state: Any) -> str:
  fields = _field_names(state)
  kind = type(state).__name__
  return f"a {kind} with fields {list(fields)}" if fields is not None else f"a {kind}"


def _field_names(state: Any) -> Optional[tuple]:
  if hasattr(state, "_fields"):
    return tuple(state._fields)
  if isinstance(state, Mapping):
    return tuple(state)
  return None


def _layout_error(state: Any, where: str) -> ValueError:
  fields = _field_names(state)
  known = ", ".join(f"{t.__name__} ({b!r})" for b, t in _STATE_TYPES.items())
  if fields is None:
    return ValueError(f"{where}: expected an AdamW state, got {_describe(state)}. Known: {known}.")
  missing = [f for f in _FIELDS if f not in fields]
  unexpected = [f for f in fields if f not in _FIELDS]
  detail = (f"missing field(s) {missing}, unexpected field(s) {unexpected}"
            if missing or unexpected else "an unknown layout with the right field names")
  return ValueError(
      f"{where}: cannot read AdamW state {_describe(state)}: {detail}. Known layouts: {known}"
      " (an optax.adamw chain state is migrated too). Restore a checkpoint with the abstract "
      "state of the optimizer that wrote it, jax.eval_shape(tx.init, params), then convert it.")


def _to_reference(state: Any, params: Any, where: str) -> ReferenceAdamState:
  """Any known layout (or an optax.adamw chain state) as a ReferenceAdamState on the device."""
  if (isinstance(state, tuple) and not hasattr(state, "_fields") and state
      and isinstance(state[0], optax.ScaleByAdamState)):
    state = state[0]  # optax.adamw's chain: its schedule counts equal the Adam count.
  if isinstance(state, FlatAdamState):
    _check_flat(state, _groups(params), where)
    return ReferenceAdamState(state.count, _from_flat(state.mu, params), _from_flat(state.nu, params))
  if not isinstance(state, (ReferenceAdamState, OffloadAdamState, optax.ScaleByAdamState)):
    raise _layout_error(state, where)
  for field in ("mu", "nu"):
    if _shapes(getattr(state, field)) != _shapes(params):
      raise ValueError(
          f"{where}: the {field} of {type(state).__name__} does not match these params "
          f"(structure or shapes differ). Were other params or labels used to build it?")
  return ReferenceAdamState(state.count, _to_device(state.mu), _to_device(state.nu))


def _shapes(tree: Any) -> tuple:
  """Structure and leaf shapes of a tree, for comparing a state's moments with params."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_paths.is_masked)
  return treedef, [None if _paths.is_masked(x) else tuple(x.shape) for x in leaves]


def _from_reference(ref: ReferenceAdamState, params: Any, backend: str) -> Any:
  if backend == "flat":
    return FlatAdamState(ref.count, _to_flat(ref.mu, params), _to_flat(ref.nu, params))
  if backend == "offload":
    _check_host_memory()
    return _commit_scalars(OffloadAdamState(ref.count, _to_host(ref.mu), _to_host(ref.nu)))
  return _STATE_TYPES[backend](ref.count, ref.mu, ref.nu)


def _convert_one(state: Any, params: Any, backend: str, where: str) -> Any:
  return _from_reference(_to_reference(state, params, where), params, backend)


def convert_adam_state(state: Any, params: Any, to_backend: str, *,
                       labels: _routing.Labels = None) -> Any:
  """Converts the AdamW state inside `state` to the layout of another backend.

  Works on a whole `muon(...)` state (also chained or wrapped: the AdamW branch is found
  inside its `optax.PartitionState`) or on a standalone `adamw(...)` state. Everything
  else is returned unchanged. The next update with the new backend equals the one the
  old backend would have made. An `optax.adamw` chain state is migrated; an unknown or
  incomplete layout raises a ValueError naming the missing and unexpected fields.

  Args:
    state: the optimizer state to convert (restore checkpoints with the abstract state
      of the optimizer that wrote them, then convert).
    params: the params the state belongs to (arrays or `jax.ShapeDtypeStruct`s).
    to_backend: "optax", "flat", "offload", "reference" or "auto".
    labels: the `labels` given to `muon` (None: the default rules); they say which
      leaves the AdamW branch holds.

  Returns:
    `state` with its AdamW state in the layout of `to_backend`.

  Example:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    >>> state = mo.muon(adam_backend="flat").init(params)
    >>> state = mo.convert_adam_state(state, params, "optax")
    >>> tx = mo.muon(adam_backend="optax")
    >>> u, state = tx.update(params, state, params)
  """
  backend = resolve_backend(to_backend)
  found = []

  def visit(node, path):
    if isinstance(node, optax.PartitionState) and _routing.ADAM in node.inner_states:
      where = f"{path}.inner_states[{_routing.ADAM!r}]"
      branch = node.inner_states[_routing.ADAM]
      if not isinstance(branch, optax.MaskedState):
        raise _layout_error(branch, where)
      label_tree = _routing.resolve_labels(labels, params)
      branch_params = jax.tree.map(
          lambda l, p: p if l == _routing.ADAM else optax.MaskedNode(), label_tree, params)
      found.append(where)
      inner = _convert_one(branch.inner_state, branch_params, backend, where + ".inner_state")
      return node._replace(inner_states={**node.inner_states, _routing.ADAM: optax.MaskedState(inner)})
    if isinstance(node, tuple(_STATE_TYPES.values())):
      found.append(path)
      return _convert_one(node, params, backend, path)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      return type(node)(*(visit(v, f"{path}.{f}") for f, v in zip(node._fields, node)))
    if isinstance(node, (tuple, list)):
      return type(node)(visit(v, f"{path}[{i}]") for i, v in enumerate(node))
    if isinstance(node, dict):
      return {k: visit(v, f"{path}[{k!r}]") for k, v in node.items()}
    return node

  out = visit(state, "state")
  if not found:
    raise ValueError(
        f"found no AdamW state in {_describe(state)}: expected a muon(...) state (an "
        f"optax.PartitionState with an {_routing.ADAM!r} branch) or one of "
        f"{[t.__name__ for t in _STATE_TYPES.values()]}.")
  return out
