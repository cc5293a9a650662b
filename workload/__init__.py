"""The workload the examples train and the benchmarks measure: a byte-level GPT (`gpt`)
on the standard library's source code (`stdlib_text`), its training loop (`train`, set
up by `config.TrainConfig`), and the machine record printed beside every number
(`machine`). Run from the repository root; `examples` and `benchmarks` both import it.
Importing this package imports nothing else, so a script can still set XLA_FLAGS
before jax is first imported."""
