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

Saves are atomic: Orbax writes a step into a temporary directory and renames it when
done; just before the rename a file inventory is added (every file with its size, and a
CRC-32 of each metadata file). A step is listed (`all_steps`, `latest_step`,
`restore()`) only if every file of its inventory is there with its size. Steps beyond
`max_to_keep` leave the listing in one rename, into `.deleted/`, before any file is
removed; the trash is emptied while no save is in flight (next `save`, `wait`, `close`).
So a job killed at any moment, mid-save or mid-deletion, leaves only complete steps
listed. Whatever is not a listed step (a half-written temporary directory, a step
directory partly copied or partly deleted, one without an inventory) is removed when
a `Checkpointer` opens the directory, before its first save, so it never blocks saving
that step again. One job writes a directory at a time, on a local filesystem.

Corruption is detected on restore. `save` records a checksum of every array: a
uint32 sum over elements of a hash of (bits, global position), computed on the devices
that hold the shards and all-reduced, so it needs no gather and is the same for any
sharding the checkpoint is restored onto. The devices compute the checksums while the
arrays are written, and they are committed with the step, in a file of their own whose
CRC-32 the step's inventory holds. `restore` recomputes them on the restored
arrays, checks the metadata files' CRC-32s, and raises `CorruptCheckpointError` naming
the step, each damaged leaf path and the item directory holding it (OCDBT packs many
arrays into each data file). An array that no longer decodes is reported the same way;
a missing or resized file, and a JSON record that changed or does not parse, by file.
A change to one element always changes its array's checksum; several changes cancel
with probability about 2^-32. That guards against accidental damage, not deliberate
tampering. `restore(verify=False)` skips the checks.

Orbax is imported on first use: `pip install orbax-checkpoint`.
"""

from muon_optax.checkpoint._io import (
                                       Checkpointer,
                                       CorruptCheckpointError,
                                       Restored,
                                       abstract_target,
)

__all__ = ["Checkpointer", "CorruptCheckpointError", "Restored", "abstract_target"]
