"""Examples of muon_optax; run each from the repository root as a module, e.g.
`python -m examples.train_gpt`. Importing this package imports nothing else, so a
script can still set XLA_FLAGS before jax is first imported."""
