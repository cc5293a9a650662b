"""AdamW for the leaves Muon does not update: `AuxAdam` and its backends, host offload,
and conversion of state between backends.

May import `_util` only.
"""
