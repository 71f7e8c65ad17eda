"""The optimizer step: the cycle's states, the stepper, global-norm clipping, the
non-finite verdict, fp16 loss scaling and which optimizers may step a shard."""
