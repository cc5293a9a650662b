"""Newton–Schulz on a device mesh: one packed exchange in, local work, one out.

The assignment is static, computed from the shapes at trace time (`rounds.plan_rounds`)
and balanced by flops: same-shape matrices are dealt in *rounds* (one matrix per
device), each round of one shape. The few left over in a shape group fill a partial
round of their own, or are split by columns over groups of g devices, g chosen per
round (rounds of different splits fill the devices): NS(X) restricted to some columns
only needs the whole X Xᵀ, summed over the g parts wherever the iteration forms it
(`newton_schulz_column_parts`). Whole matrices need no collective inside the iterations.
Partial rounds lie on devices the others leave free (`rounds.placed`), and rounds on
disjoint devices share one slot of the buffers: a device receives its own round's
pieces there, zeros only where no round has a matrix for it.
The local work runs one round after another (the split rounds of one shape and split
together, as many as fit the memory cap, `MeshLayout.memory`), each waiting on the last
one's results, so that one round's temporaries are live at a time; the rounds travel in
`MeshLayout.exchanges` exchanges (by default as many as memory needs), one after another.

The exchange is a `jax.shard_map`, which every backend compiles (TPU included), over
the mesh's devices with each axis cut into its prime factors (`FactorMesh`): a group of
g consecutive devices is then a set of trailing factor axes, which collectives can name.
Its layouts are given, not discovered: the stacks lie as the state does
(`state_shardings`), and the results go where `MeshLayout` says the params are.
- in (`exchange_in`): each device packs its shard of every matrix into one buffer row
  per owner, and a single all-to-all delivers them;
- local work (`local_work`): each owner reassembles its matrices and orthogonalizes
  them, one unit of rounds after another;
- out (`exchange_out`): one all-gather of the owners' packed results if every update
  is wanted replicated, else one all-to-all that sends each device its shard of every
  result, in the layout the update is wanted in.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz.kernel import Kernel
from muon_optax._placement.mesh_layout import MeshLayout
from muon_optax._placement.shardings import shard_mapped
from muon_optax._sharded_ns.exchange_in import send
from muon_optax._sharded_ns.exchange_out import gathered, scattered, to_send
from muon_optax._sharded_ns.exchange_schedule import (
  ExchangePlan,
  exchanges_by_need,
  split_into_exchanges,
  units,
)
from muon_optax._sharded_ns.exchange_stacks import ExchangeStacks
from muon_optax._sharded_ns.factor_mesh import FactorMesh
from muon_optax._sharded_ns.in_place import in_place
from muon_optax._sharded_ns.local_work import MeshKernel, solve
from muon_optax._sharded_ns.rounds import Round, plan_rounds, whole_flops
from muon_optax._sharded_ns.split_cost import memory_budget
from muon_optax._sharded_ns.stack_shards import owned, owned_share, shards_of
from muon_optax._util.order import after


class _Exchange(NamedTuple):
  """One exchange of some rounds: in (`exchange_in`), the local work (`local_work`), out
  (`exchange_out`). `budget` caps one unit of local work (`memory_budget`)."""

  stacks: ExchangeStacks
  kernel: MeshKernel
  budget: Optional[float]

  def run(self, arrays, rounds: list[Round], wait=()) -> tuple[dict, list]:
    """One exchange of the matrices of `rounds`, sent once the arrays in `wait` are
    computed: ({item: its result, in the wanted layout}, the arrays that are computed
    once it is done)."""
    stacks = self.stacks
    plan = ExchangePlan.of(rounds, stacks.ins, stacks.outs, stacks.gather, stacks.devices)
    received = send(stacks, after(arrays, wait), plan)
    sent = solve(stacks, self.kernel, received, plan,
                 lambda rounds: units(rounds, self.budget, self.kernel.priced),
                 lambda t, x: to_send(stacks, t, x.astype(stacks.result_dtype), plan))
    return gathered(stacks, sent, plan) if stacks.gather else scattered(stacks, sent, plan)


class OwnedWork(NamedTuple):
  """The stacks orthogonalized where they lie, beside an exchange: the flops each device
  runs on them, and their shapes, whose shard counts in the memory cap's."""

  flops: float = 0.0
  shapes: tuple[tuple[int, int, int], ...] = ()


NO_OWNED_WORK = OwnedWork()


def _lowered(stacks: ExchangeStacks, kernel: MeshKernel, layout: MeshLayout,
             beside: OwnedWork):
  """The per-device body over all rounds, in `layout.exchanges` exchanges (None: as many
  as memory needs, `exchanges_by_need`) one after another, so that only one's buffers
  are live at once; `layout.memory` caps one unit's working set and the buffers, as a
  multiple of what a device holds of these stacks and the owned ones `beside` them
  (their shard, or their updates in the wanted layout where that is more)."""
  def split_ok(item, g):
    i = item[0]
    return kernel.splits and (stacks.gather or stacks.outs[i].grid == stacks.ins[i].grid)

  held = sum(count * out.shard[0] * out.shard[1] for (count, _, _), out
             in zip(stacks.shapes, stacks.outs))
  held += sum(math.prod(shape) for shape in beside.shapes) / stacks.devices
  budget = memory_budget([*stacks.shapes, *beside.shapes], stacks.devices, layout.memory, held)
  rounds = plan_rounds(stacks.shapes, stacks.devices, kernel.priced, split_ok,
                       stacks.fmesh.groups(), [shards.grid[1] for shards in stacks.ins],
                       layout.flops_per_byte, budget, beside.flops)
  exchange = _Exchange(stacks, kernel, budget)
  count = layout.exchanges or exchanges_by_need(rounds, stacks.ins, stacks.outs, stacks.gather,
                                                budget, kernel.priced)
  parts = split_into_exchanges(rounds, count)

  def lower(arrays):
    done, finished = {}, []
    for chunk in parts:  # one after another, each sent once the last one's results are in
      results, finished = exchange.run(arrays, chunk, wait=finished)
      done.update(results)
    return [jnp.stack([done[i, j] for j in range(shape[0])]).astype(dtype)
            for i, (shape, dtype) in enumerate(zip(stacks.shapes, stacks.dtypes))]

  return lower


def wire_dtypes(kernel: Kernel, layout: MeshLayout, dtypes) -> tuple[Any, Any]:
  """The dtypes an exchange moves the matrices in and their results back in, each None
  for the matrices' own: both the layout's `exchange_dtype` where it is given. By
  default the matrices travel whole, since rounding them costs accuracy where the
  iteration carries X in float32 between its 16-bit products; their results go back in
  bfloat16 where Newton–Schulz rounds its operands to 16 bits and the matrices are
  wider: its rounding, 2⁻⁹ of each entry, is far below the iteration's own error
  (benchmarks/results/newton_schulz_exchange.txt)."""
  if layout.exchange_dtype is not None:
    return layout.exchange_dtype, layout.exchange_dtype
  widest = jnp.result_type(*dtypes)
  sixteen = kernel.operands is not None and kernel.operands.itemsize == 2
  return None, (jnp.dtype(jnp.bfloat16) if sixteen and widest.itemsize > 2 else None)


def _exchanged(kernel: Kernel, layout: MeshLayout, arrays, specs, out_specs,
               beside: OwnedWork = NO_OWNED_WORK):
  """The exchange of `arrays` (lying in `specs`, over the layout's mesh) as a shard_map
  over the factor mesh, its results laid out in `out_specs` (or replicated). Owned stacks
  stay where they are, and the rest is dealt around their work (`beside`)."""
  fmesh = FactorMesh.of(layout.mesh)
  mine = [owned(spec, tuple(x.shape), layout.mesh) for x, spec in zip(arrays, specs)]
  if any(mine):
    wanted = out_specs or [None] * len(arrays)
    rest = [k for k, m in enumerate(mine) if not m]
    beside = OwnedWork(
        sum(owned_share(spec, tuple(x.shape), layout.mesh)
            * whole_flops(*x.shape[1:], kernel.priced)
            for x, spec, m in zip(arrays, specs, mine) if m),
        tuple(tuple(x.shape) for x, m in zip(arrays, mine) if m))
    moved = iter(_exchanged(kernel, layout, [arrays[k] for k in rest], [specs[k] for k in rest],
                            None if out_specs is None else [out_specs[k] for k in rest], beside)
                 if rest else [])
    return [in_place(kernel.whole, fmesh, x, spec, out) if m else next(moved)
            for x, spec, out, m in zip(arrays, specs, wanted, mine)]
  shapes = [tuple(s.shape) for s in arrays]
  ins = [shards_of(NamedSharding(fmesh.mesh, fmesh.spec(spec)), shape, fmesh.mesh)
         for spec, shape in zip(specs, shapes)]
  gather = out_specs is None
  outs = ([shards_of(NamedSharding(fmesh.mesh, P()), shape, fmesh.mesh) for shape in shapes]
          if gather else
          [shards_of(NamedSharding(fmesh.mesh, fmesh.spec(spec)), shape, fmesh.mesh)
           for spec, shape in zip(out_specs, shapes)])
  dtypes = [s.dtype for s in arrays]
  stacks = ExchangeStacks.of(fmesh, shapes, dtypes, ins, outs, gather,
                             *wire_dtypes(kernel, layout, dtypes))
  lower = _lowered(stacks, MeshKernel(kernel, fmesh), layout, beside)
  body = shard_mapped(lambda *xs: tuple(lower(list(xs))), fmesh.mesh,
                      tuple(shards.spec for shards in ins), tuple(shards.spec for shards in outs))
  return list(body(*arrays))


def sharded_solver(kernel: Kernel, layout: MeshLayout):
  """A solver for `orthogonalize_leaves` that runs `kernel` on whole matrices dealt over
  the mesh of `layout`, with one packed exchange in and one out (see the module doc);
  matrices split by columns over several devices run `kernel.column_parts`, where it
  has one, and `kernel.priced` sizes the flop estimates that balance the work.

  The solver takes the stacks, the PartitionSpec (over the mesh) each lies in, and the
  specs its results are wanted in, or None for replicated results.
  """
  def solve_stacks(arrays, specs, out_specs=None):
    if not arrays:
      return []
    if layout.mesh.size == 1:
      return [kernel.whole(x) for x in arrays]
    run = lambda xs: _exchanged(kernel, layout, list(xs), specs, out_specs)
    if not layout.explicit:
      return run(arrays)
    # Explicit axes: exchange in Auto mode, hand the results back typed as wanted.
    wanted = out_specs if out_specs is not None else [P()] * len(arrays)
    arrays = [jax.sharding.reshard(x, NamedSharding(layout.mesh, spec))
              for x, spec in zip(arrays, specs)]
    return jax.sharding.auto_axes(run, out_sharding=[NamedSharding(layout.mesh, spec)
                                                     for spec in wanted])(arrays)

  return solve_stacks
