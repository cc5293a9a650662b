"""The machine a number was measured on: one line printed beside every benchmark's
numbers, and the same as a JSON-able record."""

from __future__ import annotations

import os
import platform
from typing import Any

import jax
import optax


def machine_info() -> dict[str, Any]:
  """The machine, as a JSON-able record: CPU, core count, load, library versions, devices."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"platform": platform.platform(), "processor": cpu, "cpu_count": os.cpu_count(),
          "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
          "python": platform.python_version(), "jax": jax.__version__,
          "optax": optax.__version__, "backend": jax.default_backend(),
          "device_kind": jax.devices()[0].device_kind,
          "devices": [str(d) for d in jax.devices()]}


def machine() -> str:
  """One line naming the machine a benchmark ran on, printed beside its numbers."""
  m = machine_info()
  load = "" if m["load_average_1min"] is None else f", load {m['load_average_1min']:.1f}"
  return (f"{platform.system()} {platform.machine()}, {m['processor']}, {m['cpu_count']} CPU "
          f"cores visible{load}; jax {m['jax']} on {m['device_kind']} ({m['backend']}); "
          f"optax {m['optax']}")
