"""One line naming the machine a benchmark ran on, printed beside its numbers."""

import os
import platform

import jax
import optax


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return (f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPU cores "
          f"visible; jax {jax.__version__} on {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}); optax {optax.__version__}")
