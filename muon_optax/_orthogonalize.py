"""Orthogonalize every Muon leaf through its matrix view, one Newton–Schulz call per shape group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from muon_optax._newton_schulz.kernel import Kernel
from muon_optax._newton_schulz.settings import DEFAULT_NS, NS, as_newton_schulz
from muon_optax._placement.mesh_layout import FLOPS_PER_BYTE, MeshLayout, as_mesh_layout
from muon_optax._placement.shardings import explicit_spec, split_first, stack_spec
from muon_optax._routing.matrix_leaves import MatrixLeaves, WideStack, from_wide, to_wide
from muon_optax._routing.matrix_view import MatrixView, ViewFn
from muon_optax._routing.value import as_routing
from muon_optax._sharded_ns import (  # the scope's name is public: collectives read by it
  SHARED_MATRIX_SCOPE,  # noqa: F401
  MeshPlan,
  device_plan,
  sharded_solver,
)
from muon_optax._util.order import after

# Orthogonalizes the wide (count, rows, cols) stacks of a list of leaves, returning the
# results in order; `likes` are the params' leaves, whose layout the results should take,
# and `paths=` the leaves' paths, by which a `MeshLayout` states the params' layouts.
# On a mesh, `specs=` (keyword) says where the stacks lie instead, and the results go there.
Solve = Callable[..., list[jax.Array]]


def _own_view(leaf, view: MatrixView, like=None, path=None) -> MatrixView:
  return view


class Solver(NamedTuple):
  """`solve` (see `Solve`), and the view to stack each leaf through (`view_of(leaf,
  view, like, path)`, given the leaf's own view): on a mesh, one that keeps the leaf's
  split where the stack's layout can hold it."""

  solve: Solve
  view_of: Callable[..., MatrixView] = _own_view


def grouped_solver(ns_fn: Callable[[jax.Array], jax.Array], parts: int = 1) -> Solve:
  """One `ns_fn` call per (rows, cols, dtype) group: same-shape matrices are
  concatenated into a single batch, which equals orthogonalizing them one by one. With
  `parts` > 1 a group's stacks are batched in runs of at most 1/parts of all the
  elements, and the runs go one after another, each once the last one's result is
  computed (`after`), so that one run's Newton–Schulz temporaries are live at a time."""

  def solve(wides, leaves=None, likes=None, specs=None, paths=None):
    stacks = [w.stack for w in wides]
    groups = {}
    for i, s in enumerate(stacks):
      groups.setdefault((*s.shape[1:], s.dtype), []).append(i)
    most = sum(s.size for s in stacks) / parts
    runs = []
    for members in groups.values():
      runs.append([])
      for i in members:
        if runs[-1] and sum(stacks[j].size for j in runs[-1]) + stacks[i].size > most:
          runs.append([])
        runs[-1].append(i)
    out, last = [None] * len(stacks), []
    for members in runs:
      batch = jnp.concatenate([stacks[i] for i in members])
      batch = ns_fn(after(batch, last) if parts > 1 else batch)
      last = [batch]
      start = 0
      for i in members:
        out[i] = batch[start:start + stacks[i].shape[0]]
        start += stacks[i].shape[0]
    return out

  return solve


def mesh_solver(kernel: Kernel, layout: MeshLayout) -> Solver:
  """Stacks dealt over the mesh (`sharded_solver`), told where they lie: as the leaves'
  types say on an Explicit mesh, else as `state_shardings` lays the state out beside the
  params' layout (`MeshLayout.param_spec`: stated, seen at init, or guessed); results go
  where the params are (types, else that layout)."""
  solve_stacks = sharded_solver(kernel, layout)

  def stack_of(spec: P, leaf, wide: WideStack) -> P:
    view = wide.view.normalize(leaf.ndim)
    if view.blocks > 1:  # the fan-out cut into blocks joins the count: XLA lays it out
      return P()
    return stack_spec(spec, (view.batch, view.fan_in, view.fan_out), wide.transposed)

  def param_spec(leaf, like, path) -> Optional[P]:
    """The parameter's layout, or None where only the state's is known (an Explicit mesh
    told nothing else, or a leaf without a path): the results then stay as the state lies."""
    if path is None:
      return P() if layout.params == "replicated" else None
    if layout.explicit:
      if like is not None:
        return explicit_spec(like)
      return layout.param_spec(path, tuple(leaf.shape)) if layout.stated else None
    return layout.param_spec(path, tuple(leaf.shape))

  def specs_of(leaf, like, path) -> tuple[P, P]:
    """Where the leaf lies (its type's, else the state's layout) and where its result
    goes (the parameter's, else where the leaf lies)."""
    param = param_spec(leaf, like, path)
    state = explicit_spec(leaf) or layout.state_spec(tuple(leaf.shape), param or P())
    return state, state if param is None else param

  def view_of(leaf, view: MatrixView, like=None, path=None) -> MatrixView:
    view = view.normalize(leaf.ndim)
    return view._replace(batch=split_first(view.batch, specs_of(leaf, like, path)))

  def solve(wides, leaves, likes=None, specs=None, paths=None):
    if specs is not None:
      return solve_stacks([w.stack for w in wides], specs, specs)
    likes, paths = likes or [None] * len(leaves), paths or [None] * len(leaves)
    ins, outs = zip(*[specs_of(leaf, like, path)
                      for leaf, like, path in zip(leaves, likes, paths)])
    ins = [stack_of(s, leaf, w) for s, leaf, w in zip(ins, leaves, wides)]
    outs = [stack_of(s, leaf, w) for s, leaf, w in zip(outs, leaves, wides)]
    return solve_stacks([w.stack for w in wides], ins,
                        None if all(not any(s) for s in outs) else outs)

  return Solver(solve, view_of)


def solver_for(ns: NS, mesh: Union[Mesh, MeshLayout, None],
               around: Optional[Callable[[Callable], Callable]] = None) -> Solver:
  """The solver of `ns` (a `NewtonSchulz` or a preset name): on one device, or dealt over
  `mesh`. `around(ns_fn)`, if given, is the function each whole stack goes through
  instead of Newton–Schulz (a selection around it); such stacks are never split."""
  ns, layout = as_newton_schulz(ns), as_mesh_layout(mesh)
  if layout is not None and ns.fn is None:  # the defaults of the platform it runs on
    ns = ns.on(layout.platform)
  # A custom function sees whole matrices only; a mesh forms whole products.
  kernel = Kernel.of(ns, whole_products=layout is not None)
  if around is not None:
    kernel = kernel.around(around)
  return Solver(grouped_solver(kernel.whole)) if layout is None else mesh_solver(kernel, layout)


def orthogonalize_leaves(updates: Any, views: ViewFn, solver: Solver, like: Any = None) -> Any:
  """Sees every Muon leaf as a stack of wide matrices, orthogonalizes all of them with
  `solver`, and puts each result back in its leaf's layout. With `like` (the params),
  the solver also gets their leaves, whose layout the results should take."""
  leaves = MatrixLeaves.of(updates, views)
  xs, likes = leaves.arrays(), leaves.pick_like(like)
  wides = [to_wide(x, solver.view_of(x, view, like, path))
           for x, view, like, path in zip(xs, leaves.views, likes or [None] * len(xs),
                                          leaves.paths)]
  results = solver.solve(wides, xs, likes, paths=leaves.paths)
  return leaves.put([from_wide(r, w, x.shape) for r, w, x in zip(results, wides, xs)])


def orthogonalize(ns: NS = DEFAULT_NS, *, routing: Any = None,
                  mesh: Union[Mesh, MeshLayout, None] = None) -> optax.GradientTransformation:
  """Replaces each update by Newton–Schulz's orthogonalization of its matrix view.

  Same-shape matrices (after orienting each wide) are stacked and orthogonalized by
  one batched call, which equals orthogonalizing them one by one. The state is
  empty, so it does not depend on the settings.

  Args:
    ns: a `NewtonSchulz` (or a preset name); `NewtonSchulz(fn=...)` plugs in any
      function of a (count, m, n) stack of wide matrices.
    routing: where the matrix views come from (a `Routing`, e.g. from `infer_routing`;
      None: `default_view`). Every leaf this transform sees must have one.
    mesh: the matrices are dealt over all its devices, balanced by flops, in one
      packed exchange there and one back; each is orthogonalized whole on one device,
      or (built-in iteration only) split by columns over idle devices when there are
      fewer matrices than devices (see `muon_optax._sharded_ns.solver`); results equal the
      single-device ones, rounded to bfloat16 where the iteration's operands are 16-bit
      (the results travel back in it: `MeshLayout.exchange_dtype`).

  Returns:
    A stateless `optax.GradientTransformation`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, muon_optax as mo
    >>> tx = mo.orthogonalize("polar_express")
    >>> g = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> def polar(x):  # any (count, m, n) -> (count, m, n) function plugs in
    ...   u, _, vt = jnp.linalg.svd(x, full_matrices=False)
    ...   return u @ vt
    >>> u, _ = mo.orthogonalize(mo.NewtonSchulz(fn=polar)).update(g, optax.EmptyState())
  """
  views, layout = as_routing(routing).view, as_mesh_layout(mesh)
  solver = solver_for(ns, layout)

  def init_fn(params):
    if layout is not None:  # concrete params show their layout (MeshLayout.at_init)
      layout.at_init(params)
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    like = params if mesh is not None else None  # on a mesh, results laid out like params
    return orthogonalize_leaves(updates, views, solver, like), state

  return optax.GradientTransformation(init_fn, update_fn)


def mesh_plan(params: Any, devices: int, *, routing: Any = None, ns: NS = DEFAULT_NS,
              flops_per_byte: float = FLOPS_PER_BYTE, memory: Optional[float] = None
              ) -> MeshPlan:
  """How `muon(..., mesh=)` deals the Newton–Schulz work of `params` over a 1-D mesh of
  `devices` devices, the state's columns split over them where they divide (FSDP):
  from the shapes alone, no compile.

  Args:
    params: the params pytree (arrays or `jax.ShapeDtypeStruct`s).
    devices: the mesh's size.
    routing: as given to `muon`.
    ns: as given to `muon`; its "auto" settings are jax's default backend's.
    flops_per_byte: as given to `MeshLayout`.
    memory: as given to `MeshLayout`.

  Returns:
    A `MeshPlan`: each round's (rows, cols, split), in the order they run (a split g > 1:
    each matrix's columns shared by g devices); the Newton–Schulz flops each device runs,
    and the ideal, every matrix's flops over the devices.

  Examples:
    >>> import jax.numpy as jnp, muon_optax as mo
    >>> params = {f"l{i}": {"kernel": jnp.ones((64, 256))} for i in range(12)}
    >>> [split for *_, split in mo.mesh_plan(params, 8).rounds]  # 8 whole, then 4
    [1, 1]
    >>> plan = mo.mesh_plan(params, 8, flops_per_byte=0)  # traffic free: 4 over pairs
    >>> [split for *_, split in plan.rounds], plan.flops_per_device / plan.ideal_flops_per_device
    ([1, 2], 1.0)
  """
  routing = as_routing(routing)
  stacks = []
  for path, leaf, decision in routing.decide(params):
    if decision.label == "muon":
      shape = tuple(np.shape(leaf))
      count, fan_in, fan_out = routing.view(path, shape).matrix_shape(shape)
      stacks.append((count, min(fan_in, fan_out), max(fan_in, fan_out)))  # wide, as NS runs
  col_shards = [devices if cols % devices == 0 else 1 for _, _, cols in stacks]
  return device_plan(stacks, devices, Kernel.of(as_newton_schulz(ns)).priced, col_shards,
                     flops_per_byte, memory)
