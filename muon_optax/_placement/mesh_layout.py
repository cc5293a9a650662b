"""`MeshLayout`: the mesh an optimizer runs on, and how the params lie on it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional, Union

import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._placement.param_layout import FIX, ParamSpecs, param_specs, seen_specs
from muon_optax._placement.shardings import (
  DataAxis,
  add_data_axes,
  data_axes,
  data_spec,
  explicit_spec,
  is_explicit,
  same_spec,
)
from muon_optax._util import paths

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
  """Where the distributed update runs, how the params lie, and where results go.

  The exchange and the packed gather are `jax.shard_map`s, so they must be told the
  layouts: the state lies as `state_shardings(tx, params, layout)` lays it out (the
  params' layout with the data axes added), and the updates are wanted like the params.
  On an Explicit mesh the array types say it all; on an Auto mesh (`Mesh(devices,
  names)`, MaxText's and Flax's logical-axis rules) traced arrays carry no layout, so
  state it once, in the form you pass to `jax.jit`:

  - FSDP / ZeRO-3: `MeshLayout(mesh, params=mo.fsdp_shardings(params, mesh))`, or
    params="sharded".
  - ZeRO-1 (params replicated, state split): params="replicated", or the shardings.
  - Tensor parallelism (Megatron column- and row-parallel kernels on a "model" axis),
    alone or with FSDP on "data", and data × fsdp × tensor meshes (with
    `data_axis=("data", "fsdp")`): the params' shardings.
  - MoE experts on an expert axis: the shardings; an expert stack whole on its devices
    is orthogonalized where it lies and moves nothing.
  - Logical axis rules: what they resolve to, e.g. `nn.logical_to_mesh_sharding(
    nn.get_partition_spec(variables), mesh, rules)` (Linen) or
    `nnx.get_named_sharding(state, mesh)` (NNX).

  A bare `mesh=` (params="auto") reads the types on an Explicit mesh; on an Auto one it
  takes the layout the params carry when `init` gets them concrete, and otherwise (under
  `jax.jit(tx.init)` or `jax.eval_shape`) guesses FSDP and warns once: a wrong guess
  costs collectives (25–100× the exchange's for tensor parallelism), never correctness.

  Attributes:
    mesh: the device mesh; Newton–Schulz work is dealt over all its devices.
    params: the params' layout: a pytree of `NamedSharding` or `PartitionSpec` with the
      params' structure (what you pass to `jax.jit`; checked against the params at
      `init`, where a mismatch names the parameter); or "sharded" (FSDP: updates stay
      split like the state), "replicated" (ZeRO-1: every device gets every update, in
      one packed all-gather), "auto" (see above).
    data_axis: the state's data-parallel axis or axes, as given to `state_shardings`
      (default "data", or every mesh axis if the mesh has none of that name).
    exchanges: the matrices travel in this many exchanges, one after another, each
      with its own collectives in and out: more bound the peak memory of the buffers
      and Newton–Schulz temporaries lower, at two collectives each. Default (None): as
      memory needs, the fewest (1 to 3) whose largest exchange's buffers fit the memory
      cap beside the largest unit of Newton–Schulz work, else 4. An integer forces the count,
      capped by the rounds: rounds that share devices travel together, so a tree of 4
      rounds runs `exchanges=8` as 4.
    flops_per_byte: what a byte between devices costs in 16-bit matmul flops, which
      decides whether splitting a matrix over devices pays: each device then does 1/g
      of its flops but receives about three m×m blocks a step, in a few collectives
      a step whose fixed cost is priced as bytes too (default: a TPU v5p's bfloat16
      matmul rate over its interconnect; 0 balances flops alone). A float32 flop at
      HIGHEST precision counts as six, its bfloat16 passes.
    memory: caps the Newton–Schulz work a device holds at once (a matrix, its part,
      or the split rounds run together), and the buffers of an exchange beside it, at
      this multiple of the Muon state shard (the Muon leaves' bytes over the devices),
      plus the replicas of their updates a device holds where the params' layout
      replicates them over some axes (ZeRO-1, tensor parallelism beside a data axis),
      which its exchanges bring it anyway: a matrix whose work would take more is
      split over more devices, at m×m traffic and collectives that grow with the
      split; a split matrix forms its m×m products whole where its work with them
      fits half the cap, else a few blocks at a time, a collective each. Default
      (None): 2, and never below 32 MB, so that a small model's matrices stay whole;
      `math.inf`: no cap.
    exchange_dtype: the dtype the exchange moves the matrices and their results in,
      both ways (the updates come back in the momenta's dtype). Default (None): the
      matrices travel in their own dtype, and their results back in bfloat16 where
      Newton–Schulz rounds its operands to 16 bits (GPU and TPU) and the matrices are
      wider: a quarter fewer bytes under FSDP, more under ZeRO-1, whose way back is the
      larger, at no measurable cost in accuracy. "bfloat16" halves the bytes both ways,
      at some accuracy: Newton–Schulz then starts from rounded momenta.
      "float32" keeps float32 results whole too.

  Examples:
    >>> import jax, muon_optax as mo
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = mo.muon(0.02, mesh=mo.MeshLayout(mesh, params="replicated"))  # ZeRO-1
    >>> from jax.sharding import PartitionSpec as P
    >>> tp = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"),
    ...                    axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> params = {"fc": {"kernel": jax.numpy.ones((16, 64))},
    ...           "proj": {"kernel": jax.numpy.ones((64, 16))}}
    >>> megatron = {"fc": {"kernel": P(None, "model")}, "proj": {"kernel": P("model", None)}}
    >>> layout = mo.MeshLayout(tp, params=megatron)  # TP on an Auto mesh
    >>> tx = mo.muon(0.02, mesh=layout)
    >>> state = jax.jit(tx.init, out_shardings=mo.state_shardings(tx, params, layout))(params)
  """

  mesh: Mesh
  params: Any = "auto"
  data_axis: DataAxis = "data"
  exchanges: Optional[int] = None
  flops_per_byte: float = FLOPS_PER_BYTE
  memory: Optional[float] = None
  exchange_dtype: Any = None
  # What concrete params showed at init, for params="auto" on an Auto mesh: a cache, not
  # a setting (not compared, not copied by dataclasses.replace).
  _seen: _Seen = dataclasses.field(default_factory=lambda: _Seen(), init=False,
                                     compare=False, repr=False)

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise ValueError(f"MeshLayout needs a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
    if isinstance(self.params, str) and self.params not in PARAM_LAYOUTS:
      raise ValueError(f"MeshLayout(params={self.params!r}): choose one of {list(PARAM_LAYOUTS)}, "
                       "or pass the params' shardings (a pytree of NamedSharding or PartitionSpec).")
    if not isinstance(self.params, (str, ParamSpecs)):
      object.__setattr__(self, "params", param_specs(self.params, self.mesh))
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
    if self.exchange_dtype is not None:
      try:
        wire = jnp.dtype(self.exchange_dtype)
      except TypeError:
        wire = None
      if wire is None or not jnp.issubdtype(wire, jnp.floating) or wire.itemsize < 2:
        raise ValueError(f"MeshLayout(exchange_dtype={self.exchange_dtype!r}) must be a floating "
                         "dtype of 16 bits or more (e.g. \"bfloat16\", \"float32\"), or None for "
                         "the default.")
      object.__setattr__(self, "exchange_dtype", wire)
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

  @property
  def stated(self) -> bool:
    """Whether the params' layout was given (a string other than "auto", or shardings)."""
    return not (isinstance(self.params, str) and self.params == "auto")

  def at_init(self, params: Any) -> None:
    """At init: a stated layout must fit `params` (a ValueError names the parameter that
    it does not fit). On an Auto mesh, the layout concrete `params` carry (traced ones
    carry none: under `jax.jit(tx.init)` nothing is seen) is remembered with
    params="auto", and warned about once if it is not what "sharded" or "replicated" says."""
    if isinstance(self.params, ParamSpecs):
      self.params.check(params, self.mesh)
    seen = None if self.explicit else seen_specs(params, self.mesh)
    if not seen:
      return
    if not self.stated:
      self._seen.specs.update(seen)
    elif isinstance(self.params, str):  # "sharded" or "replicated": do the params agree?
      shapes = dict(paths.leaves_with_path(params))
      for path, spec in seen.items():
        said = self.param_spec(path, tuple(shapes[path].shape))
        if not same_spec(spec, said, shapes[path].ndim):
          warnings.warn(
              f"muon_optax: MeshLayout(params={self.params!r}) says parameter {path!r} lies as "
              f"{said}, but it lies as {spec}: its updates will be moved there and back, at "
              f"extra collectives. State the layout: {FIX}, the shardings you pass to jax.jit.",
              stacklevel=2)
          return

  def param_spec(self, path: str, shape: tuple[int, ...]) -> P:
    """The layout of the parameter at `path` when the types do not say: as stated, or as
    seen at init; else the FSDP guess, with a warning (once) that names the fix."""
    if isinstance(self.params, ParamSpecs):
      return self.params.spec(path)
    if self.params == "replicated":
      return P()
    if self.params == "auto" and path in self._seen.specs:
      return self._seen.specs[path]
    if self.params == "auto" and not self._seen.warned:
      self._seen.warned = True
      warnings.warn(
          f"muon_optax: the params' layout on this Auto mesh {dict(self.mesh.shape)} is not "
          f"known (parameter {path!r} was not seen concrete at init), so it is guessed: FSDP, "
          f"split along {self.data_axis}. A wrong guess costs extra collectives (up to tens "
          f"of times the exchange's). State it: {FIX}, the shardings you pass to jax.jit.",
          stacklevel=2)
    return data_spec(shape, self.mesh, self.data_axis)

  def lies(self, leaf: Any, path: str) -> P:
    """Where the state leaf `leaf`, beside the parameter at `path`, lies: its type's
    spec on an Explicit mesh, else as `state_shardings` lays it out beside the params'
    layout (`param_spec`: stated, seen at init, or guessed)."""
    spec = explicit_spec(leaf)
    if spec is not None:
      return spec
    shape = tuple(leaf.shape)
    return self.state_spec(shape, self.param_spec(path, shape))

  def state_spec(self, shape: tuple[int, ...], param_spec: P) -> P:
    """The layout `state_shardings` gives a state leaf of `shape` mirroring a parameter
    laid out as `param_spec`: its spec, with the data axes it lacks added."""
    return add_data_axes(shape, param_spec, self.mesh, self.data_axis)


class _Seen:
  """The params' specs seen at init, by path, and whether the guess was warned about."""

  def __init__(self):
    self.specs: dict[str, P] = {}
    self.warned = False


def as_mesh_layout(mesh: Union[None, Mesh, MeshLayout, Any]):
  """The `MeshLayout` meant by a `mesh=` argument (None stays None)."""
  if mesh is None or isinstance(mesh, MeshLayout):
    return mesh
  if isinstance(mesh, Mesh):
    return MeshLayout(mesh)
  raise ValueError(f"mesh= takes a jax.sharding.Mesh or a muon_optax.MeshLayout, got "
                   f"{type(mesh).__name__}.")
