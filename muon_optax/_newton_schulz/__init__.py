"""Newton–Schulz: the settings value, the plan (variant, restarts, flops per shape) and
the iteration itself, as array maths apart from any tree handling.

May import `_util` only.
"""
