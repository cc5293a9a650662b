"""Checkpoints of params and optimizer state with Orbax, restorable on any mesh.

A thin layer over `orbax.checkpoint.CheckpointManager`: every step directory holds
`params` and `opt_state` in Orbax's standard PyTree format, and `meta`, a JSON record
of both trees (shape and dtype per path, routing label and matrix view per parameter,
AdamW backend, muon_optax version) next to the user's own metadata.

Restoring reads arrays straight into an abstract target, `jax.eval_shape(tx.init,
params)` with the shardings of whatever mesh the job runs on now (`abstract_target`
builds it), so a checkpoint written on 8 devices restores on 4, 1, or fully replicated.
Before any array is read the record is checked against the target: every differing
tree path, shape, dtype or routing label is listed in one ValueError with both values
(Orbax itself would silently cast a bfloat16 momentum to float32). The AdamW backends
share one state layout, so a state saved under one restores under another. The state
does not depend on the Newton–Schulz preset, so `ns="jordan"` restores under
`ns="polar_express"`.

Saves are atomic (Orbax writes into a temporary directory and renames it when done):
a job killed mid-save leaves the previous checkpoints intact; the half-written one is
never listed, and the next `Checkpointer` on the directory deletes it (in the background,
finished before its first save).

Orbax is imported on first use: `pip install orbax-checkpoint`.
"""

from muon_optax.checkpoint._io import Checkpointer, Restored, abstract_target

__all__ = ["Checkpointer", "Restored", "abstract_target"]
