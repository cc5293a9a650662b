"""QK-clip (MuonClip): rescale query/key weights of attention heads whose logits grew too large."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from muon_optax._util import paths

MAX_LOGITS = "max_logits"  # the name under which attention modules sow S_h


def collect_max_logits(tree: Any) -> dict[str, jax.Array]:
  """{attention module path: S_h} from a pytree of sown max logits.

  A leaf whose path contains `max_logits` belongs to the module above that name (so
  `nnx.Intermediate` state from `nnx.capture` reads as it is, without Flax here), any
  other leaf to its own path. A module that sowed several times (called more than
  once) gets the elementwise max of its entries.
  """
  out: dict[str, jax.Array] = {}
  for path, leaf in paths.leaves_with_path(tree):
    parts = path.split("/")
    if MAX_LOGITS in parts:
      path = "/".join(parts[:len(parts) - 1 - parts[::-1].index(MAX_LOGITS)])
    out[path] = leaf if path not in out else jnp.maximum(out[path], leaf)
  return out


# (query suffix, key suffix) of '/'-joined parameter paths; the path before the suffix
# is the attention module's path, the key under which its max logits are passed.
DEFAULT_PAIRS: tuple[tuple[str, str], ...] = (
    ("query/kernel", "key/kernel"),
    ("q_proj/kernel", "k_proj/kernel"),
)


class _Leaf(NamedTuple):
  path: str
  exponent: float  # γ's power: alpha for the query side, 1 − alpha for the key side
  is_kernel: bool  # kernels carry a leading d_model axis; biases do not


def _suffix_match(path: str, suffix: str) -> Optional[str]:
  """The module path if `path` is `suffix` or ends with '/' + `suffix`, else None."""
  if path == suffix:
    return ""
  return path[: -len(suffix) - 1] if path.endswith("/" + suffix) else None


def _join(module: str, name: str) -> str:
  return f"{module}/{name}" if module else name


def _find_pairs(paths: set[str], masked: set[str], pairs: Sequence[tuple[str, str]],
                alpha: float) -> dict[str, list[_Leaf]]:
  """{module path: the q/k kernels (and biases) whose update QK-clip rewrites}."""
  found: dict[str, list[_Leaf]] = {}
  for path in sorted(paths):
    for q_suffix, k_suffix in pairs:
      module = _suffix_match(path, q_suffix)
      if module is None:
        continue
      k_path = _join(module, k_suffix)
      if k_path not in paths:
        where = "is in another optax.partition branch" if k_path in masked else "does not exist"
        raise ValueError(
            f"qk_clip: query kernel {path!r} has no key kernel: {k_path!r} {where}. "
            "Chain qk_clip after the whole optimizer, or pass pairs= naming the key.")
      leaves = [_Leaf(path, alpha, True), _Leaf(k_path, 1.0 - alpha, True)]
      for kernel, exponent in ((path, alpha), (k_path, 1.0 - alpha)):
        # q = x W_q + b_q scales by γ^α only if b_q scales with W_q.
        if kernel.endswith("kernel"):
          bias = kernel[: -len("kernel")] + "bias"
          if bias in masked:
            raise ValueError(
                f"qk_clip: bias {bias!r} must be rescaled with {kernel!r} but is in another "
                "optax.partition branch. Chain qk_clip after the whole optimizer.")
          if bias in paths:
            leaves.append(_Leaf(bias, exponent, False))
      found[module] = leaves
      break
  return found


def _per_column(x: jax.Array, shape: tuple[int, ...], n_lead: int, is_kernel: bool,
                path: str, module: str) -> jax.Array:
  """Broadcasts a (*lead, heads) array over a q/k kernel or bias of `shape`.

  Kernels are (*lead, d_model, heads, head_dim) or (*lead, d_model, heads·head_dim);
  biases drop the d_model axis. Columns are never reshaped, so a sharded leaf stays put.
  """
  heads = x.shape[-1]
  split = len(shape) - n_lead == (3 if is_kernel else 2)
  fused = len(shape) - n_lead == (2 if is_kernel else 1)
  if not (split or fused) or tuple(shape[:n_lead]) != tuple(x.shape[:-1]):
    layout = "(d_model, heads, head_dim) or (d_model, heads·head_dim)" if is_kernel else \
        "(heads, head_dim) or (heads·head_dim,)"
    raise ValueError(
        f"qk_clip: {path!r} has shape {shape}; with max_logits[{module!r}] of shape "
        f"{x.shape} it must be {x.shape[:-1]} + {layout}.")
  if (split and shape[-2] != heads) or (fused and shape[-1] % heads):
    raise ValueError(
        f"qk_clip: head-count mismatch: {path!r} of shape {shape} cannot hold the {heads} "
        f"heads of max_logits[{module!r}] (shape {x.shape}).")
  cols = x[..., None] if split else jnp.repeat(x, shape[-1] // heads, axis=-1)
  return jnp.expand_dims(cols, n_lead) if is_kernel else cols


def _check_range(name: str, value: Any, low: float, high: float, open_low: bool) -> None:
  """Raises on a concrete value outside the range; a traced (injected) one passes."""
  if isinstance(value, (int, float, np.ndarray, np.number)):
    v = np.asarray(value, np.float64)
    if not (np.all(v > low if open_low else v >= low) and np.all(v <= high)):
      raise ValueError(
          f"qk_clip: {name} must be in {'(' if open_low else '['}{low}, {high}], got {value!r}.")


def qk_clip(
    tau: ArrayLike = 100.0,
    alpha: ArrayLike = 0.5,
    *,
    pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS,
) -> optax.GradientTransformationExtraArgs:
  """QK-clip: caps each attention head's max logit by rescaling its W_q and W_k.

  For every head h whose largest pre-softmax logit over the batch, S_h = max q·k/√d,
  exceeds τ, with γ_h = τ / S_h the updates are rewritten so that the new parameters are

      W_q^h ← γ_h^α (W_q^h + u_q^h),   W_k^h ← γ_h^(1−α) (W_k^h + u_k^h),

  i.e. u' = γ^e (p + u) − p. q/k biases, when present, scale with their kernels, so
  every logit of head h scales by exactly γ_h: if S_h was measured on p + u, the new
  max is τ. As in Kimi K2, S_h usually comes from this step's forward pass, on the
  weights before the update, so the cap holds up to one step's growth. Heads with
  S_h ≤ τ keep their update bit for bit. Chain it last, after the optimizer.

  Max logits are passed as an extra argument, `update(..., max_logits=...)`: a mapping
  from attention module path (the parameter path before the q/k suffix, '/'-joined or
  nested) to a (heads,) array, or (layers, heads) for a scanned stack of layers whose
  kernels have the leading layer axis. The `nnx.Intermediate` state sown by
  `muon_optax.nnx.ClipAttention` may be passed as it is (see `muon_optax.nnx.max_logits`).

  Args:
    tau: the logit cap τ > 0 (Kimi K2: 100).
    alpha: share α ∈ [0, 1] of the rescaling put on the query side.
    pairs: (query suffix, key suffix) path rules; a leaf whose path ends with a
      query suffix is paired with the sibling key leaf. Kernels are (d_model, heads,
      head_dim), as in `nnx.MultiHeadAttention`, or (d_model, heads·head_dim).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose update needs `params` and
    `max_logits`; it works under `optax.chain`, inside an `optax.partition` branch
    holding the q/k kernels and biases, and with `nnx.Optimizer.update(model, grads,
    max_logits=...)`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, muon_optax as mo
    >>> params = {"attn": {"query": {"kernel": jnp.ones((8, 2, 4))},
    ...                    "key": {"kernel": jnp.ones((8, 2, 4))}}}
    >>> tx = optax.chain(mo.muon(0.02), mo.qk_clip(tau=100.0))
    >>> state = tx.init(params)
    >>> u, state = tx.update(params, state, params,
    ...                      max_logits={"attn": jnp.array([50.0, 400.0])})

  References:
    Kimi Team 2025, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534.
  """
  _check_range("tau", tau, 0.0, np.inf, open_low=True)
  _check_range("alpha", alpha, 0.0, 1.0, open_low=False)
  pairs = tuple(pairs)

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("qk_clip needs params: call update(updates, state, params, max_logits=...).")
    if max_logits is None:
      raise ValueError(
          "qk_clip needs the per-head max logits: call update(updates, state, params, "
          "max_logits={attention module path: (heads,) array}), e.g. from "
          "muon_optax.nnx.max_logits(intermediates) of ClipAttention modules.")
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=paths.is_masked)
    masked = {paths.path_str(p) for p, x in flat if paths.is_masked(x)}
    param_of = dict(paths.leaves_with_path(params))
    found = _find_pairs(set(param_of), masked, pairs, alpha)
    if not found:
      raise ValueError(f"qk_clip found no query/key kernel pair in params with rules {pairs}.")
    logits = collect_max_logits(max_logits)
    for module in logits:
      if module not in found:
        raise ValueError(
            f"qk_clip: max_logits has an entry {module!r} but no attention module has that "
            f"path; modules with q/k kernels: {sorted(found)}.")

    new: dict[str, jax.Array] = {}
    update_of = dict(paths.leaves_with_path(updates))
    for module, leaves in found.items():
      if module not in logits:
        raise ValueError(
            f"qk_clip: no max_logits entry for attention module {module!r} "
            f"(has {leaves[0].path!r}); got entries {sorted(logits)}.")
      s = jnp.asarray(logits[module], jnp.float32)
      if s.ndim < 1:
        raise ValueError(f"qk_clip: max_logits[{module!r}] must be a (…, heads) array, got a scalar.")
      clipped = s > tau
      gamma = jnp.where(clipped, tau / jnp.where(clipped, s, 1.0), 1.0)
      for leaf in leaves:
        p, u = param_of[leaf.path], update_of[leaf.path]
        col = lambda x: _per_column(x, p.shape, s.ndim - 1, leaf.is_kernel, leaf.path, module)
        factor = col(gamma ** leaf.exponent)
        target = factor * (p.astype(jnp.float32) + u.astype(jnp.float32))
        new[leaf.path] = jnp.where(col(clipped), (target - p).astype(u.dtype), u)
    return paths.map_with_path(lambda path, u: new.get(path, u), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)
