"""Sharded Newton–Schulz: the exchange engine that deals whole matrices (or column parts
of them) over a mesh's devices with full-matrix semantics. Its one entry is
`sharded_solver`, with `device_plan` (what it would deal where, from shapes alone) and
the named scope of a shared matrix's collectives; only the orthogonalization imports
this room.

May import `_util`, `_newton_schulz` and `_placement`.
"""

from muon_optax._sharded_ns.factor_mesh import SHARED_MATRIX_SCOPE
from muon_optax._sharded_ns.rounds import MeshPlan, device_plan
from muon_optax._sharded_ns.solver import sharded_solver

__all__ = ["SHARED_MATRIX_SCOPE", "MeshPlan", "device_plan", "sharded_solver"]
