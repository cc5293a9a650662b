"""Sharded Newton–Schulz: the exchange engine that deals whole matrices (or column parts
of them) over a mesh's devices with full-matrix semantics. Its one entry is
`sharded_solver`; only the orthogonalization imports this room.

May import `_util`, `_newton_schulz` and `_placement`.
"""

from muon_optax._sharded_ns.solver import sharded_solver

__all__ = ["sharded_solver"]
