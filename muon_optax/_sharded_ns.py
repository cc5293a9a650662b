"""Newton–Schulz on a device mesh, partitioned by whole matrices and balanced by flops.

Every matrix is orthogonalized whole on one device; no collective runs inside the
iterations. Same-shape matrices form a group, kept in one layout: the stack
(count, rows, cols) sharded along cols. Each group deals as many full *rounds*
(one matrix per device) as it can: one all-to-all moves them to their devices and
one brings the results back. The few matrices left over in each group (fewer than
the device count) are gathered and packed together, largest first, into shared rounds
whose shape is the largest of their members, so a group of 4 matrices on 8 devices
shares its round with other leftovers instead of idling half of the mesh.
Zero-padding is exact for Newton–Schulz (the Gram matrix keeps its block structure
and ‖X‖_F is unchanged), and an empty slot is an all-zero matrix, whose result is 0.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz import newton_schulz_flops
from muon_optax._state_sharding import check_data_axis

Item = tuple[int, int]  # (stack index, matrix index in that stack)


class Round(NamedTuple):
  rows: int
  cols: int
  slots: tuple[Optional[Item], ...]  # one per device; None is an all-zero matrix


def plan_rounds(shapes: list[tuple[int, int, int]], devices: int
                ) -> tuple[dict[tuple[int, int], list[Item]], list[Round]]:
  """Deals the matrices of stacks with shapes (count, rows, cols) over `devices`.

  Returns every shape group's matrices in stack order (the first
  len - len % devices of them fill the group's own full rounds), and the shared
  rounds holding every group's leftovers.
  """
  groups: dict[tuple[int, int], list[Item]] = {}
  for i, (count, rows, cols) in enumerate(shapes):
    groups.setdefault((rows, cols), []).extend((i, j) for j in range(count))
  leftovers = [(shape, item) for shape, items in groups.items()
               for item in items[len(items) - len(items) % devices:]]
  # Largest first, so each shared round pads its members as little as possible.
  leftovers.sort(key=lambda e: -newton_schulz_flops(*e[0], 1))
  shared = []
  for start in range(0, len(leftovers), devices):
    chunk = leftovers[start:start + devices]
    rows = max(shape[0] for shape, _ in chunk)
    cols = max(shape[1] for shape, _ in chunk)
    slots = tuple(item for _, item in chunk) + (None,) * (devices - len(chunk))
    shared.append(Round(rows, cols, slots))
  return groups, shared


def per_device_flops(shapes: list[tuple[int, int, int]], devices: int, steps: int) -> int:
  """Newton–Schulz flops each device runs under `plan_rounds`."""
  groups, shared = plan_rounds(shapes, devices)
  return (sum(len(items) // devices * newton_schulz_flops(*shape, steps)
              for shape, items in groups.items())
          + sum(newton_schulz_flops(r.rows, r.cols, steps) for r in shared))


def mesh_axes(mesh: Mesh, data_axis: str) -> tuple[str, ...]:
  """All mesh axes, data axis first: the matrices are dealt over every device."""
  check_data_axis(mesh, data_axis)
  return (data_axis,) + tuple(a for a in mesh.axis_names if a != data_axis)


def is_explicit(mesh: Mesh) -> bool:
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def sharded_solver(ns_fn: Callable[[jax.Array], jax.Array], mesh: Mesh, data_axis: str):
  """A solver for `orthogonalize_leaves` that runs `ns_fn` on whole matrices, one
  round slot per device, inside `jax.shard_map`."""
  axes = mesh_axes(mesh, data_axis)
  devices = mesh.size
  constrain = jax.lax.with_sharding_constraint

  def by_cols(x):  # a group's resting layout: every matrix split along its columns
    return constrain(x, P(None, None, axes) if x.shape[-1] % devices == 0 else P())

  def local_ns(stack):  # (devices · k, rows, cols), device d holding rows [d·k, (d+1)·k)
    stack = constrain(stack, P(axes))
    return jax.shard_map(ns_fn, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=P(axes), out_specs=P(axes))(stack)

  def solve_shared(shared, leftovers, dtype):
    """Orthogonalizes the leftovers in their shared rounds: {item: result}."""
    by_shape: dict[tuple[int, int], list[Round]] = {}
    for r in shared:
      by_shape.setdefault((r.rows, r.cols), []).append(r)
    results = {}
    for (rows, cols), rounds in by_shape.items():
      def padded(item):
        if item is None:
          return jnp.zeros((rows, cols), dtype)
        x = leftovers[item].astype(dtype)
        return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))
      order = [r.slots[d] for d in range(devices) for r in rounds]  # device-major
      out = constrain(local_ns(jnp.stack([padded(item) for item in order])), P())
      for pos, item in enumerate(order):
        if item is not None:
          results[item] = out[pos, :leftovers[item].shape[0], :leftovers[item].shape[1]]
    return results

  def solve_auto(stacks):
    groups, shared = plan_rounds([s.shape for s in stacks], devices)
    results, leftovers = {}, {}
    for items in groups.values():
      group = by_cols(jnp.concatenate([stacks[i] for i in dict.fromkeys(i for i, _ in items)]))
      dealt = len(items) - len(items) % devices
      if dealt:  # device d takes the group's matrices [d·k, (d+1)·k)
        out = by_cols(local_ns(group[:dealt]))
        results.update((item, out[pos]) for pos, item in enumerate(items[:dealt]))
      if dealt < len(items):
        rest = constrain(group[dealt:], P())  # the group's leftovers, gathered once
        leftovers.update((item, rest[pos]) for pos, item in enumerate(items[dealt:]))
    results.update(solve_shared(shared, leftovers, jnp.result_type(*stacks)))
    return [jnp.stack([results[(i, j)] for j in range(s.shape[0])]).astype(s.dtype)
            for i, s in enumerate(stacks)]

  def solve(stacks):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      if not is_explicit(mesh):
        return solve_auto(stacks)
      # Explicit axes: plan in Auto mode, hand results back with the inputs' shardings.
      out = [jax.typeof(s).sharding for s in stacks]
      return jax.sharding.auto_axes(solve_auto, out_sharding=out)(stacks)

  return solve
