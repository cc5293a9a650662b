"""Placement: where params and optimizer state lie on a mesh. The state's shardings
(ZeRO-1 / FSDP), `MeshLayout`, the packed gather of replicated updates, and the
one-row-per-peer buffers collectives move.

May import `_util` only.
"""
