"""LoRA at every stage with the default units, on real gloo processes at N = 2: peft
adapters (r = 4) on a tiny Hugging Face Llama (q_proj, v_proj) and on the built-in GPT
(q, v), 20 AdamW steps against torch DDP; the frozen base unchanged; memory equal to the
planner's ``--lora`` figures; peft's save_pretrained read back by its from_pretrained,
merge_and_unload, adapters added or switched after sharding, modules_to_save, and a
quantized base. The planner's LoRA counts are checked without processes."""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytest.importorskip("peft")

# -- the planner: no process group ---------------------------------------------------------


def test_planner_counts_peft_adapters_on_llama_7b():
    from zeroshard.plan.adaptercount import adapter_params, with_lora
    from zeroshard.plan.arch import ModelSpec, get_preset
    from zeroshard.spec.lora import LoraSpec

    arch = get_preset("llama2-7b")
    # q_proj and v_proj, 4096 -> 4096 each: r·(4096 + 4096) per projection, 32 layers
    assert adapter_params(arch, LoraSpec(16)) == 32 * 2 * 16 * 8192
    every = LoraSpec(8, targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    assert adapter_params(arch, every) == 32 * 8 * (4 * 8192 + 3 * (4096 + 11008))
    spec = with_lora(ModelSpec.from_arch(arch), LoraSpec(16))
    assert (spec.params, spec.trainable) == (arch.params + 8_388_608, 8_388_608)
    gpt2 = get_preset("gpt2")  # c_proj: the attention's and the MLP's output projections
    assert adapter_params(gpt2, LoraSpec(2, targets=("c_proj",))) == 12 * 2 * (1536 + 3840)
    with pytest.raises(ValueError, match="names no layer of this model"):
        adapter_params(arch, LoraSpec(2, targets=("lm_head",)))
    with pytest.raises(ValueError, match="bare --params"):
        with_lora(ModelSpec("bare", 10**9), LoraSpec(2))


def test_planner_keeps_gradients_and_optimizer_for_the_adapters_only():
    from zeroshard.plan.memory import model_state_bytes
    from zeroshard.spec.config import ZeroConfig
    from zeroshard.spec.dims import ParallelDims

    p, t, dims = 1_000_000, 10_000, ParallelDims(8)
    bf16 = ZeroConfig(mixed_precision="bf16")
    assert model_state_bytes(p, dims, bf16.at_stage(1), t) == (2 * p, 2 * t, 12 * t // 8)
    assert model_state_bytes(p, dims, bf16.at_stage(3), t) == (2 * p // 8, 2 * t // 8,
                                                               12 * t // 8)


def test_plan_command_takes_lora(capsys):
    import json

    from zeroshard.cli import main

    assert main(["plan", "--model", "llama2-7b", "--gpus", "8", "--lora", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainable"] == 8_388_608
    ddp, zero3 = out["strategies"][0], out["strategies"][3]
    assert ddp["optimizer"] == 12 * 8_388_608 and ddp["weights"] == 2 * out["params"]
    assert zero3["weights"] == 2 * out["params"] // 8
    assert main(["plan", "--model", "llama2-7b", "--lora", "16", "--time"]) == 2
    assert "does not weigh adapters yet" in capsys.readouterr().err


# -- two gloo ranks: one spawn runs this file's grid ---------------------------------------


def _grid(folder):
    from . import lora_cases

    return {"lora": lora_cases.lora_grid(folder), "calls": lora_cases.peft_calls_grid()}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return spawn(_grid, 2, str(tmp_path_factory.mktemp("adapters")), timeout=600)[0]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_lora_matches_ddp_and_the_plan(grid, kind, stage):
    r = grid["lora"][(kind, stage)]
    assert r["adapters"] < cases.TOL, r
    assert r["base_unchanged"]
    assert (r["plan"]["params"], r["plan"]["trainable"]) == r["counts"]
    mem, (weights, grads, optimizer) = r["memory"], r["plan"]["state"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (weights, grads, optimizer)
    assert mem["padding"] == 0 and mem["gathered"] == 0
    assert r["saved_logits"] < 1e-5, r["saved_logits"]  # peft's files, read back by peft


@pytest.mark.dist
def test_peft_calls_on_a_stage3_model(grid):
    r = grid["calls"]
    assert r["merged_type"] == "LlamaForCausalLM" and r["merged_logits"] < 1e-5, r
    assert r["unchanged"] and r["trains_on"]
    kind, text = r["add_adapter"]
    assert kind == "NotImplementedError" and "before zs.shard()" in text
    kind, text = r["set_adapter"]
    assert kind == "NotImplementedError" and "lora_A.other" in text
    assert r["set_adapter_inference"] is None and r["other_logits"] == 0.0
    assert r["modules_to_save"] < cases.TOL
    kind, text = r["quantized"]
    assert kind == "NotImplementedError" and "Params4bit" in text and "'lm_head.weight'" in text
