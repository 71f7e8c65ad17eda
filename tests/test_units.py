"""Pure unit tests of the engine's pieces: no process group."""

import re

import pytest
import torch
import torch.nn as nn

import zeroshard as zs
from zeroshard.runtime.config import ZeroConfig
from zeroshard.runtime.layout import ShardLayout
from zeroshard.runtime.units import select_units

from .engine_cases import MLP, Block


def test_layout_shapes_padding_and_roundtrip():
    shapes = [(7, 3), (5,), ()]
    layout = ShardLayout(shapes, world=3)
    # 7 rows over 3 ranks: chunks of 3 rows -> rank 2 owns 1 real row + 2 padding rows
    assert [s.chunk_rows for s in layout.slots] == [3, 2, 1]
    assert layout.slot_numel == 9 + 2 + 1
    assert [layout.slots[0].shard_shape(r) for r in range(3)] == [(3, 3), (3, 3), (1, 3)]
    assert [layout.slots[2].shard_shape(r) for r in range(3)] == [(1,), (0,), (0,)]
    assert sum(layout.real_numel(r) for r in range(3)) == layout.numel == 21 + 5 + 1
    full = [torch.randn(7, 3), torch.randn(5), torch.randn(())]
    packed = torch.empty(3 * layout.slot_numel, dtype=torch.float64)
    layout.pack([t.reshape(s.rows, s.row_numel) for t, s in zip(full, layout.slots)], packed)
    back = layout.unpack(packed.view(3, -1))
    assert all(torch.equal(a.double(), b) for a, b in zip(full, back))
    views = layout.shard_views(packed.view(3, -1)[2].clone(), rank=2)
    assert torch.equal(views[0], full[0][6:7].double())


def test_unit_policies():
    m = MLP()
    assert select_units(m, "blocks") == list(m.blocks)
    assert select_units(m, None) == []
    assert select_units(m, Block) == list(m.blocks)
    assert select_units(m, [m.blocks[0]]) == [m.blocks[0]]
    assert select_units(m, 170) == list(m.blocks)  # block 180 params; its Linear 156
    with pytest.raises(ValueError, match="units='layers' is not a unit policy"):
        select_units(m, "layers")
    with pytest.raises(ValueError, match="the model itself is always the root unit"):
        select_units(m, [m])
    with pytest.raises(ValueError, match="units=0 must be a positive parameter count"):
        select_units(m, 0)
    with pytest.raises(ValueError, match="Linear module is not part of the model"):
        select_units(m, [nn.Linear(2, 2)])


def test_config_validation():
    assert ZeroConfig().recipe.name == "fp32-adamw"
    bf16 = ZeroConfig(mixed_precision="bf16").recipe
    assert (bf16.weight_bytes, bf16.grad_bytes, bf16.optimizer_bytes, bf16.reduce_dtype) == (
        2, 2, 12, "fp32")
    with pytest.raises(ValueError, match="stage=5 is not a ZeRO stage; expected 0, 1, 2 or 3"):
        ZeroConfig(stage=5)
    with pytest.raises(ValueError, match="mixed_precision='fp8' is not supported"):
        ZeroConfig(mixed_precision="fp8")
    with pytest.raises(NotImplementedError, match="dynamic loss scaling"):
        ZeroConfig(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"unknown ZeroConfig keys \['stages'\]"):
        ZeroConfig.from_dict({"stages": 2})


def test_deepspeed_config_names_ignored_keys():
    with pytest.warns(UserWarning, match="ignored by zeroshard: optimizer, "
                                         "zero_optimization.overlap_comm"):
        c = ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "overlap_comm": True},
                                  "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}})
    assert (c.stage, c.mixed_precision) == (2, "bf16")


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


def test_shard_without_process_group_is_a_clear_error():
    with pytest.raises(ValueError, match="call zs.init_distributed"):
        zs.shard(MLP(), stage=2)


def test_planner_and_engine_share_the_recipe():
    from zeroshard.plan import RECIPES

    assert ZeroConfig(mixed_precision="bf16").recipe == RECIPES["bf16-mixed-adamw"] \
        .with_reduce_dtype("fp32")


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


def test_planner_counts_a_module_with_tied_weights_once():
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import ModelSpec

    spec = ModelSpec.from_module(GPT(get_preset("small")))
    assert spec.params == 842_496  # the head shares the embedding: counted once
