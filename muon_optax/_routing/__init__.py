"""Routing: which leaves Muon updates and as which matrices. Name rules, matrix views,
label trees and their checks, the `Routing` value, the jaxpr trace behind
`infer_routing`, and the routing table `describe` prints.

May import `_util` and `_newton_schulz` (for the flops `describe` prints).
"""

from muon_optax._routing.labels import check_labels
from muon_optax._routing.name_rules import ADAM, FROZEN, MUON
from muon_optax._routing.table import warn_guessed_views
from muon_optax._routing.value import Routing, as_routing

__all__ = ["ADAM", "FROZEN", "MUON", "Routing", "as_routing", "check_labels",
           "warn_guessed_views"]
