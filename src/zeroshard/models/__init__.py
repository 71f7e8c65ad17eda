"""Models: the small built-in GPT used by the demo, the trainer, the tests and the
benchmarks (``gpt``), and Hugging Face causal LMs built from a local folder on the meta
device (``hf``)."""
