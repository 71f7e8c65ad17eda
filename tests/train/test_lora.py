"""`zeroshard train --hf-model DIR --lora R`: a tiny Llama fine-tuned with adapters at
stage 3 on 2 ranks (each unit's forward compiled, ``--compile aot_eager``), then
`zeroshard export` of its adapter in peft's layout and of the model merged: peft's
from_pretrained of the adapter on the base and transformers' of the merged folder give
the same logits, which the adapter moved away from the base's."""

import pytest
import torch

from zeroshard._paths import RECORD
from zeroshard.cli import main

pytestmark = pytest.mark.dist
peft = pytest.importorskip("peft")

PROBE = torch.arange(64).reshape(2, 32) * 37 % 300


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=None, eos_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    codes = {
        "train": main(["train", "--hf-model", str(root / "base"), "--lora", "4",
                       "--lora-alpha", "16", "--stage", "3", "--nproc", "2", "--steps", "6",
                       "--batch", "4", "--seq-len", "32", "--lr", "1e-2", "--eval-every", "6",
                       "--sample-chars", "0", "--save-dir", str(root / "ckpt"),
                       "--compile", "aot_eager"]),
        "adapter": main(["export", str(root / "ckpt"), str(root / "adapter")]),
        "merged": main(["export", str(root / "ckpt"), str(root / "merged"), "--merge"]),
    }
    return root, codes


def test_trains_and_exports(run):
    root, codes = run
    assert codes == {"train": 0, "adapter": 0, "merged": 0}
    assert {p.name for p in (root / "adapter").iterdir()} == {"adapter_model.safetensors",
                                                             "adapter_config.json", RECORD}


def test_adapter_and_merged_model_give_the_same_logits(run):
    from transformers import AutoModelForCausalLM

    root, _ = run
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(root / "base").eval()
        plain = base(input_ids=PROBE).logits
        adapted = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
        tuned = adapted(input_ids=PROBE).logits
        merged = AutoModelForCausalLM.from_pretrained(root / "merged").eval()
        assert (merged(input_ids=PROBE).logits - tuned).abs().max() < 1e-5
    assert (tuned - plain).abs().max() > 1e-3  # the adapter trained
    config = adapted.peft_config["default"]
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 16,
                                                                         {"q_proj", "v_proj"})
