"""Small shared helpers: tree paths, tree fitting checks, argument validation, type aliases.

The lowest room: it imports nothing else from muon_optax.
"""
