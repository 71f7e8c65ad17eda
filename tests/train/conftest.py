"""``zeroshard train``'s tests: whole-program launches (the launcher, restarts under
torchrun with ``faultsite/``'s faults), its settings, its data pipeline, Hugging Face
models, LoRA, tensor parallelism and the plan beside the measurement."""
