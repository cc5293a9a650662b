"""Benchmarks of muon_optax; run each from the repository root as a module, e.g.
`python -m benchmarks.optimizer_step`. Shared helpers live in `benchmarks.common`."""
