"""Newton–Schulz: the settings value, the plan (variant, restarts, flops per shape), the
iteration itself, as array maths apart from any tree handling, and the kernel a mesh
runs it by.

May import `_util` only.
"""
