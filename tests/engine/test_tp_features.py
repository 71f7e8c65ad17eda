"""ZeRO beside tensor parallelism, feature by feature, on 4 gloo ranks as dp 2 × tp 2 (one
spawn, ``tp_cases.features``; a second of 2 ranks as tp 2 × dp 1), the built-in GPT:

- 20 clipped AdamW steps: stages 0 and 3 agree bit for bit, and stay as close to the
  unsharded model (one process, the whole global batch, torch's clipping) as FSDP2 + TP
  on the same mesh (within twice its distance, both rounding), clipped by the global
  norm made whole per gradient (torch's ``clip_grad_norm_`` refuses FSDP2 + TP's
  parameters, which sit on two meshes);
- a NaN in one tp rank's slice skips the step on every rank (with clipping and without);
- ranks out of step across the tp axis stop every rank, naming each one's collective;
- zeroshard's checkpoints across tp degrees (dp 2 × tp 2 to dp 4, tp 4, tp 2 × dp 1 and a
  plain export; dp 4, an export and tp 2 × dp 1 back), weights and Adam's moments bit for
  bit, and ``torch.distributed.checkpoint`` of the state dict across tp degrees;
- one line for each mistake: a mesh with other dims, DTensors and no mesh, DTensors on
  another mesh, a tp degree that does not divide a split dim;
- ``SequenceParallel``: a norm whose gradient arrives ``Partial()``, at stages 0 and 3,
  against one process;
- what the module shows between steps: DTensors on the 2-D mesh;
- the other features beside it, 3 SGD steps against one process: accumulation, offload
  of the optimizer, hpZ (bit for bit plain stage 3), qwZ + qgZ (an approximation).
"""

import pytest
import torch

from zeroshard.checkpoint.consolidated import export
from zeroshard.runtime.spawn import spawn

from . import tp_cases as cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def ranks(folder):
    return spawn(cases.features, 4, str(folder), timeout=900)


@pytest.fixture(scope="module")
def two(ranks, folder):
    return spawn(cases.two_ranks, 2, str(folder), timeout=300)[0]


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_adam_with_clipping_is_as_close_as_fsdp2_tp(ranks):
    r = ranks[0]["adam"]
    assert _equal(r[3], r[0])
    ours, theirs = cases.distance(r[0], r["ref"]), cases.distance(r["fsdp2"], r["ref"])
    # Both are rounding apart from one process (tp splits each row-parallel matmul's sum),
    # in amounts that move with the CPU's matmul kernels: ours below FSDP2's on the machine
    # this was first run on, 2.0e-5 against 1.6e-5 on an AMD EPYC with AVX2. So: within a
    # factor of two of FSDP2 + TP, and ours under 1e-4 (five times the most measured).
    assert ours <= 2 * theirs, (ours, theirs)
    assert ours < 1e-4 and theirs < 1e-3, (ours, theirs)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_nan_in_one_tp_slice_skips_every_rank(ranks, clip):
    for rank in ranks:
        # (skipped, weights unchanged) per step: only step 1 is skipped, on every rank
        assert rank["nonfinite"][clip] == [(False, False), (True, True), (False, False)]


def test_ranks_out_of_step_across_tp_stop_every_rank(ranks):
    for rank in ranks:
        text = rank["out_of_step"]
        assert text.startswith("ranks are out of step"), text
        assert "rank 1: all_reduce" in text and "rank 3: an agreement" in text, text


def test_checkpoints_across_tp_degrees(ranks, two, folder, tmp_path):
    r = ranks[0]["checkpoints"]
    for layout in ("dp4", "tp4", "dp2tp2"):
        assert _equal(r["a", layout], r["a"]), layout
    assert _equal(r["b", "dp2tp2"], r["b"])
    weights = {k: v for k, v in r["a"].items() if "::" not in k}
    assert _equal(r["export", "dp2tp2"], weights)  # a plain model's file, into tp 2
    from safetensors.torch import load_file

    exported = load_file(folder / "a-export" / "model.safetensors")
    assert all(torch.equal(exported[k], weights[k]) for k in exported)
    assert set(weights) - set(exported) == {"head.weight"}  # tied: saved once, as wte
    # tp 2 × dp 1: A loaded; C written there, loaded at dp 2 and exported, is A again
    assert _equal(two["a"], r["a"]) and _equal(two["c", "dp2"], r["a"])
    export(folder / "c", tmp_path / "c-export")
    c = load_file(tmp_path / "c-export" / "model.safetensors")
    assert all(torch.equal(c[k], weights[k]) for k in c)


def test_manifest_records_each_tensors_tp_layout(ranks, folder):
    import json

    manifest = json.loads((folder / "a" / "manifest.json").read_text())
    assert manifest["tp"] == 2 and manifest["world"] == 2
    params = manifest["params"]
    assert params["blocks.0.q.weight"]["tp"] == {"dim": 0}
    assert params["blocks.0.proj.weight"]["tp"] == {"dim": 1}
    assert "tp" not in params["blocks.0.proj.bias"] and "tp" not in params["wte.weight"]
    files = manifest["files"]
    assert sorted(files) == [f"rank{i:05d}.safetensors" for i in range(4)]
    # a whole parameter is written by tp rank 0's files alone
    assert [f["tp_rank"] for _, f in sorted(files.items())] == [0, 0, 1, 1]
    assert all("wte.weight" not in f["rows"] for f in files.values() if f["tp_rank"])


def test_dcp_reshards_across_tp_degrees(ranks):
    r = ranks[0]["dcp"]
    assert _equal(r["tp4"], r["saved"]) and _equal(r["plain dp4"], r["saved"])


def test_each_mistake_is_one_line(ranks):
    names, none, other, uneven = ranks[0]["errors"]
    assert names == ("mesh: a DeviceMesh with dims ('data', 'model'); expected dims ('dp', "
                     "'tp') or ('dp_replicate', 'dp_shard', 'tp') (init_device_mesh(..., "
                     "mesh_dim_names=...))")
    assert none.startswith("parameter 'up.weight' is a DTensor on a mesh of dims ('tp',) "
                           "([0, 1]), and zs.shard() was given no mesh; pass mesh= ")
    assert "not on the 'tp' dim of the mesh zs.shard() was given ([0, 1, 2, 3])" in other
    assert uneven == ("tp=4 does not divide dim 0 of parameter 'up.weight' ((6, 6)); expected "
                      "a tp degree dividing 6")
    for text in (names, none, other, uneven):
        assert "\n" not in text


def test_sequence_parallel_norms(ranks):
    """A ``SequenceParallel`` norm's gradient arrives ``Partial()``: made its parameter's
    placement (an all-reduce over tp) before the reduction, every stage alike."""
    r = ranks[0]["sp"]
    assert _equal(r[3], r[0])
    assert cases.distance(r[0], r["ref"]) < 1e-6


def test_the_module_shows_dtensors_on_the_2d_mesh(ranks):
    """Between steps a released stage-3 unit shows this rank's rows as DTensors on the
    (dp, tp) mesh (FSDP2's swap): ``_StridedShard`` on dp where tp split dim 0 too."""
    r = ranks[0]["view"]
    mesh = ("dp", "tp")
    assert r["blocks.0.q.weight"] == (mesh, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert r["blocks.0.proj.weight"] == (mesh, "(Shard(dim=0), Shard(dim=1))")
    assert r["blocks.0.proj.bias"] == (mesh, "(Shard(dim=0), Replicate())")
    assert r["blocks.0.ln1.weight"] == (mesh, "(Shard(dim=0), Replicate())")
    whole = r["whole"]
    assert all(torch.equal(whole[k], r["full"][k]) for k in whole)


def test_accumulation_offload_and_zeropp_beside_tp(ranks):
    r = ranks[0]["other"]
    for key in (("accum", 1), ("accum", 2), "offload", "plain3"):
        assert cases.distance(r[key], r["ref"]) < 1e-6, key
    assert _equal(r["hpz"], r["plain3"])
    assert cases.distance(r["quantized"], r["ref"]) < 1e-2  # int8 blocks of 64

