"""Configuration and setup, as unit tests (no process group): ZeroConfig's validation,
the DeepSpeed config translator, and zs.shard / zs.init_distributed without a launcher."""

import re

import pytest

import zeroshard as zs
from zeroshard.spec.config import ZeroConfig

from ..engine.engine_cases import MLP


def test_config_validation():
    assert ZeroConfig().recipe.name == "fp32-adamw"
    bf16 = ZeroConfig(mixed_precision="bf16").recipe
    assert (bf16.weight_bytes, bf16.grad_bytes, bf16.optimizer_bytes, bf16.reduce_dtype) == (
        2, 2, 12, "fp32")
    with pytest.raises(ValueError, match="stage=5 is not a ZeRO stage; expected 0, 1, 2 or 3"):
        ZeroConfig(stage=5)
    with pytest.raises(ValueError, match="mixed_precision='fp8' is not supported"):
        ZeroConfig(mixed_precision="fp8")
    # fp16 is accepted; its first step without a loss scaler is refused (test_fp16.py)
    assert ZeroConfig(mixed_precision="fp16").recipe.param_dtype == "fp16"
    with pytest.raises(ValueError, match=r"unknown ZeroConfig keys \['stages'\]"):
        ZeroConfig.from_dict({"stages": 2})


def test_reduce_bucket_default_is_ddps_at_stage_0_only():
    """25 MiB of the reduce dtype where stage 0's buffers replace the gradients they
    carry; 0 (one reduction per unit) at stages 1-3 and where stage 0 sums bf16
    gradients in fp32 (its buffers would outweigh them); a given size is kept."""
    assert ZeroConfig(stage=0).reduce_bucket == 25 * 2**20 // 4 == 6_553_600
    assert ZeroConfig(stage=0, mixed_precision="bf16", reduce_dtype="bf16").reduce_bucket == (
        25 * 2**20 // 2)
    assert ZeroConfig(stage=0, mixed_precision="bf16").reduce_bucket == 0  # fp32 sums
    assert [ZeroConfig(stage=s).reduce_bucket for s in (1, 2, 3)] == [0, 0, 0]
    assert ZeroConfig(stage=0, reduce_bucket_size=0).reduce_bucket == 0
    assert ZeroConfig(stage=2, reduce_bucket_size=7).reduce_bucket == 7
    with pytest.raises(ValueError, match="reduce_bucket_size=-1 must be an integer >= 0"):
        ZeroConfig(reduce_bucket_size=-1)


def test_deepspeed_config_names_ignored_keys():
    with pytest.warns(UserWarning, match="ignored by zeroshard: optimizer, "
                                         "zero_optimization.overlap_comm"):
        c = ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "overlap_comm": True},
                                  "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}})
    assert (c.stage, c.mixed_precision) == (2, "bf16")


def test_deepspeed_fp16_scaler_keys_point_to_the_scaler(recwarn):
    ds = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale_window": 500,
                                                       "hysteresis": 2, "auto_cast": False}}
    assert ZeroConfig.from_dict(ds).mixed_precision == "fp16"
    assert [str(w.message) for w in recwarn.list] == [
        "DeepSpeed config keys ignored by zeroshard: fp16.auto_cast",
        "DeepSpeed config keys fp16.hysteresis, fp16.loss_scale_window are the loss scaler's: "
        "pass the config to zs.GradScaler.from_deepspeed(model, config)"]


def test_deepspeed_translator_names_keys_and_leaves_handled_ones_to_the_caller(recwarn):
    ds = {"zero_optimization": {"reduce_bucket_size": 5e8}, "bf16": {"enabled": False},
          "train_batch_size": 8, "optimizer": {"type": "AdamW"}}
    c = ZeroConfig.from_deepspeed(ds, handled=("train_batch_size",))
    assert c == ZeroConfig(stage=0, reduce_bucket_size=500_000_000)  # DeepSpeed's default
    assert [str(w.message) for w in recwarn.list] == [
        "DeepSpeed config keys ignored by zeroshard: optimizer"]
    for bad, message in [
            ({"zero_optimization": {"stage": 4}},
             "zero_optimization.stage=4 is not a ZeRO stage; expected 0, 1, 2 or 3"),
            ({"zero_optimization": {"stage3_param_persistence_threshold": -1}},
             "zero_optimization.stage3_param_persistence_threshold=-1 must be an integer"),
            ({"bf16": {"enabled": 1}}, "bf16.enabled=1 must be true or false"),
            ({"bf16": True}, "bf16=True must be a JSON object")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ZeroConfig.from_deepspeed(bad)


def test_activation_checkpointing_modes():
    """The named modes, a count k of blocks (written as a number or, as a flag gives it, as
    text; 1 is "full"), and a clear error for anything else."""
    for mode in ("none", "full", "selective", "full+offload"):
        assert ZeroConfig(activation_checkpointing=mode).activation_checkpointing == mode
    assert ZeroConfig(activation_checkpointing=3).activation_checkpointing == 3
    assert ZeroConfig(activation_checkpointing="2").activation_checkpointing == 2
    assert ZeroConfig(activation_checkpointing=1).activation_checkpointing == "full"
    expected = ("; expected one of 'none', 'full', 'selective', 'full+offload' or a count "
                "k >= 1 (every k-th unit)")
    for bad, shown in (("all", "'all'"), (0, "0"), ("-1", "'-1'"), (True, "True"),
                       (2.5, "2.5")):
        with pytest.raises(ValueError, match=re.escape(
                f"activation_checkpointing={shown}{expected}")):
            ZeroConfig(activation_checkpointing=bad)


def test_deepspeed_activation_checkpointing_section(recwarn):
    """Present, it asks for checkpointing ("full+offload" with cpu_checkpointing); its
    other keys are named in the one warning; zeroshard's own field (a mode) is not
    taken for DeepSpeed's section."""
    ds = {"zero_optimization": {"stage": 3},
          "activation_checkpointing": {"partition_activations": True,
                                       "cpu_checkpointing": True, "number_checkpoints": 4}}
    assert ZeroConfig.load(ds).activation_checkpointing == "full+offload"
    assert [str(w.message) for w in recwarn.list] == [
        "DeepSpeed config keys ignored by zeroshard: "
        "activation_checkpointing.number_checkpoints, "
        "activation_checkpointing.partition_activations"]
    assert ZeroConfig.load({"activation_checkpointing": {}}).activation_checkpointing == "full"
    assert ZeroConfig.load({"stage": 3, "activation_checkpointing": "selective"}) == (
        ZeroConfig(stage=3, activation_checkpointing="selective"))
    for bad, message in [
            ({"activation_checkpointing": {"cpu_checkpointing": "yes"}},
             "activation_checkpointing.cpu_checkpointing='yes' must be true or false"),
            ({"zero_optimization": {"stage": 3}, "activation_checkpointing": "full"},
             "activation_checkpointing='full' must be a JSON object (zeroshard's "
             "activation_checkpointing mode goes in a zeroshard config)")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ZeroConfig.load(bad)


def test_shard_without_process_group_is_a_clear_error():
    with pytest.raises(ValueError, match="call zs.init_distributed"):
        zs.shard(MLP(), stage=2)


def test_init_distributed_without_torchrun_is_a_group_of_one():
    import subprocess
    import sys

    code = ("import zeroshard as zs, torch; print(zs.init_distributed());"
            "m = zs.shard(torch.nn.Linear(4, 2), stage=3);"
            "print(sorted(n for n, _ in m.named_parameters()))")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out.splitlines() == ["(0, 1)", "['bias', 'weight']"]
