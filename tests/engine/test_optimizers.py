"""Optimizers that are not elementwise, on real gloo ranks against torch DDP with the
same optimizers on whole matrices and the same batches ([Note: optimizer needs] in
``spec/optimizers.py``): Muon with AdamW for the rest (owner computes), Adafactor and
LAMB (whole-tensor sums all-reduced), at stages 1-3, at N = 2 and N = 4, with hybrid
sharding, mixed precision, accumulation, clipping, offload and checkpoints; the ledger's
bytes held and sent against the planner's; refusals. One spawn per world size."""

import pytest

from zeroshard.runtime.spawn import spawn

from . import optimizer_cases as oc

pytestmark = pytest.mark.dist

TOL = 1e-6
MODELS = ("gpt", "hf_llama")


def _grid2(root):
    # stages 1-2 at N = 2: zeroshard verify's grid (tests/parity); at N = 4: _grid4
    return {"parity": oc.parity_grid(MODELS, ("muon", "adafactor"), (3,)),
            "lamb": oc.parity_grid(["gpt"], ["lamb"], (2,)),
            "features": oc.features_grid(), "ledger": oc.ledger_grid(),
            "checkpoint": oc.checkpoint_grid(root), "misuse": oc.misuse_grid(),
            "example": oc.lamb_example()}


def _grid4(root):
    return {"muon": oc.parity_grid(MODELS, ("muon",), (1, 2, 3, "hybrid"), replicated=True),
            "adafactor": oc.parity_grid(MODELS, ("adafactor",), (1, 2, 3, "hybrid")),
            "distinct": oc.cases.bit_equal(oc.train("gpt", 3, "muon")[0],
                                           oc.train("gpt", 0, "muon")[0]),
            "reshard": oc.reshard_grid(root)}


@pytest.fixture(scope="module")
def grid2(tmp_path_factory):
    return spawn(_grid2, 2, str(tmp_path_factory.mktemp("optim2")), timeout=900)[0]


@pytest.fixture(scope="module")
def grid4(tmp_path_factory):
    return spawn(_grid4, 4, str(tmp_path_factory.mktemp("optim4")), timeout=900)[0]


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
@pytest.mark.parametrize("model", MODELS)
def test_within_1e6_of_ddp_at_stage_3_n2(grid2, model, kind):
    r = grid2["parity"]
    diffs = [r[(model, kind, 3)]["ddp"]]
    assert max(diffs) < TOL, diffs
    if kind == "muon":  # the very Newton-Schulz on the very matrix: the same bits
        assert max(diffs) == 0.0, diffs


def test_lamb_is_exact_on_shards(grid2):
    assert grid2["lamb"][("gpt", "lamb", 2)]["ddp"] < TOL, grid2["lamb"]


def test_the_lamb_example_answers_the_source_documents_question(grid2):
    """examples/lamb.py: LAMB sliced naively (each rank its rows' norms) is not DDP;
    with the norms all-reduced ZeRO-1 is DDP bit for bit, for one all-reduce of two fp64
    sums per parameter a step."""
    import torch

    r = grid2["example"]
    assert (r["ddp"] - r["naive"]).abs().max().item() > 1e-4, r
    assert torch.equal(r["ddp"], r["zero1"]), r
    assert "cannot tell whether NaiveLamb" in r["naive warned"][0]
    assert r["zero1 step bytes"]["all_reduce"] == {"calls": 1, "bytes": 16}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3, "hybrid"])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
@pytest.mark.parametrize("model", MODELS)
def test_within_1e6_of_ddp_n4(grid4, model, kind, stage):
    """N = 4, stages 1-3 and hybrid sharding (stage 3 over shard groups of 2, replicated
    twice: owners and sums inside a group). torch DDP's buckets sum four ranks in another
    order than zeroshard's unit buffers, and Muon orthogonalises in bf16, which turns
    last-bit differences of its input into visible ones over 20 steps: DDP against DDP
    with another bucket size differs by 7e-3 on the GPT and 1.5e-3 on Llama (measured).
    So Muon is held to DDP where the order of the sums cannot matter, every rank
    training on the whole batch (a sum of equal terms is the same in any order) - and
    there it is DDP bit for bit; Adafactor on the ranks' own batches."""
    r = grid4[kind][(model, kind, stage)]
    assert r["ddp"] < TOL, r
    if kind == "muon":
        assert r["ddp"] == 0.0, r


@pytest.mark.slow
def test_muon_n4_on_each_ranks_own_batch_is_stage_0_bit_for_bit(grid4):
    """Four different gradients summed alike at every stage (zeroshard's own order):
    stage 3's owners orthogonalise the same matrices as torch's Muon at stage 0."""
    assert grid4["distinct"]


def test_features(grid2):
    f = grid2["features"]
    for key in ("bf16", "accumulate", "clip", "offload"):  # Muon: bit for bit
        assert f[key], (key, f)
    assert f["adafactor"] < TOL, f  # accumulation, clipping and offload at once


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_memory_and_bytes_sent_equal_the_plan(grid2, kind):
    for stage in range(4):
        for precision in (None, "bf16"):
            r = grid2["ledger"][(kind, stage, precision)]
            assert r["memory"] == r["plan"], (stage, precision, r)
            assert r["owner"] == r["owner_plan"], (stage, precision, r)
            if stage in (1, 2):  # no other all-reduce there (stage 3: neither)
                assert r["sums"] == r["sums_plan"], (stage, precision, r)
    sent = grid2["ledger"][(kind, 2, None)]
    if kind == "muon":
        assert sent["owner"]["owner_gather"] > 0 and sent["sums"] == 0, sent
    else:
        assert sent["sums"] > 0 and sent["owner"]["owner_gather"] == 0, sent


def test_adafactor_state_is_smaller_than_muons_and_adams(grid2):
    led = grid2["ledger"]
    assert led[("adafactor", 1, None)]["memory"] < led[("muon", 1, None)]["memory"]


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_checkpoint_resumes_bit_for_bit_at_another_stage(grid2, kind):
    assert grid2["checkpoint"][kind]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
@pytest.mark.parametrize("layout", ["n2", "n1"])
def test_checkpoint_state_reshards_across_n(grid4, kind, layout):
    import torch

    saved, again = grid4["reshard"][(kind, "n4")], grid4["reshard"][(kind, layout)]
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[k], again[k]) for k in saved), [
        k for k in saved if not torch.equal(saved[k], again[k])]
    assert any("col_var" in k for k in saved) == (kind == "adafactor")


def test_unclassified_optimizers_are_refused_with_what_is_supported(grid2):
    m = grid2["misuse"]
    for stage in (1, 3):
        kind, msg = m[(stage, "LAMB")]
        assert kind == "ValueError" and f"LAMB cannot step ZeRO stage {stage} shards" in msg
        assert "torch.optim.Muon" in msg and "zeroshard.optim.Lamb" in msg, msg
    assert m[(0, "LAMB")] is None  # stage 0 steps whole parameters
    assert "LBFGS cannot step ZeRO stage 2 shards" in m[(2, "LBFGS")][1]


def test_several_optimizers(grid2):
    m = grid2["misuse"]
    kind, msg = m["overlap"]
    assert kind == "NotImplementedError" and "stepped already since the last backward" in msg
    for stage in (0, 2):  # an optimizer over part of the model
        diff, state = m[("part", stage)]
        assert diff < TOL and state == "partial", m[("part", stage)]
