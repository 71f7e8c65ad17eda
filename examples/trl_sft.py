"""TRL's SFTTrainer on a sharded model, its own code unchanged: ``sharded(SFTTrainer)``
takes ``zero=`` beside SFTTrainer's arguments.

Run: torchrun --nproc-per-node 2 examples/trl_sft.py
Needs ``pip install 'zeroshard[hf]' trl``; the tokenizer is built here, nothing is downloaded.
"""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from zeroshard.hf import sharded

words = ["[PAD]", "[EOS]", "[UNK]"] + [f"w{i}" for i in range(61)]
backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]",
                                    eos_token="[EOS]", unk_token="[UNK]")
# short "sentences" of consecutive words: w7 w8 w9 ...
g = torch.Generator().manual_seed(1)
text = [" ".join(f"w{(s + k) % 61}" for k in range(12))
        for s in torch.randint(0, 61, (256,), generator=g).tolist()]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=64,
                                     intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
args = SFTConfig("runs/trl_sft", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                 max_steps=30, learning_rate=3e-3, warmup_steps=3, logging_steps=10,
                 save_strategy="no", report_to=[], disable_tqdm=True, bf16=False,
                 use_cpu=not torch.cuda.is_available())
trainer = sharded(SFTTrainer)(model=model, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"text": text}),
                              zero={"stage": 3})
trainer.train()
trainer.save_model("runs/trl_sft/final")
