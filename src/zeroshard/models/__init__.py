"""Small built-in models used by the demo, the trainer, the tests and the benchmarks."""
