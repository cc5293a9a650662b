"""The local work of an exchange: each round's matrices assembled from what the device
received, orthogonalized, and handed on, one unit of rounds after another so that one
unit's Newton–Schulz temporaries are live at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

from muon_optax._newton_schulz.kernel import Kernel
from muon_optax._sharded_ns.exchange_in import Received, matrix
from muon_optax._sharded_ns.exchange_schedule import ExchangePlan, Unit
from muon_optax._sharded_ns.exchange_stacks import ExchangeStacks
from muon_optax._sharded_ns.factor_mesh import FactorMesh
from muon_optax._sharded_ns.rounds import Round
from muon_optax._sharded_ns.split_cost import rows_split
from muon_optax._util.order import after


class MeshKernel(NamedTuple):
  """A `Kernel` on a factor mesh: whole matrices on their device, column parts over the
  group of devices that shares them."""

  kernel: Kernel
  fmesh: FactorMesh

  @property
  def priced(self):
    """The settings the cost model weighs (`Kernel.priced`)."""
    return self.kernel.priced

  @property
  def splits(self) -> bool:
    """Whether matrices may be split by columns at all."""
    return self.kernel.column_parts is not None

  def __call__(self, batch, split: int, product_chunks: int):
    """The Newton–Schulz of a batch of matrices, or of their column parts over groups of
    `split` devices, its m×m products formed in `most_product_chunks` chunks."""
    if split == 1:
      return self.kernel.whole(batch)
    fmesh = self.fmesh
    rows = fmesh.row_blocks(split, product_chunks) if rows_split(batch.shape[-2], split) else None
    return self.kernel.column_parts(batch, split, lambda v, op: fmesh.group_reduce(v, op, split),
                                    rows=rows)


def solve(stacks: ExchangeStacks, kernel: MeshKernel, received: Received, plan: ExchangePlan,
          units_of: Callable[[list[Round]], list[Unit]], keep: Callable) -> list:
  """Each round's matrix assembled, orthogonalized and passed to `keep(t, result)`, one
  unit after another (`exchange_schedule.units`): the next unit's assembly waits for what
  the last one kept (`after`), so that its matrices and Newton–Schulz temporaries are
  not live at the same time as theirs; a unit's m×m products are formed in as many
  chunks as it says. The other rounds of a slot are assembled with its first, before
  its Newton–Schulz, so that the buffer they arrived in is not kept live for them.
  Returns what `keep` returned, by round."""
  kept, last, early = {}, None, {}
  assemble = lambda t: matrix(stacks, t, received, plan)
  for unit, product_chunks in units_of(plan.rounds):
    batch = jnp.stack([early.pop(t) if t in early else assemble(t) for t in unit])
    mates = {u for t in unit for u in plan.slots[plan.slot[t]]} - set(unit) - set(kept)
    early.update((u, assemble(u)) for u in mates - set(early))
    # The last unit was one batch: one value of it suffices. The slot's other rounds
    # are assembled before this Newton–Schulz: left free, the TPU compiler assembles
    # them late and keeps the buffer they arrived in live all along.
    batch = after(batch, ([] if last is None else [last]) + [early[u] for u in sorted(mates)])
    batch = kernel(batch, plan.rounds[unit[0]].split, product_chunks)
    kept.update((t, keep(t, batch[k])) for k, t in enumerate(unit))
    last = kept[unit[0]]
  return [kept[t] for t in range(len(plan.rounds))]
