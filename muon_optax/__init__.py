"""muon_optax: Muon (momentum orthogonalized by Newton–Schulz) as composable Optax transforms."""

from muon_optax import checkpoint  # Orbax is imported on first use
from muon_optax._adamw.backends import BACKENDS, AuxAdam
from muon_optax._adamw.convert import convert_adam_state
from muon_optax._adamw.offload import offload_state
from muon_optax._alias import adamuon, dion2, muon, muonbp, muonh, nordion2, normuon, scale_by_muon
from muon_optax._block_periodic import BlockPeriodic, BlockPeriodicState, orthogonalize_blocks
from muon_optax._hyperball import HyperballState, hyperball
from muon_optax._momentum import MuonMomentumState, scale_by_muon_momentum
from muon_optax._newton_schulz.iteration import newton_schulz
from muon_optax._newton_schulz.settings import PRESETS, NewtonSchulz
from muon_optax._newton_schulz.variant import newton_schulz_plan
from muon_optax._orthogonalize import SHARED_MATRIX_SCOPE, MeshPlan, mesh_plan, orthogonalize
from muon_optax._placement.mesh_layout import MeshLayout
from muon_optax._placement.shardings import fsdp_shardings, state_shardings
from muon_optax._qk_clip import qk_clip
from muon_optax._routing.describe import describe, newton_schulz_cost
from muon_optax._routing.matrix_view import MatrixView, default_view
from muon_optax._routing.name_rules import DEFAULT_RULES, label_params
from muon_optax._routing.trace import infer_routing
from muon_optax._routing.value import Routing
from muon_optax._row_selection import RowSelection, RowSelectionState, select_rows
from muon_optax._scaling import scale_by_dual_norm, scale_by_shape
from muon_optax._second_moment import SecondMoment, SecondMomentState, scale_by_second_moment
from muon_optax._version import __version__ as __version__
from muon_optax._weight_decay import WeightDecay, add_decayed_weights


def __getattr__(name):
  # muon_optax.nnx imports Flax, so it loads on first use: `mo.nnx.ClipAttention`.
  if name == "nnx":
    import importlib
    return importlib.import_module("muon_optax.nnx")
  raise AttributeError(f"module 'muon_optax' has no attribute {name!r}")


__all__ = [
    "AuxAdam",
    "BACKENDS",
    "BlockPeriodic",
    "BlockPeriodicState",
    "checkpoint",
    "DEFAULT_RULES",
    "MatrixView",
    "HyperballState",
    "MeshLayout",
    "MeshPlan",
    "MuonMomentumState",
    "NewtonSchulz",
    "PRESETS",
    "Routing",
    "RowSelection",
    "RowSelectionState",
    "SecondMoment",
    "SecondMomentState",
    "SHARED_MATRIX_SCOPE",
    "WeightDecay",
    "add_decayed_weights",
    "adamuon",
    "convert_adam_state",
    "default_view",
    "describe",
    "dion2",
    "fsdp_shardings",
    "hyperball",
    "infer_routing",
    "label_params",
    "mesh_plan",
    "muon",
    "muonbp",
    "muonh",
    "newton_schulz",
    "newton_schulz_cost",
    "newton_schulz_plan",
    "nordion2",
    "normuon",
    "offload_state",
    "orthogonalize",
    "orthogonalize_blocks",
    "qk_clip",
    "scale_by_muon",
    "scale_by_dual_norm",
    "scale_by_muon_momentum",
    "scale_by_second_moment",
    "scale_by_shape",
    "select_rows",
    "state_shardings",
]
