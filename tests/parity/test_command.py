"""``zeroshard verify``: the trainer's flags, its first K steps compared; the verdict in
the exit code; JSON beside the tables; what it refuses and what it leaves unread."""

import json

import pytest

from zeroshard.cli import main

pytestmark = pytest.mark.dist


def _run(argv, capfd) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capfd.readouterr()
    return code, out, err


def test_the_default_configuration_is_bitwise(tmp_path, capfd):
    """The README's configuration (GPT small, stage 3, clipping at 1, warm-up), the first
    5 steps: every tensor equal, the plan's bytes measured."""
    code, out, _ = _run(["verify", "--json", str(tmp_path / "c.json")], capfd)
    assert code == 0, out
    assert "bitwise: every tensor equals the unsharded model's" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["verdict"] == "bitwise"
    assert data["title"] == "GPT small, stage 3, fp32-adamw, N = 2, 5 steps"
    assert [c["category"] for c in data["categories"]][:4] == [
        "initial weights", "losses", "gradients, step 1", "weights"]
    assert data["memory"]["optimizer"]["measured"] == data["memory"]["optimizer"]["planned"]


def test_muon_bf16_at_stage_2_with_the_trainers_other_flags(tmp_path, capfd):
    code, out, _ = _run(["verify", "--model", "tiny", "--stage", "2", "--mixed-precision",
                         "bf16", "--optimizer", "muon", "--verify-steps", "3", "--save-dir",
                         str(tmp_path / "never"), "--batch", "8", "--micro-batch", "2",
                         "--json", str(tmp_path / "c.json")], capfd)
    assert code == 0, out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["verdict"] == "bitwise" and "bf16-mixed-muon" in data["title"]
    assert "optimizer momentum_buffer" in [c["category"] for c in data["categories"]]
    assert not (tmp_path / "never").exists()
    notes = data["notes"]
    assert notes[0] == "--save-dir: not read by verify, which writes nothing"
    assert "(the run accumulates 2)" in notes[1]


def test_tensor_parallelism_against_the_plain_model(tmp_path, capfd):
    """Each layer split over both ranks (GPT.TP_PLAN), ZeRO over the one data-parallel
    rank left: the row-parallel layers sum partial products across ranks, so within
    rounding, every tensor reassembled from its tp slices."""
    code, out, _ = _run(["verify", "--model", "tiny", "--tp", "2", "--stage", "3",
                         "--verify-steps", "3", "--json", str(tmp_path / "c.json")], capfd)
    assert code == 0, out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["verdict"] in ("bitwise", "within rounding"), data
    assert "TP 2" in data["title"]
    assert {c["category"] for c in data["categories"]} >= {
        "gradients, step 1", "weights", "optimizer exp_avg", "optimizer exp_avg_sq"}
    assert all(c["tensors"] == 36 for c in data["categories"] if c["category"] != "losses")


@pytest.mark.parametrize("argv,line", [
    (["--tp", "3", "--nproc", "3"], "--tp=3 does not divide GPT small's 4 heads"),
    (["--verify-steps", "0"], "--verify-steps=0; expected a positive integer"),
    (["--mixed-precision", "fp16"], "--mixed-precision='fp16': verify replays fp32 and bf16"),
    (["--hidden", "30"], "--hidden=30 does not divide into GPT small's 4 heads"),
    (["--optimizer", "sgd", "--betas", "0.9,0.95"], "--betas=[0.9, 0.95] is a setting of "
     "adamw, lamb and muon only, not of --optimizer='sgd', which takes momentum"),
])
def test_what_verify_refuses_is_one_line(argv, line, capfd):
    code, out, err = _run(["verify", *argv], capfd)
    assert code == 2 and line in err and len(err.strip().splitlines()) == 1, err


def test_a_wrong_configuration_exits_1(monkeypatch, capfd):
    """The exit code carries the verdict: here the reference (this process) is made to sum
    the ranks' gradients without dividing by N, so the two sides part at step 1."""
    from zeroshard.parity import reference

    original = reference._reduce
    monkeypatch.setattr(reference, "_reduce", lambda parts, n, nudge: original(parts, 1, nudge))
    code, out, _ = _run(["verify", "--model", "tiny", "--stage", "2", "--verify-steps", "2"],
                        capfd)
    assert code == 1, out
    assert "DIFFERS: gradients, step 1: relative difference 0.5 in" in out


@pytest.mark.slow
@pytest.mark.parametrize("shrink", [["--layers", "1"], ["--hidden", "16"]])
def test_a_hugging_face_folder_on_its_data_shrunk(shrink, tmp_path_factory, tmp_path, capfd):
    """A Llama folder (tied head, grouped key/value heads) on text files tokenized by its
    own tokenizer, at stage 3 in bf16 with Muon: the first block's weights read from the
    folder, or another width with seeded weights."""
    from tests.train.test_hf import _data, _models

    root = tmp_path_factory.mktemp("hf")
    _models(root)
    _data(root)
    code, out, _ = _run(["verify", "--hf-model", str(root / "llama"), "--data",
                         str(root / "text"), "--stage", "3", "--mixed-precision", "bf16",
                         "--optimizer", "muon", "--seq-len", "32", "--batch", "4",
                         "--verify-steps", "3", *shrink, "--json", str(tmp_path / "c.json")],
                        capfd)
    assert code == 0, out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["verdict"] == "bitwise", data
    assert data["title"].startswith(f"Hugging Face LlamaForCausalLM ({shrink[0][2:]} "
                                    f"{shrink[1]}), stage 3, bf16-mixed-muon")
