"""Distributed: the state's layouts on a mesh, the packed gather of replicated updates,
and Newton–Schulz dealt over the devices with full-matrix semantics.

May import `_util` and `_newton_schulz`.
"""
