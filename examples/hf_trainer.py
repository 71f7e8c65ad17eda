"""Hugging Face's Trainer on a sharded model: ``from zeroshard.hf import Trainer`` in place
of transformers' own, and ``zero=`` beside its arguments.

Run: torchrun --nproc-per-node 2 examples/hf_trainer.py [ZERO]
where ZERO is a stage (default 3) or a DeepSpeed / ZeroConfig JSON file. Needs
``pip install 'zeroshard[hf]' datasets``; nothing is downloaded.
"""

import sys

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from zeroshard.hf import Trainer

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64))
# sequences that count up (mod 128) from a random start: learnable in a few steps
starts = torch.randint(0, 128, (512, 1), generator=torch.Generator().manual_seed(1))
rows = ((starts + torch.arange(32)) % 128).tolist()
data = Dataset.from_dict({"input_ids": rows, "labels": rows})
args = TrainingArguments(
    "runs/hf_trainer", per_device_train_batch_size=8, gradient_accumulation_steps=2,
    max_steps=40, learning_rate=3e-3, warmup_steps=5, weight_decay=0.1, max_grad_norm=1.0,
    logging_steps=10, save_steps=20, eval_strategy="steps", eval_steps=20, report_to=[],
    disable_tqdm=True, use_cpu=not torch.cuda.is_available())  # CPU-only: gloo ranks
given = sys.argv[1] if len(sys.argv) > 1 else "3"
zero = {"stage": int(given)} if given.isdigit() else given  # a stage, or a JSON file
trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(64)),
                  zero=zero)
trainer.train()                              # checkpoints: runs/hf_trainer/checkpoint-20, -40
trainer.save_model("runs/hf_trainer/final")  # LlamaForCausalLM.from_pretrained reads it
memory = trainer.zs_model.memory(trainer.optimizer.optimizer)  # bytes on this rank
if trainer.is_world_process_zero():
    print(f"ZeRO stage {trainer.zero_config.stage}; rank 0 holds {memory}")
