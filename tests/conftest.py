"""Test session set-up: 8 simulated CPU devices for every test, compiled fast (`_env`)."""

import os

from _env import EIGHT_DEVICES, FAST_COMPILE

# Must be set before jax is imported anywhere in the session.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), EIGHT_DEVICES,
                                    FAST_COMPILE]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Both workers may load libtpu (test_tpu_compile, and the benchmarks' TPU flops columns):
# it compiles offline here, with no chip to hold, so its one-process lockfile need not bind.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# A script run in its own processes by test_multiprocess, not a module to import here.
collect_ignore = ["multiprocess_worker.py"]
