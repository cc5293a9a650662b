"""The XLA flags of the test session (conftest sets them before jax is imported; this
module imports nothing that imports jax), and the environment of the scripts the tests
start in processes of their own."""

import os

EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"
# The tests compile hundreds of small programs, and XLA's CPU backend spends most of each
# compile in LLVM's optimization passes: they change how fast the code runs, not what it
# computes. XLA's own passes, whose programs the compiled figures are read from, run
# before them and are unchanged.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def script_env(**extra: str) -> dict[str, str]:
  """This process's environment for a script that sets its own device count: XLA_FLAGS
  only compiles fast."""
  return {**os.environ, "XLA_FLAGS": FAST_COMPILE, **extra}
