"""The planner's numbers, asserted to the decimals the source documents print."""

import json
import subprocess
import sys

import pytest

from zeroshard.cli import main
from zeroshard.plan import (
    PRESETS,
    ModelSpec,
    ParallelDims,
    Workload,
    ZeroConfig,
    activation_bytes,
    first_fit,
    from_hf_config,
    get_recipe,
    min_gpus,
    plan_all,
    ring_all_reduce,
    ring_one_way,
)

BF16 = get_recipe("bf16-mixed-adamw")
GB = 1e9


def config(recipe, stage=3, **options) -> ZeroConfig:
    """The planner's configuration: ``recipe`` taken whole (reduced in its own dtype)."""
    return ZeroConfig(stage=stage, mixed_precision=recipe, **options)


M7 = ModelSpec("7B-style", 6_738_149_376, 4096, 32)
M70 = ModelSpec("70B-style", 68_975_329_280, 8192, 80)


def plan_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def totals(out):
    return {s["strategy"]: s for s in out["strategies"]}


def test_7b_on_8_gpus(capsys):
    out = plan_json(capsys, "--params", "6738149376", "--hidden", "4096", "--layers", "32",
                    "--gpus", "8")
    s = totals(out)
    assert [round(s[k]["total"] / GB, 2) for k in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == [
        108.63, 37.88, 26.09, 14.30]
    assert {round(v["activations"] / GB, 3) for v in s.values()} == {0.822}
    assert [round(s[k]["comm"] / GB, 2) for k in ("DDP", "ZeRO-1", "ZeRO-2")] == [23.58] * 3
    assert round(s["ZeRO-3"]["comm"] / GB, 2) == 35.38
    assert s["ZeRO-3"]["comm"] / s["DDP"]["comm"] == pytest.approx(1.5)
    # per category, as the source table prints them
    assert [round(s["ZeRO-1"][c] / GB, 2) for c in ("weights", "grads", "optimizer")] == [
        13.48, 13.48, 10.11]
    assert round(s["ZeRO-2"]["grads"] / GB, 2) == 1.68
    assert out["first_fit"] == "ZeRO-1"
    assert all(isinstance(v[k], int) for v in s.values()
               for k in ("weights", "grads", "optimizer", "activations", "total", "comm"))


def test_7b_table_text(capsys):
    assert main(["plan", "--params", "6738149376", "--hidden", "4096", "--layers", "32"]) == 0
    text = capsys.readouterr().out
    for row in ("DDP      │   13.48 │ 13.48 │ 80.86 │ 0.822 │   108.63 │   23.58 │  1.00x",
                "ZeRO-3   │    1.68 │  1.68 │ 10.11 │ 0.822 │    14.30 │   35.38 │  1.50x"):
        assert row in text
    assert "first fit on 8 GPUs: ZeRO-1" in text
    # generate() at stage 3 with the weights gathered once: the full bf16 weights, 2P
    assert ("generate() at ZeRO-3 with the weights gathered once: +13.48 per GPU beside "
            "the state's 13.48 (26.95, before the generation's activations)"
            in " ".join(text.split()))


def test_generation_gathers_the_full_compute_weights_at_stage_3_only():
    """2 bytes a parameter under bf16 (4 in fp32), of the GPU's 1/tp; 0 below stage 3."""
    from zeroshard.plan.memory import generate_gather_bytes

    p = 6_738_149_376
    model = ModelSpec("custom", p, 4096, 32)
    bf16 = ZeroConfig(stage=3, mixed_precision="bf16")
    assert generate_gather_bytes(model, ParallelDims(8), bf16) == 2 * p
    assert generate_gather_bytes(model, ParallelDims(64), ZeroConfig(stage=3)) == 4 * p
    assert generate_gather_bytes(model, ParallelDims(8), ZeroConfig(stage=2)) == 0


def test_7b_at_24_gb_first_fit_is_zero3(capsys):
    out = plan_json(capsys, "--params", "6738149376", "--hidden", "4096", "--layers", "32",
                    "--gpu-mem", "24")
    assert out["first_fit"] == "ZeRO-3"
    assert [v["fits"] for v in out["strategies"]] == [False, False, False, True]


def test_70b_fits_from_16_gpus(capsys):
    at8 = totals(plan_json(capsys, "--params", "68975329280", "--hidden", "8192",
                           "--layers", "80", "--gpus", "8"))["ZeRO-3"]
    at16 = totals(plan_json(capsys, "--params", "68975329280", "--hidden", "8192",
                            "--layers", "80", "--gpus", "16"))["ZeRO-3"]
    assert (round(at8["total"] / GB, 2), at8["fits"]) == (141.21, False)
    assert (round(at16["total"] / GB, 2), at16["fits"]) == (72.23, True)
    assert round(at8["activations"] / GB, 3) == 3.255


def test_70b_min_gpus(capsys):
    out = plan_json(capsys, "--params", "68975329280", "--hidden", "8192", "--layers", "80",
                    "--min-gpus", "--gpu-mem", "80")
    mins = {m["strategy"]: m for m in out["min_gpus"]}
    assert mins["ZeRO-3"]["gpus"] == 16
    assert mins["ZeRO-1"]["gpus"] is None
    assert round(mins["ZeRO-1"]["floor"] / GB, 1) == 275.9
    assert mins["DDP"]["gpus"] is None
    # any GPU count, not only powers of two: 15 already fits (73.57 + 3.255 GB)
    assert min_gpus(M70, config(BF16), 80 * 10**9, step=1).gpus == 15
    assert main(["plan", "--params", "68975329280", "--hidden", "8192", "--layers", "80",
                 "--min-gpus"]) == 0
    text = capsys.readouterr().out
    assert "never" in text and "275.9" in text


def test_13b_on_16_gpus_without_activations(capsys):
    out = plan_json(capsys, "--params", "13000000000", "--gpus", "16", "--gpu-mem", "24")
    s = totals(out)
    assert [s[k]["total"] for k in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == [
        208 * 10**9, 61_750_000_000, 37_375_000_000, 13 * 10**9]
    assert all(v["activations"] is None for v in s.values())
    assert [v["fits"] for v in s.values()] == [False, False, False, True]
    assert main(["plan", "--params", "13000000000", "--gpus", "16"]) == 0
    assert "activations: not modelled" in capsys.readouterr().out


def test_fp32_recipe_moves_bytes_between_categories():
    work = Workload()
    bf16 = {p.strategy: p for p in plan_all(M7, ParallelDims(8), config(BF16), work)}
    fp32 = {p.strategy: p for p in plan_all(M7, ParallelDims(8),
                                             config(get_recipe("fp32-adamw")), work)}
    P = M7.params
    assert fp32["DDP"].optimizer == 8 * P < bf16["DDP"].optimizer == 12 * P
    assert fp32["DDP"].weights + fp32["DDP"].grads + fp32["DDP"].optimizer == 16 * P
    assert fp32["DDP"].activations == 2 * bf16["DDP"].activations
    assert fp32["DDP"].total > bf16["DDP"].total


def test_ring_accounting():
    T, N = 2 * 1000, 8
    assert ring_all_reduce(T, N) == 2 * (N - 1) * T // N
    assert ring_one_way(T, N) == (N - 1) * T // N
    p = {x.strategy: x for x in plan_all(ModelSpec("m", 1000), ParallelDims(N), config(BF16))}
    assert p["DDP"].comm == ring_all_reduce(2 * 1000, N)
    assert p["ZeRO-2"].comm == 2 * ring_one_way(2 * 1000, N)
    assert p["ZeRO-3"].comm == 3 * ring_one_way(2 * 1000, N)
    # gradients reduced in fp32 beside bf16 weights: the reduce half doubles
    fp32_reduce = BF16.with_reduce_dtype("fp32")
    p = {x.strategy: x for x in plan_all(ModelSpec("m", 1000), ParallelDims(N),
                                         config(fp32_reduce))}
    assert p["ZeRO-1"].comm == ring_one_way(4000, N) + ring_one_way(2000, N)


def test_activation_formulas():
    m = ModelSpec("m", 10**9, hidden=1024, layers=10, heads=16)
    # checkpointing with flash attention: tokens·h·(L + 17)·bytes
    flash = Workload(2048, flash_attention=True)
    assert activation_bytes(m, BF16, flash) == 2048 * 1024 * 27 * 2
    # without it the recomputed layer keeps its 5·a·s·tokens bytes of scores as well
    assert activation_bytes(m, BF16, Workload(2048)) == 2048 * 1024 * 27 * 2 + 5 * 16 * 2048**2
    # the source documents' bare 7B count has no heads: the seed's L + 17 stands
    assert activation_bytes(ModelSpec("7B", 10**9, 4096, 32), BF16, Workload()) == (
        2048 * 4096 * 49 * 2)
    # Korthikanti et al.: per layer s·b·h·(34 + 5·a·s/h) 16-bit bytes
    full = activation_bytes(m, BF16, Workload(4096, seq_len=2048, checkpointing=False))
    assert full == 10 * 2048 * 2 * 1024 * (34 + 5 * 16 * 2048 / 1024)
    flash = activation_bytes(m, BF16, Workload(4096, seq_len=2048, checkpointing=False,
                                               flash_attention=True))
    assert flash == 10 * 4096 * 1024 * 34


@pytest.mark.parametrize("name,count", [
    ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192), ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200), ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496), ("mistral-7b", 7_241_732_096),
    ("pythia-160m", 162_322_944),
])
def test_preset_counts(name, count):
    assert PRESETS[name].params == count


def test_source_7b_count_is_llama2_without_norms():
    a = PRESETS["llama2-7b"]
    assert a.params - (2 * a.layers + 1) * a.hidden == M7.params


def write_config(tmp_path, **fields):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


def test_hf_configs(tmp_path):
    llama = write_config(tmp_path, model_type="llama", hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=11008, vocab_size=32000)
    assert from_hf_config(llama).params == 6_738_415_616
    gpt2 = write_config(tmp_path, model_type="gpt2", n_embd=768, n_layer=12, n_head=12,
                        vocab_size=50257, n_positions=1024)
    assert from_hf_config(gpt2).params == 124_439_808
    neox = write_config(tmp_path, model_type="gpt_neox", hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, intermediate_size=3072, vocab_size=50304)
    assert from_hf_config(neox).params == 162_322_944


def test_dimension_flags_match_preset(capsys):
    out = plan_json(capsys, "--hidden", "8192", "--layers", "80", "--heads", "64",
                    "--kv-heads", "8", "--ffn", "28672", "--vocab", "32000")
    assert out["params"] == 68_976_648_192


BAD = [
    (["--model", "nope"], "unknown model 'nope'; known models: llama2-7b"),
    (["--gpus", "0"], "--gpus=0 must be positive"),
    (["--gpu-mem", "-5"], "--gpu-mem=-5.0 must be positive"),
    (["--params", "-3"], "--params=-3 must be positive"),
    (["--model", "gpt2", "--params", "5"], "--model and --params contradict"),
    (["--model", "gpt2", "--hidden", "5"], "--model and --hidden contradict"),
    (["--hidden", "64", "--layers", "2"], "missing --heads, --ffn, --vocab"),
    (["--params", "100", "--ffn", "3"], "--ffn has no effect with --params"),
    (["--checkpoint-every", "2", "--no-checkpointing"],
     "--checkpoint-every and --no-checkpointing contradict each other"),
    (["--precision", "fp8-magic"], "unknown precision recipe 'fp8-magic'"),
    (["--strategy", "ZeRO-9"], "unknown strategy 'ZeRO-9'"),
    (["--sweep", "8,x"], "--sweep='8,x' must be comma-separated"),
    (["--gpus", "many"], "argument --gpus: invalid int value"),
    (["--html", "/nonexistent/dir/plan.html"], "--html=/nonexistent/dir/plan.html: folder "
                                                "/nonexistent/dir does not exist"),
    (["--plot", "/nonexistent/plan.png"], "--plot=/nonexistent/plan.png: folder"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) if "invalid int" in message else _no_raise() as exc:
        code = main(["plan", *argv])
    code = exc.value.code if exc else code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_bad_hf_configs(tmp_path, capsys):
    missing = write_config(tmp_path, model_type="llama", hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, vocab_size=100)
    assert main(["plan", "--hf-config", str(missing)]) == 2
    assert "missing field 'intermediate_size'" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["plan", "--hf-config", str(broken)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    assert main(["plan", "--hf-config", str(tmp_path / "absent.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_first_fit_none_explains(capsys):
    assert main(["plan", "--model", "llama2-70b", "--gpus", "2"]) == 0
    assert "nothing fits on 2 GPUs; ZeRO-3 fits from 16 GPUs" in capsys.readouterr().out
    assert first_fit(plan_all(M70, ParallelDims(2), config(BF16), budget=10**9)) is None


def test_sweep_and_plot(tmp_path, capsys):
    out = plan_json(capsys, "--model", "llama2-7b", "--sweep", "8,64,256")
    z1 = [out["sweep"][n][1]["total"] for n in ("8", "64", "256")]
    assert z1[0] > z1[1] > z1[2] > 4 * PRESETS["llama2-7b"].params  # falls toward the 4P floor
    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "gpt2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gib_switches_units(capsys):
    out = plan_json(capsys, "--model", "llama2-7b", "--gib", "--gpu-mem", "80")
    assert out["budget"] == 80 * 2**30
    assert main(["plan", "--model", "llama2-7b", "--gib"]) == 0
    assert "total GiB" in capsys.readouterr().out


def test_plan_never_imports_torch():
    code = ("import sys, zeroshard.plan, zeroshard.commands.plan, zeroshard.cli as c; "
            "c.main(['plan', '--json']);"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--list-models", "--hf-config", "--params", "--hidden", "--layers",
                 "--heads", "--kv-heads", "--ffn", "--vocab", "--tied", "--gpus", "--gpu-mem",
                 "--gib", "--precision", "--tokens", "--no-checkpointing", "--flash-attention",
                 "--strategy", "--min-gpus", "--sweep", "--json", "--plot"):
        assert flag in text
