"""The stacks one exchange moves, as every part of it reads them: their shapes and dtypes,
how they lie on the factor mesh and how their results are wanted, and the choices that
depend on which device runs the code (`switch`, `variants`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from muon_optax._sharded_ns.factor_mesh import FactorMesh, linear_index
from muon_optax._sharded_ns.rounds import Round
from muon_optax._sharded_ns.stack_shards import StackShards


class ExchangeStacks(NamedTuple):
  """The stacks (count, rows, cols) an exchange moves over `fmesh`: stack i lies as
  `ins[i]` says, and its results are wanted as `outs[i]` says, or on every device
  (`gather`: then `outs` are replicated layouts). Stacks that lie alike, in and out,
  share a `kind` (its number, by stack). The matrices travel in `wire` and their
  results back in `wire_back` where given (`dtype`, `result_dtype`); each result is
  handed over in its stack's own dtype at the end."""

  fmesh: FactorMesh
  shapes: list[tuple[int, int, int]]
  dtypes: list[Any]
  ins: list[StackShards]
  outs: list[StackShards]
  gather: bool
  kind: list[int]
  wire: Any = None
  wire_back: Any = None

  @classmethod
  def of(cls, fmesh: FactorMesh, shapes, dtypes, ins: list[StackShards], outs: list[StackShards],
         gather: bool, wire: Any = None, wire_back: Any = None) -> ExchangeStacks:
    kinds = {}
    kind = [kinds.setdefault(pair, len(kinds)) for pair in zip(ins, outs)]
    return cls(fmesh, shapes, dtypes, ins, outs, gather, kind, wire, wire_back)

  @property
  def axes(self) -> tuple[str, ...]:
    return tuple(self.fmesh.mesh.axis_names)

  @property
  def devices(self) -> int:
    return self.fmesh.mesh.size

  @property
  def sizes(self) -> dict:
    return dict(self.fmesh.mesh.shape)

  @property
  def dtype(self):
    """The dtype the matrices travel in, and Newton–Schulz is handed them in: `wire`,
    else every stack's, promoted."""
    return jnp.dtype(self.wire) if self.wire is not None else jnp.result_type(*self.dtypes)

  @property
  def result_dtype(self):
    """The dtype the results travel back in: `wire_back`, else the matrices'."""
    return jnp.dtype(self.wire_back) if self.wire_back is not None else self.dtype

  def device_index(self) -> jax.Array:
    """This device's position, row-major over the mesh axes."""
    return linear_index(self.axes, self.sizes)

  def switch(self, index_table: list[int], branches: list[Callable], *args):
    """`branches[index_table[this device]](*args)`, statically when all agree."""
    if len(set(index_table)) == 1:
      return branches[index_table[0]](*args)
    index = jnp.asarray(index_table, jnp.int32)[self.device_index()]
    return jax.lax.switch(index, branches, *args)

  def variants(self, r: Round) -> tuple[list[int], list[int]]:
    """One stack of each kind (how it lies in and out) among a round's members, and each
    device's index into them: stacks that lie alike are assembled and sent back alike,
    so that a round of one kind needs no switch over its devices, however many leaves
    it holds. A device with no matrix in the round takes the first member's: its
    result is never read, any works."""
    first = {}
    for item in r.slots:
      if item is not None:
        first.setdefault(self.kind[item[0]], item[0])
    order = list(first)
    return ([first[k] for k in order],
            [order.index(self.kind[item[0]]) if item is not None else 0 for item in r.slots])
