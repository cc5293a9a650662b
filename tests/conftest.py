"""Test session set-up: 8 simulated CPU devices for every test, compiled fast (`_env`)."""

import os

from _env import EIGHT_DEVICES, FAST_COMPILE

# Must be set before jax is imported anywhere in the session.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), EIGHT_DEVICES,
                                    FAST_COMPILE]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A script run in its own processes by test_multiprocess, not a module to import here.
collect_ignore = ["multiprocess_worker.py"]
