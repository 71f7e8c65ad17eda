"""``zeroshard train --tp``: the training loop beside tensor parallelism on 4 gloo ranks
(one spawn, ``train()`` on every rank as the launcher runs it), and its checks before
launch.

- The built-in GPT at tp 2 (dp 2): stages 0 and 3 give the same loss curve, within 1e-5
  of the curve at tp 1 (dp 4) on the same global batches; the memory summary's planned
  categories are the ledger's; its checkpoint resumes at tp 1 where it left off.
- A Hugging Face Llama with tied embeddings (built on the meta device, each rank reading
  its slice of the weights, transformers' own plan applied with torch's styles) trains
  at tp 2.
- A tp degree that does not divide the heads, the key/value heads or the processes is
  one line before any process starts.
"""

import pytest

from zeroshard.cli import main
from zeroshard.runtime.spawn import spawn
from zeroshard.spec.config import ZeroConfig
from zeroshard.train.loop import train
from zeroshard.train.settings import TrainConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # N = 4

BASE = dict(model="tiny", steps=6, batch=8, eval_every=3, eval_batches=1, sample_chars=0)


def _llama(folder):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _runs(folder: str) -> dict:
    out = {}
    for key, kw in {("tp2", 0): dict(tp=2, zero=ZeroConfig(stage=0)),
                    ("tp2", 3): dict(tp=2, zero=ZeroConfig(stage=3), save_dir=f"{folder}/ckpt"),
                    ("tp1", 3): dict(tp=1, zero=ZeroConfig(stage=3))}.items():
        out[key] = train(TrainConfig(**BASE, **kw))
    out["resumed"] = train(TrainConfig(**{**BASE, "steps": 8}, zero=ZeroConfig(stage=1),
                                       save_dir=f"{folder}/ckpt", resume="latest"))
    out["llama"] = train(TrainConfig(hf_model=f"{folder}/llama", tp=2, steps=3, batch=8,
                                     seq_len=32, eval_every=100, eval_batches=1,
                                     sample_chars=0, zero=ZeroConfig(stage=3)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp-train")
    _llama(folder / "llama")
    return spawn(_runs, 4, str(folder), timeout=900)


def test_gpt_at_tp2_follows_the_tp1_curve(runs):
    r = runs[0]
    assert r["tp2", 0]["losses"] == r["tp2", 3]["losses"]
    for a, b in zip(r["tp2", 3]["losses"], r["tp1", 3]["losses"]):
        assert abs(a - b) < 1e-5
    assert r["tp2", 3]["losses"][-1] < r["tp2", 3]["losses"][0]


def test_resumed_at_tp1_where_tp2_left_off(runs):
    r = runs[0]
    assert abs(r["resumed"]["first_val"] - r["tp2", 3]["evals"][-1][2]) < 1e-6
    assert len(r["resumed"]["losses"]) == 2


def test_llama_trains_at_tp2(runs):
    losses = runs[0]["llama"]["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_memory_is_per_tp_slice(runs):
    """Every rank holds the same bytes. At stage 3 a rank of dp 4 holds a quarter of the
    weights; one of tp 2 × dp 2 half of its tp slice: a quarter of what tensor
    parallelism splits, but half of what it leaves whole (embeddings, norms), so more
    than the quarter and less than twice it."""
    at_tp2 = [r["tp2", 3]["memory"]["params"] for r in runs]
    at_tp1 = runs[0]["tp1", 3]["memory"]["params"]
    assert len(set(at_tp2)) == 1
    assert at_tp1 < at_tp2[0] < 2 * at_tp1  # dp 4 shards by 4; tp 2 x dp 2 by 2 of a half


@pytest.mark.parametrize("argv, message", [
    (["--tp", "4", "--model", "tiny"], "--tp=4 does not divide GPT tiny's 2 heads; expected "
                                       "one of [1, 2]"),
    (["--tp", "3", "--model", "tiny"], "--tp=3 does not divide the 4 processes; expected one "
                                       "of [1, 2, 4]"),
])
def test_a_tp_degree_that_does_not_divide_is_one_line(argv, message, capsys):
    assert main(["train", "--nproc", "4", "--steps", "2", "--batch", "8", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"zeroshard train: error: {message}", err
