"""`zeroshard train --hf-model DIR --data PATH`: a small Llama (tied embeddings) and a
small GPT-2, saved in the Hugging Face layout with a BPE tokenizer trained here, trained
at stage 3 on 2 ranks, the Llama resumed at N = 1, both exported and loaded with
``from_pretrained``; Mistral, Qwen2, GPT-NeoX and an old-layout GPT-2 read sharded;
TensorBoard scalars; bad input as one line each."""

import contextlib
import json
import shutil
import sys

import pytest
import torch

from zeroshard.cli import main
from zeroshard.runtime.spawn import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]

VOCAB = 384
STEPS, SEQ = 8, 32
#: A batch of ids the trained models' logits are compared on.
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) * 37 % VOCAB


def _texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _models(root):
    """A Llama (head tied to the embedding) and a GPT-2 of a few thousand parameters, each
    saved with a byte-level BPE tokenizer trained here on the data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_texts()[:60], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    assert len(fast) == VOCAB
    configs = {
        "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, tie_word_embeddings=True,
                             bos_token_id=None, eos_token_id=0),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                           bos_token_id=0, eos_token_id=0),
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        # GPT-2's weights in several files named by an index, the Llama's in one
        AutoModelForCausalLM.from_config(config).save_pretrained(
            root / name, max_shard_size="60KB" if name == "gpt2" else "5GB")
        fast.save_pretrained(root / name)
    assert (root / "gpt2" / "model.safetensors.index.json").is_file()


def _data(root):
    """Text files in a folder, and JSON lines with the text under "body"."""
    texts = _texts()
    (root / "text").mkdir()
    for i in range(3):
        (root / "text" / f"part{i}.txt").write_text("\n\n".join(texts[i * 12:(i + 1) * 12]))
    with open(root / "docs.jsonl", "w") as fh:
        for t in texts[36:72]:
            fh.write(json.dumps({"body": t, "n": len(t)}) + "\n")


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@contextlib.contextmanager
def _one_thread():
    """Forwards on one thread, as on the ranks (spawn's threads=1): the same kernels sum
    in the same order, so logits compare bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _families(root) -> dict:
    """Mistral, Qwen2 and GPT-NeoX (whose head transformers saves as ``embed_out``), and a
    GPT-2 in the hub's old layout (no ``transformer.`` prefix), saved untrained; their
    logits on PROBE as transformers computes them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, MistralConfig, Qwen2Config

    dims = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
    configs = {"mistral": MistralConfig(num_key_value_heads=2, **dims),
               "qwen2": Qwen2Config(num_key_value_heads=2, **dims),
               "gpt_neox": GPTNeoXConfig(**dims)}
    ref = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(root / name)
        with torch.no_grad(), _one_thread():
            ref[name] = model(input_ids=PROBE, use_cache=False).logits
    (root / "gpt2-old").mkdir()
    (root / "gpt2-old" / "config.json").write_text((root / "gpt2" / "config.json").read_text())
    old = {}
    for f in (root / "gpt2").glob("*.safetensors"):
        old.update({k.removeprefix("transformer."): v for k, v in load_file(f).items()})
    save_file(old, root / "gpt2-old" / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad(), _one_thread():
        ref["gpt2-old"] = AutoModelForCausalLM.from_pretrained(root / "gpt2").eval()(
            input_ids=PROBE, use_cache=False).logits
    return ref


def _sharded_logits(runs: dict, folders: dict) -> tuple[dict, dict]:
    """Each run's last checkpoint loaded into the trainer's sharded model (stage 3, this
    N), and each of ``folders`` read by it, each rank its rows; their logits on PROBE."""
    from zeroshard.checkpoint import load
    from zeroshard.spec.config import ZeroConfig
    from zeroshard.train.hfmodel import HFCausalLM
    from zeroshard.train.settings import TrainConfig

    trained, read = {}, {}
    for out, items in ((trained, runs), (read, folders)):
        for name, (model_dir, ckpt) in items.items():
            cfg = TrainConfig(hf_model=model_dir, data="unused", zero=ZeroConfig(stage=3))
            net = HFCausalLM(cfg).build(load_weights=ckpt is None)
            if ckpt is not None:
                load(net, None, ckpt)
            net.eval()  # GPT-2's dropout off, as in from_pretrained's model
            with torch.no_grad():
                out[name] = net(input_ids=PROBE, use_cache=False).logits
    return trained, read


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the token cache, kept to the test
    _models(root)
    _data(root)
    common = ["train", "--stage", "3", "--steps", str(STEPS), "--batch", "4", "--seq-len",
              str(SEQ), "--lr", "1e-2", "--eval-every", "4", "--sample-chars", "0"]
    data = {"llama": ["--data", str(root / "text")],
            "gpt2": ["--data", str(root / "docs.jsonl"), "--data-field", "body"]}
    out = {"root": root, "codes": {}}
    for name in ("llama", "gpt2"):
        board = ["--tensorboard", str(root / f"{name}-tb")]
        out["codes"][name] = main([*common, "--hf-model", str(root / name), *data[name],
                                   "--nproc", "2", "--save-dir", str(root / f"{name}-a"),
                                   "--save-every", "4", "--json-log",
                                   str(root / f"{name}-a.jsonl"), *board])
    # the Llama resumed from step 4 at N = 1 and stage 2 (a launch costs seconds: one
    # resume shows it)
    out["codes"]["llama-resumed"] = main(
        [*common, "--stage", "2", "--hf-model", str(root / "llama"), *data["llama"],
         "--nproc", "1", "--save-dir", str(root / "llama-b"), "--resume",
         str(root / "llama-a" / "step-000004"), "--json-log", str(root / "llama-b.jsonl")])
    final = {"llama": root / "llama-b", "gpt2": root / "gpt2-a"}
    for name, ckpt in final.items():
        out["codes"][name + "-export"] = main(["export", str(ckpt), str(root / f"{name}-hf")])
    out["families"] = _families(root)
    out["logits"], out["read"] = spawn(
        _sharded_logits, 2, {n: (str(root / n), str(c)) for n, c in final.items()},
        {n: (str(root / n), None) for n in out["families"]}, timeout=300)[0]
    yield out
    mp.undo()


def test_runs_resume_and_export(runs):
    assert set(runs["codes"].values()) == {0}, runs["codes"]


def test_resumed_at_another_n_and_stage_follows_the_same_curve(runs):
    full, resumed = (_log(runs["root"] / f"llama-{k}.jsonl") for k in "ab")
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert [r["step"] for r in resumed] == list(range(5, STEPS + 1))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(full[4:], resumed)) < 1e-4


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_held_out_loss_falls(runs, name):
    val = _scalars(runs["root"] / f"{name}-tb").Scalars("eval/val_loss")
    assert [e.step for e in val] == [0, 4, STEPS]
    first, middle, last = (e.value for e in val)
    assert first > middle > last and last < first - 0.3, (first, middle, last)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_export_loads_with_from_pretrained_to_the_trained_logits(runs, name):
    """Bit for bit in fp32: the export's weights are the master weights the sharded model
    computes with, and both forwards run on one thread."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs["root"] / f"{name}-hf"
    for f in ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json"):
        assert (out / f).is_file(), f
    assert len(AutoTokenizer.from_pretrained(out)) == VOCAB
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    from safetensors import safe_open

    written = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            written |= set(fh.keys())
    assert written <= set(model.state_dict()), written - set(model.state_dict())  # as saved
    with torch.no_grad(), _one_thread():
        logits = model(input_ids=PROBE, use_cache=False).logits
    assert torch.equal(logits, runs["logits"][name]), \
        (logits - runs["logits"][name]).abs().max()


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gpt_neox", "gpt2-old"])
def test_other_families_and_layouts_load_exactly(runs, name):
    """Each rank's rows read at stage 3 give transformers' own logits, bit for bit."""
    assert torch.equal(runs["read"][name], runs["families"][name])


def test_tensorboard_scalars(runs):
    acc = _scalars(runs["root"] / "llama-tb")
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm",
            "train/skipped_steps", "eval/train_loss", "eval/val_loss", "memory/params",
            "memory/grads", "memory/optimizer"} <= tags, tags
    log = _log(runs["root"] / "llama-a.jsonl")
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in log], rel=1e-6)
    val = {e.step: e.value for e in acc.Scalars("eval/val_loss")}
    assert val == pytest.approx({r["step"]: r["val_loss"] for r in log if "val_loss" in r}
                                | {0: val[0]}, rel=1e-6)
    assert acc.Scalars("memory/params")[-1].value > 0


def test_config_file_keys_follow_the_flags(runs, tmp_path):
    from zeroshard.train.settings import resolve

    root = runs["root"]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"hf_model": str(root / "gpt2"), "data": str(root / "docs.jsonl"),
                                "data_field": "body", "val_fraction": 0.1, "seq_len": 48,
                                "tensorboard": str(tmp_path / "tb"), "zero": {"stage": 3}}))
    cfg = resolve({"seq_len": 16, "data_field": None}, str(path))
    assert (cfg.hf_model, cfg.data_field, cfg.val_fraction, cfg.seq_len, cfg.zero.stage) == (
        str(root / "gpt2"), "body", 0.1, 16, 3)


def _error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    return err


def test_bad_input_is_one_line(runs, tmp_path, capsys, monkeypatch):
    root = runs["root"]
    base = ["train", "--steps", "2", "--batch", "2", "--sample-chars", "0"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a model")
    assert "no config.json, so not a Hugging Face model folder" in _error(
        capsys, [*base, "--hf-model", str(tmp_path / "notes")])
    for kind, words in (("vit", "transformers cannot build model_type 'vit'"),
                        ("no-such-kind", "transformers cannot read")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps({"model_type": kind}))
        assert words in _error(capsys, [*base, "--hf-model", str(tmp_path / kind)])
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((root / "llama" / "config.json")
                                                        .read_text())
    assert "no model.safetensors and no model.safetensors.index.json" in _error(
        capsys, [*base, "--hf-model", str(tmp_path / "noweights")])
    (tmp_path / "noweights" / "model.safetensors").write_bytes(
        (root / "llama" / "model.safetensors").read_bytes())
    assert "has no tokenizer" in _error(capsys, [*base, "--hf-model", str(tmp_path / "noweights"),
                                                 "--sample-chars", "8"])  # sampled by it
    model = ["--hf-model", str(root / "llama")]
    assert "--seq-len=65 is above LlamaForCausalLM's longest sequence, 64" in _error(
        capsys, [*base, *model, "--seq-len", "65", "--data", str(root / "text")])
    assert "needs --hf-model" in _error(capsys, [*base, "--data", str(root / "text")])
    # the data pipeline's errors, through the command
    (tmp_path / "empty.txt").write_text("")
    assert "holds no text" in _error(capsys, [*base, *model, "--data",
                                              str(tmp_path / "empty.txt")])
    assert "body" in _error(capsys, [*base, *model, "--data", str(root / "docs.jsonl"),
                                     "--data-field", "title"])
    # an export into the folder the run was trained from, or from a run whose folder moved
    ckpt = str(root / "llama-b")
    assert "is the model folder the run was trained from" in _error(
        capsys, ["export", ckpt, str(root / "llama")])
    moved = tmp_path / "moved"
    shutil.copytree(root / "llama-a" / "step-000004", moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["extra"]["config"]["hf_model"] = str(tmp_path / "gone")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert "no longer holds config.json" in _error(capsys, ["export", str(moved),
                                                            str(tmp_path / "out")])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    assert "needs the tensorboard package" in _error(
        capsys, [*base, *model, "--data", str(root / "text"), "--tensorboard",
                 str(tmp_path / "tb")])
