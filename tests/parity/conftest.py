"""``zs.verify`` and ``zeroshard verify``'s tests: known outcomes (every stage, fp32 and
bf16, AdamW, Muon and Adafactor on the built-in GPT and a Hugging Face Llama: bitwise or
within rounding) and deliberately wrong configurations (an optimizer stepping each rank's
rows as if they were the whole tensor, a reduction that forgets to divide: DIFFERS,
naming the tensor); the verdict's arithmetic on plain tensors; the command's flags.
Each ``verify`` call starts its ranks as fresh processes."""
