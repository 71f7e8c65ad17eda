"""Tiny models, data and arguments the trainer tests build (no download: HF_HUB_OFFLINE)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

#: The Trainer's arguments every case shares: accumulation 2, clipping at 1.0, linear
#: warm-up then decay, weight decay, a log line (and a grad_norm) every step.
ARGS = dict(use_cpu=True, ddp_backend="gloo", max_grad_norm=1.0, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2, warmup_steps=2,
            weight_decay=0.1, lr_scheduler_type="linear", logging_steps=1, save_strategy="no",
            report_to=[], seed=0, disable_tqdm=True, bf16=False)


def join_world() -> None:
    """accelerate (TrainingArguments) and Lightning read torchrun's variables; the ranks
    ``spawn`` starts joined their group through a file store, so describe it to them
    (the group exists, so neither starts another). Lightning's teardown removes some of
    them: call before every Trainer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=4))


def lora(seed: int = 0):
    import peft

    return peft.get_peft_model(llama(seed), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


MODELS = {"llama": llama, "gpt2": gpt2, "lora": lora}


def data(n: int = 32, seq: int = 16, seed: int = 1):
    """Token sequences that are their own labels (a causal LM's loss)."""
    from datasets import Dataset

    ids = torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def args(folder: str, **overrides):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=folder, **{**ARGS, **overrides})


def tokenizer():
    """A word-level tokenizer over the 128 ids (t3 ... t127; 0 pad, 1 eos, 2 unknown)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"t{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                   unk_token="[UNK]")


def sft_data(n: int = 32):
    from datasets import Dataset

    ids = torch.randint(3, 128, (n, 12), generator=torch.Generator().manual_seed(2)).tolist()
    return Dataset.from_dict({"input_ids": ids})


def sft_args(folder: str, **overrides):
    from trl import SFTConfig

    return SFTConfig(output_dir=folder, **{**ARGS, **overrides})


def weights_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over the tensors of ``b`` (every one must be in ``a``)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def norms(trainer) -> list[float]:
    """The grad_norm of every logged step."""
    return [x["grad_norm"] for x in trainer.state.log_history if "grad_norm" in x]


def losses(trainer) -> list[float]:
    return [x["loss"] for x in trainer.state.log_history if "loss" in x]


def probe_ids():
    return torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))


def grpo_prompts(n: int = 16):
    """Prompts of four words for TRL's GRPOTrainer."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"t{3 + (i * 7 + j) % 120}" for j in range(4))
                                         for i in range(n)]})


def even_words(completions, **kwargs) -> list[float]:
    """GRPO's reward: the count of even ids a completion writes ("t4 t6 ...")."""
    return [float(sum(1 for w in c.split() if w[1:].isdigit() and int(w[1:]) % 2 == 0))
            for c in completions]


def grpo_args(folder: str, **overrides):
    """4 samples of up to 6 tokens per prompt (an eos ends some early), 3 steps."""
    from trl import GRPOConfig

    return GRPOConfig(output_dir=folder, **{**ARGS, "gradient_accumulation_steps": 1,
                                            "per_device_train_batch_size": 4,
                                            "max_steps": 3, "num_generations": 4,
                                            "max_completion_length": 6, **overrides})
