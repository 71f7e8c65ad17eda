"""Cases run on real gloo ranks: zeroshard.hf.Trainer (and TRL's SFTTrainer through
``sharded``) against the same Trainer's own DDP run of the plain model, with the same
arguments and seeds. Each case returns numbers; a case that raises returns its traceback
under "error", so one failure does not hide the next."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from . import models as m


def _run(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = fn(*args)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        results[name] = {"error": traceback.format_exc()[-4000:]}


def _ddp(folder: str, make, train_dataset=None, **kw):
    """The reference: transformers' own Trainer, DDP over the plain model."""
    from transformers import Trainer

    m.join_world()
    t = Trainer(model=make(), args=m.args(folder, **kw), train_dataset=train_dataset or m.data())
    t.train()
    return t


def _zs(folder: str, make, zero, train_dataset=None, **kw):
    from zeroshard.hf import Trainer

    m.join_world()
    t = Trainer(model=make(), args=m.args(folder, **kw), train_dataset=train_dataset or m.data(),
                zero=zero)
    t.train()
    return t


def _against(ref, t) -> dict:
    """Weights and logged norms of a zeroshard run against its DDP reference."""
    full = t.zs_model.full_state_dict()
    return {"weights": m.weights_diff(full, ref.model.state_dict()),
            "norms": m.norms(t), "ref_norms": m.norms(ref), "losses": m.losses(t),
            "ref_losses": m.losses(ref)}


def stages(folder: str, model: str, grid: tuple[int, ...]) -> dict:
    """Every stage in ``grid`` on ``model`` against DDP."""
    make = m.MODELS[model]
    ref = _ddp(folder, make)
    return {stage: _against(ref, _zs(folder, make, {"stage": stage})) for stage in grid}


def accumulation(folder: str) -> dict:
    """Collectives of 4 steps with 2 micro-batches each against 4 steps of one: the
    gradients are reduced once per optimizer step (no reduction per micro-batch)."""
    out = {}
    for stage in (0, 3):
        for ga in (1, 2):
            t = _zs(folder, m.llama, {"stage": stage}, gradient_accumulation_steps=ga)
            calls = t.zs_model.comm_stats()
            out[f"{stage}/{ga}"] = {k: calls.get(k, {}).get("calls", 0)
                                    for k in ("all_reduce", "reduce_scatter")}
    return out


def resume(folder: str) -> dict:
    """6 steps uninterrupted, saving at step 3; then resumed from checkpoint-3 at the same
    stage and at another, from a model of other weights."""
    from zeroshard.hf import Trainer

    run = os.path.join(folder, "resume")
    full = _zs(run, m.llama, {"stage": 3}, max_steps=6, save_strategy="steps", save_steps=3)
    end = full.zs_model.full_state_dict()
    ckpt = os.path.join(run, "checkpoint-3")
    out = {"files": sorted(os.listdir(ckpt)), "norms": m.norms(full)}
    for stage in (3, 1):
        m.join_world()
        t = Trainer(model=m.llama(seed=5), args=m.args(run, max_steps=6, save_strategy="no"),
                    train_dataset=m.data(), zero={"stage": stage})
        t.train(resume_from_checkpoint=ckpt)
        out[stage] = {"weights": m.weights_diff(t.zs_model.full_state_dict(), end),
                      "norms": m.norms(t)}
    return out


def outputs(folder: str) -> dict:
    """save_model read back by from_pretrained, evaluate and predict: against the DDP
    reference's model, evaluate and predict."""
    from transformers import LlamaForCausalLM

    ref = _ddp(folder, m.llama)
    t = _zs(folder, m.llama, {"stage": 3})
    saved = os.path.join(folder, "saved")
    t.save_model(saved)
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(saved)
    ids = m.probe_ids()
    with torch.no_grad():
        logits = (loaded(ids).logits - ref.model(ids).logits).abs().max().item()
    evals = m.data(8, seed=4)
    mine, theirs = t.evaluate(evals), ref.evaluate(evals)
    p_mine, p_theirs = t.predict(evals), ref.predict(evals)
    return {"files": sorted(os.listdir(saved)), "logits": logits,
            "eval": (mine["eval_loss"], theirs["eval_loss"]),
            "predict": float(abs(p_mine.predictions - p_theirs.predictions).max()),
            "predict_shape": tuple(p_mine.predictions.shape)}


def best_model(folder: str) -> dict:
    """``load_best_model_at_end``: evaluated and saved every 2 steps of 6, the run ends
    with the best checkpoint's weights read back into the shards; against DDP's."""
    kw = dict(max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
              save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
              learning_rate=5e-2)
    from transformers import Trainer

    from zeroshard.hf import Trainer as ZeroTrainer

    evals = m.data(8, seed=4)
    out = {}
    for name, cls, zero in (("ddp", Trainer, None), ("zs", ZeroTrainer, {"stage": 3})):
        m.join_world()
        extra = {} if zero is None else {"zero": zero}
        t = cls(model=m.llama(), args=m.args(os.path.join(folder, f"best-{name}"), **kw),
                train_dataset=m.data(), eval_dataset=evals, **extra)
        t.train()
        weights = (t.zs_model.full_state_dict() if zero else
                   {k: v.detach().clone() for k, v in t.model.state_dict().items()})
        out[name] = {"best": os.path.basename(t.state.best_model_checkpoint),
                     "evals": [x["eval_loss"] for x in t.state.log_history
                               if "eval_loss" in x], "weights": weights}
    out["weights"] = m.weights_diff(out["zs"].pop("weights"), out["ddp"].pop("weights"))
    return out


#: A DeepSpeed config as Hugging Face's examples write them: "auto" wherever the Trainer
#: fills a value, and keys zeroshard does not act on.
DS_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True},
    "steps_per_print": 2000, "wall_clock_breakdown": False}


def deepspeed(folder: str) -> dict:
    """A DeepSpeed JSON with "auto" values: without optimizer and scheduler sections (the
    Trainer's are used) against DDP; with them (AdamW, WarmupDecayLR, all "auto") against
    DDP given the optimizer and scheduler DeepSpeed builds."""
    import warnings

    from zeroshard.hf.schedules import DeepSpeedWarmup

    path = os.path.join(folder, "ds.json")
    with_sections = dict(DS_AUTO, optimizer={"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}})
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(DS_AUTO))
        Path(path + ".full").write_text(json.dumps(with_sections))
    dist.barrier()
    ref = _ddp(folder, m.llama)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = _zs(folder, m.llama, path)
    out = {"plain": _against(ref, t),
           "config": [t.zero_config.stage, t.zero_config.reduce_bucket_size,
                      t.zero_config.prefetch_bucket_size,
                      t.zero_config.param_persistence_threshold],
           "warnings": [str(w.message) for w in caught if "DeepSpeed" in str(w.message)]}
    # DeepSpeed's optimizer: AdamW over every parameter in one group; its WarmupDecayLR
    from transformers import Trainer

    m.join_world()
    model = m.llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = DeepSpeedWarmup(opt, 0.0, 1e-2, warmup_num_steps=2, total_num_steps=4)
    ref = Trainer(model=model, args=m.args(folder), train_dataset=m.data(),
                  optimizers=(opt, sched))
    ref.train()
    t = _zs(folder, m.llama, path + ".full")
    out["sections"] = _against(ref, t)
    out["lrs"] = ([x["learning_rate"] for x in t.state.log_history if "learning_rate" in x],
                  [x["learning_rate"] for x in ref.state.log_history if "learning_rate" in x])
    return out


def peft_checkpointing(folder: str, grid: tuple[int, ...]) -> dict:
    """LoRA with gradient checkpointing against the same peft model under DDP; the
    adapter save_model writes, read by peft on a fresh base, gives DDP's logits."""
    import peft

    ref = _ddp(folder, m.lora, gradient_checkpointing=True)
    out = {}
    for stage in grid:
        t = _zs(folder, m.lora, {"stage": stage}, gradient_checkpointing=True)
        out[stage] = _against(ref, t)
        saved = os.path.join(folder, f"adapter{stage}")
        t.save_model(saved)
        dist.barrier()
        back = peft.PeftModel.from_pretrained(m.llama(), saved)
        ids = m.probe_ids()
        with torch.no_grad():
            out[stage]["logits"] = (back(ids).logits - ref.model(ids).logits).abs().max().item()
        out[stage]["files"] = sorted(os.listdir(saved))
    return out


def sft(folder: str, grid: tuple[int, ...]) -> dict:
    """TRL's SFTTrainer, sharded by ``zeroshard.hf.sharded``, against its own DDP run."""
    from trl import SFTTrainer

    from zeroshard.hf import sharded

    def make(cls, **kw):
        m.join_world()
        t = cls(model=m.llama(), args=m.sft_args(folder), train_dataset=m.sft_data(),
                processing_class=m.tokenizer(), **kw)
        t.train()
        return t

    ref = make(SFTTrainer)
    return {stage: _against(ref, make(sharded(SFTTrainer), zero={"stage": stage}))
            for stage in grid}


def grpo(folder: str, grid: tuple[int, ...]) -> dict:
    """TRL's GRPOTrainer, sharded by ``zeroshard.hf.sharded``, against its own DDP run: it
    generates through the sharded model's ``generate`` (TRL's unwrap hands it back
    whole), its completions end at different lengths, and training after generation
    matches."""
    from trl import GRPOTrainer

    from zeroshard.hf import sharded

    def make(cls, **kw):
        m.join_world()
        t = cls(model=m.llama(), reward_funcs=m.even_words, args=m.grpo_args(folder),
                train_dataset=m.grpo_prompts(), processing_class=m.tokenizer(), **kw)
        t.train()
        return t

    ref = make(GRPOTrainer)
    out = {stage: _against(ref, make(sharded(GRPOTrainer), zero={"stage": stage}))
           for stage in grid}
    lengths = [h["completions/min_length"] != h["completions/max_length"]
               for h in ref.state.log_history if "completions/min_length" in h]
    return {**out, "uneven": any(lengths)}


def bf16(folder: str) -> dict:
    """bf16=True: the engine's bf16 recipe (bf16 weights, fp32 master) against DDP under
    accelerate's bf16 autocast: other roundings, so losses close, not equal."""
    ref = _ddp(folder, m.llama, bf16=True)
    t = _zs(folder, m.llama, {"stage": 3}, bf16=True)
    params = {str(p.dtype) for p in t.model.parameters()}
    return {"losses": m.losses(t), "ref_losses": m.losses(ref), "dtypes": sorted(params),
            "recipe": t.zero_config.recipe.name}


def refused_optimizer(folder: str) -> dict:
    """optim="adafactor" (transformers' own Adafactor) at stage 3 on 2 ranks: refused when
    the optimizer is built, by name."""
    from zeroshard.hf import Trainer

    m.join_world()
    t = Trainer(model=m.llama(), args=m.args(folder, optim="adafactor"),
                train_dataset=m.data(), zero={"stage": 3})
    try:
        t.train()
    except ValueError as exc:
        return {"line": str(exc)}
    return {"line": None}


def stock_trainer(folder: str, stage: int) -> dict:
    """transformers' own Trainer handed a sharded model: one error naming zeroshard before
    any step (the DDP it would put around the model), whichever way its data comes; the
    weights stay as they were."""
    from transformers import Trainer

    import zeroshard as zs

    out = {}
    examples = [{"input_ids": r, "labels": r} for r in m.data()["input_ids"]]
    for name, dataset, kw in (("columns kept", m.data(), {"remove_unused_columns": False}),
                              ("examples", examples, {}),
                              ("datasets default", m.data(), {})):
        m.join_world()
        model = zs.shard(m.llama(), stage=stage)
        before = model.full_state_dict()
        try:
            Trainer(model=model, args=m.args(folder, **kw), train_dataset=dataset).train()
            out[name] = {"line": None}
        except Exception as exc:  # noqa: BLE001 - the type is part of the answer
            out[name] = {"line": f"{type(exc).__name__}: {exc}"}
        out[name]["moved"] = m.weights_diff(model.full_state_dict(), before)
    return out


def main_grid(folder: str) -> dict:
    """The main tier's cases, on 2 ranks, in one process group."""
    results: dict = {}
    _run(results, "llama", stages, folder, "llama", (0, 3))  # 1-2: the wide grid
    _run(results, "gpt2", stages, folder, "gpt2", (3,))
    _run(results, "accumulation", accumulation, folder)
    _run(results, "resume", resume, folder)
    _run(results, "outputs", outputs, folder)
    _run(results, "best", best_model, folder)
    _run(results, "deepspeed", deepspeed, folder)
    _run(results, "peft", peft_checkpointing, folder, (3,))  # 0-2: the wide grid
    _run(results, "sft", sft, folder, (3,))
    _run(results, "grpo", grpo, folder, (3,))
    _run(results, "bf16", bf16, folder)
    _run(results, "refused", refused_optimizer, folder)
    for stage in (0, 3):
        _run(results, f"stock{stage}", stock_trainer, folder, stage)
    return results


def wide_grid(folder: str) -> dict:
    """The slow tier's: both models at every stage, peft and SFT at every stage (run at
    N = 2 and N = 4)."""
    results: dict = {}
    for model in ("llama", "gpt2"):
        _run(results, model, stages, folder, model, (0, 1, 2, 3))
    _run(results, "peft", peft_checkpointing, folder, (0, 1, 2))
    _run(results, "sft", sft, folder, (0, 1, 2, 3))
    _run(results, "grpo", grpo, folder, (0, 1, 2))
    return results


def save_for_another_world(folder: str) -> dict:
    """At N = 4 (1 sequence per rank and micro-batch): 6 steps saving at step 3."""
    run = os.path.join(folder, "worlds")
    t = _zs(run, m.llama, {"stage": 3}, per_device_train_batch_size=1, max_steps=6,
            save_strategy="steps", save_steps=3)
    return {"end": {k: v.clone() for k, v in t.zs_model.full_state_dict().items()}}


def resume_in_another_world(folder: str, stage: int) -> dict:
    """At N = 2 (2 sequences per rank and micro-batch: the same 4 sequences per
    micro-batch as at N = 4), resumed from the N = 4 run's checkpoint-3."""
    from zeroshard.hf import Trainer

    run = os.path.join(folder, "worlds")
    m.join_world()
    t = Trainer(model=m.llama(seed=5), args=m.args(run, max_steps=6), train_dataset=m.data(),
                zero={"stage": stage})
    t.train(resume_from_checkpoint=os.path.join(run, "checkpoint-3"))
    return {"end": {k: v.clone() for k, v in t.zs_model.full_state_dict().items()}}
