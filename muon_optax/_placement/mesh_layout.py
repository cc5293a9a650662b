"""`MeshLayout`: the mesh an optimizer runs on, and how the params lie on it."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from jax.sharding import Mesh

from muon_optax._placement.shardings import DataAxis, data_axes, is_explicit

PARAM_LAYOUTS = ("auto", "sharded", "replicated")
# What a byte sent between devices costs, in 16-bit matmul flops: an accelerator's matmul
# rate over its interconnect bandwidth (TPU v5p: 459 TFLOP/s in bfloat16 over 600 GB/s
# of ICI).
FLOPS_PER_BYTE = 750
# The exchanges memory asks for by default where one exchange's buffers do not fit the
# memory cap: measured on the TPU compiler (benchmarks/results/scale_tpu.jsonl).
EXCHANGES = 4


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """Where the distributed update runs and where its results go.

  The exchange and the packed gather are `jax.shard_map`s, so they must be told the
  layouts that `custom_partitioning` used to read from XLA: the state lies as
  `state_shardings(tx, params, mesh, data_axis)` lays it out, and the updates are wanted
  like the params.

  Attributes:
    mesh: the device mesh; Newton–Schulz work is dealt over all its devices.
    params: "sharded" (FSDP / ZeRO-3: updates stay split like the state), "replicated"
      (ZeRO-1: every device gets every update, in one packed all-gather), or "auto":
      read from the params' types on an Explicit mesh, "sharded" on an Auto one (whose
      arrays carry no layout while traced). A wrong guess costs collectives, never
      correctness.
    data_axis: the state's data-parallel axis or axes, as given to `state_shardings`
      (default "data", or every mesh axis if the mesh has none of that name).
    exchanges: the matrices travel in this many exchanges, one after another, each
      with its own collectives in and out: more bound the peak memory of the buffers
      and Newton–Schulz temporaries lower, at two collectives each. Default (None): as
      memory needs, one where a single exchange's buffers fit the memory cap beside
      the largest unit of Newton–Schulz work, else 4. An integer forces the count,
      capped by the rounds: rounds that share devices travel together, so a tree of 4
      rounds runs `exchanges=8` as 4.
    flops_per_byte: what a byte between devices costs in 16-bit matmul flops, which
      decides whether splitting a matrix over devices pays: each device then does 1/g
      of its flops but receives about three m×m blocks a step, in a few collectives
      a step whose fixed cost is priced as bytes too (default: a TPU v5p's bfloat16
      matmul rate over its interconnect; 0 balances flops alone). A float32 flop at
      HIGHEST precision counts as six, its bfloat16 passes.
    memory: caps the Newton–Schulz work a device holds at once (a matrix, its part,
      or the split rounds run together) at this multiple of the Muon state shard (the
      Muon leaves' bytes over the devices): a matrix whose work would take more is
      split over more devices, at m×m traffic and collectives that grow with the
      split; a split matrix forms its m×m products whole where its work with them
      fits half the cap, else a few blocks at a time, a collective each. Default
      (None): 2, and never below 32 MB, so that a small model's matrices stay whole;
      `math.inf`: no cap.

  Examples:
    >>> import jax, muon_optax as mo
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = mo.muon(0.02, mesh=mo.MeshLayout(mesh, params="replicated"))  # ZeRO-1
  """

  mesh: Mesh
  params: str = "auto"
  data_axis: DataAxis = "data"
  exchanges: Optional[int] = None
  flops_per_byte: float = FLOPS_PER_BYTE
  memory: Optional[float] = None

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise ValueError(f"MeshLayout needs a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
    if self.params not in PARAM_LAYOUTS:
      raise ValueError(f"MeshLayout(params={self.params!r}): choose one of {list(PARAM_LAYOUTS)}.")
    if self.exchanges is not None and (isinstance(self.exchanges, bool) or not isinstance(
        self.exchanges, int) or self.exchanges < 1):
      raise ValueError(f"MeshLayout(exchanges={self.exchanges!r}) must be a positive integer, "
                       "or None for as many as memory needs.")
    if not self.flops_per_byte >= 0:
      raise ValueError(f"MeshLayout(flops_per_byte={self.flops_per_byte!r}) must be ≥ 0.")
    number = isinstance(self.memory, (int, float)) and not isinstance(self.memory, bool)
    if self.memory is not None and not (number and self.memory > 0):
      raise ValueError(f"MeshLayout(memory={self.memory!r}) must be a positive multiple of the "
                       "Muon state shard, math.inf (no cap), or None (the default cap).")
    axis = self.data_axis
    if axis == "data" and "data" not in self.mesh.axis_names:
      axis = tuple(self.mesh.axis_names)
    object.__setattr__(self, "data_axis", data_axes(self.mesh, axis))

  @property
  def platform(self) -> str:
    """The platform of the mesh's devices ("cpu", "gpu", "tpu"), whose defaults
    Newton–Schulz takes on this mesh."""
    return self.mesh.devices.flat[0].platform

  @property
  def explicit(self) -> bool:
    return is_explicit(self.mesh)

  def gathers(self) -> bool:
    """Whether updates are wanted replicated (ZeRO-1) when the types do not say."""
    return self.params == "replicated"


def as_mesh_layout(mesh: Union[None, Mesh, MeshLayout, Any]):
  """The `MeshLayout` meant by a `mesh=` argument (None stays None)."""
  if mesh is None or isinstance(mesh, MeshLayout):
    return mesh
  if isinstance(mesh, Mesh):
    return MeshLayout(mesh)
  raise ValueError(f"mesh= takes a jax.sharding.Mesh or a muon_optax.MeshLayout, got "
                   f"{type(mesh).__name__}.")
