"""Test session set-up: 8 simulated CPU devices for every test."""

import os

# Must be set before jax is imported anywhere in the session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A script run in its own processes by test_multiprocess, not a module to import here.
collect_ignore = ["multiprocess_worker.py"]
