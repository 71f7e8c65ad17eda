"""zeroshard plan — which ZeRO stage fits, and what it costs on the wire.

Memory per GPU by category (weights, gradients, optimizer state, activations) for
DDP and ZeRO-1/2/3, communication per GPU per step, and the first strategy that fits.
Figures are decimal GB (1e9 bytes) unless --gib is given.

examples:
  zeroshard plan --model llama2-7b --gpus 8
  zeroshard plan --params 6738149376 --hidden 4096 --layers 32 --gpu-mem 24
  zeroshard plan --model llama2-70b --min-gpus
  zeroshard plan --hf-config path/to/config.json --sweep 8,16,32,64 --json
  zeroshard plan --model llama2-70b --gpus 64 --html plan.html
  zeroshard plan --model llama2-13b --gpus 64 --time --global-batch 1024
  zeroshard plan --model llama2-70b --gpus 64 --network pcie4-roce --recommend
  zeroshard plan --model llama2-13b --gpus 64 --shard-group node --time
  zeroshard plan --model llama2-70b --gpus 8 --offload optimizer --time
  zeroshard plan --model llama2-70b --gpus 8 --offload optimizer --offload-dir --time
  zeroshard plan --model llama2-70b --gpus 64 --hpz 8 --quantize-weights --quantize-grads
  zeroshard plan --hf-config path/to/config.json --deepspeed ds_config_zero3.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from .._jsonfile import read_json_object
from ..plan import render
from ..plan.advice import MAX_PARAMS
from ..plan.arch import PRESETS, Architecture, ModelSpec, get_preset
from ..plan.comm import uses_zeropp
from ..plan.hfconfig import KINDS, from_hf_config
from ..plan.layout import check_layout
from ..plan.memory import STRATEGIES, Workload, stage_of
from ..spec.config import PLANNED_DISK, ZeroConfig, is_deepspeed
from ..spec.dims import ParallelDims
from ..spec.formulas import QUANT_BLOCK, SUB_GROUP_SIZE
from ..spec.optimizers import OPTIMIZERS
from ..spec.recipes import DEFAULT_RECIPE, RECIPES, get_recipe
from ..spec.rules import OFFLOADS
from . import plan_lora, plan_output, plan_time
from .plan_checks import (
    DIM_FLAGS,
    asked_checkpointing,
    check_flags,
    checkpointing_mode,
    model_rules,
    sweep_counts,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (one of --model, --hf-config, --params, or dimensions)")
    m.add_argument("--model", metavar="NAME",
                   help="a preset (see --list-models); the default is llama2-7b")
    m.add_argument("--list-models", action="store_true", help="list the presets and exit")
    m.add_argument("--hf-config", metavar="PATH",
                   help=f"a Hugging Face config.json ({', '.join(KINDS)})")
    m.add_argument("--params", type=int, metavar="N",
                   help="a bare parameter count; give --hidden and --layers to model activations")
    m.add_argument("--hidden", type=int, help="model width h")
    m.add_argument("--layers", type=int, help="transformer blocks L")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    m.add_argument("--ffn", type=int, help="MLP inner width (a llama-style gated MLP)")
    m.add_argument("--vocab", type=int, help="vocabulary size")
    m.add_argument("--tied", action="store_true", help="the output head shares the embedding")

    h = p.add_argument_group("hardware and recipe")
    h.add_argument("--gpus", type=int, default=8,
                   help="GPUs N (default 8); ZeRO shards over N / --tp of them")
    h.add_argument("--gpu-mem", type=float, default=80.0,
                   help="memory per GPU in GB (GiB with --gib); default 80")
    h.add_argument("--shard-group", metavar="K|node",
                   help="hybrid sharding: shard over groups of K data-parallel ranks and "
                        "replicate across the N / K groups; 'node': --gpus-per-node / --tp "
                        "(default: plain, over all N); bytes are split inside/across groups")
    h.add_argument("--gib", action="store_true", help="every figure in GiB instead of GB")
    h.add_argument("--deepspeed", "--config", metavar="FILE", dest="deepspeed",
                   help="a DeepSpeed config (a Trainer's --deepspeed JSON, \"auto\" values and "
                        "all) or a ZeroConfig JSON: its stage is --strategy; bf16/fp16, "
                        "offload, MiCS, hpZ and quantization set those flags")
    h.add_argument("--precision", default=DEFAULT_RECIPE, metavar="RECIPE",
                   help=f"one of {', '.join(RECIPES)}, or custom bytes W/G/O "
                        f"(default {DEFAULT_RECIPE})")
    h.add_argument("--optimizer", choices=tuple(OPTIMIZERS),
                   help="the optimizer state to plan (default: the recipe's, adamw): muon "
                        "(Muon for the 2-D parameters, AdamW for the rest: one fp32 moment "
                        "per matrix element, and the owner-computes bytes per step), "
                        "adafactor (a row and a column statistic per matrix), lamb, sgd")
    h.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"),
                   help="dtype gradients travel in (default: the recipe's gradient dtype)")
    h.add_argument("--offload", choices=OFFLOADS,
                   help="keep the master and optimizer state in host memory (stages 1-3), "
                        "'params' the weight shards too (stage 3; ZeRO-1/2 then offload the "
                        "optimizer only, DDP nothing): device and host bytes, host memory per "
                        "node, PCIe bytes per step")
    h.add_argument("--offload-dir", action="store_true",
                   help="with --offload (or --recommend, which offloads only when nothing "
                        "fits): the master and optimizer state in files (the engine's "
                        "offload_dir, DeepSpeed's nvme): device, host (the fp32 gradients and "
                        "the step's sub-group buffers) and disk bytes per GPU, disk per node, "
                        "disk bytes and seconds per step, in the peak, --time and --recommend")
    h.add_argument("--sub-group-size", type=int, metavar="G",
                   help="with --offload-dir: elements stepped at once (the engine's "
                        f"sub_group_size, default {SUB_GROUP_SIZE:.0e})")

    z = p.add_argument_group("ZeRO++ (the engine's secondary_group, quantize_weights, "
                             "quantize_grads; each strategy takes what it can)")
    z.add_argument("--hpz", type=int, metavar="K2",
                   help="hpZ (stage 3): after a unit's forward keep K/K2 of its weights' slots "
                        "so that its backward gathers over K2 ranks (a secondary group, "
                        "dividing the shard group): weights/K2 more memory until backward, "
                        "bytes at the 'secondary' level")
    z.add_argument("--quantize-weights", action="store_true",
                   help="qwZ (stage 3): the weights' all-gathers send int8 blocks with one fp32 "
                        "scale each (backward's too, unless --hpz keeps them)")
    z.add_argument("--quantize-grads", action="store_true",
                   help="qgZ (stages 1-3): the gradients' reduce-scatter sends int8 blocks; the "
                        "all-reduce across shard groups stays exact (not with --reduce-dtype)")
    z.add_argument("--quant-block", type=int, default=QUANT_BLOCK, metavar="B",
                   help=f"elements per quantization block, one fp32 scale each (default "
                        f"{QUANT_BLOCK})")

    a = p.add_argument_group("activations")
    a.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (default 2048)")
    a.add_argument("--seq-len", type=int, help="sequence length for the attention term "
                                               "(default: --tokens)")
    a.add_argument("--activation-checkpointing", metavar="MODE",
                   help="what a block keeps for backward, as zs.shard's "
                        "activation_checkpointing: none, full (its input; the default), "
                        "selective (its linear layers' outputs too), full+offload (its "
                        "input in host memory) or K (every K-th block full)")
    a.add_argument("--no-checkpointing", action="store_true",
                   help="no activation checkpointing: every block keeps its activations "
                        "(--activation-checkpointing none)")
    a.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="checkpoint every K-th block only (torchtitan's selective "
                        "checkpointing by layer; default 1: every block)")
    a.add_argument("--flash-attention", action="store_true",
                   help="a flash kernel: the s×s attention probabilities are never stored, "
                        "in the forward or in a checkpointed block's recompute")

    o = p.add_argument_group("output")
    o.add_argument("--strategy", help="show one strategy: DDP, ZeRO-1, ZeRO-2 or ZeRO-3")
    o.add_argument("--min-gpus", action="store_true",
                   help="the fewest GPUs at which each strategy fits --gpu-mem")
    o.add_argument("--gpu-step", type=int, metavar="K",
                   help="with --min-gpus: search 1 and multiples of K (8 = whole nodes) "
                        "instead of powers of two")
    o.add_argument("--sweep", metavar="N,N,...", help="the table over these GPU counts")
    o.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    o.add_argument("--html", metavar="FILE.html",
                   help="also write the planner as one self-contained page (opens from disk, "
                        "no network) that starts from these settings")
    o.add_argument("--plot", metavar="FILE.png",
                   help="stacked bars per strategy with the budget line")
    plan_time.add_arguments(p)
    plan_lora.add_arguments(p)


def resolve_model(args) -> ModelSpec:
    """The model from exactly one source; contradictory flags are an error."""
    dims = [f for f in DIM_FLAGS if getattr(args, f) is not None] + (["tied"] if args.tied else [])
    flag = lambda f: "--" + f.replace("_", "-")  # noqa: E731
    if args.model and args.hf_config:
        raise ValueError("--model and --hf-config contradict each other; give one")
    for source in ("model", "hf_config"):
        if getattr(args, source) and (dims or args.params is not None):
            other = "--params" if args.params is not None else flag(dims[0])
            raise ValueError(f"{flag(source)} and {other} contradict each other; give one")
    if args.model:
        return ModelSpec.from_arch(get_preset(args.model))
    if args.hf_config:
        return ModelSpec.from_arch(from_hf_config(args.hf_config))
    if args.params is not None:
        extra = [d for d in dims if d not in ("hidden", "layers", "heads")]
        if extra:
            raise ValueError(f"{flag(extra[0])} has no effect with --params (the count is given)")
        return ModelSpec("custom", args.params, args.hidden, args.layers,
                         args.heads)
    if dims:
        missing = [flag(f) for f in ("hidden", "layers", "heads", "ffn", "vocab")
                   if getattr(args, f) is None]
        if missing:
            raise ValueError(f"model dimensions are incomplete: missing {', '.join(missing)}")
        return ModelSpec.from_arch(Architecture(
            "custom", args.hidden, args.layers, args.heads, args.ffn, args.vocab,
            kv_heads=args.kv_heads, tied=args.tied))
    return ModelSpec.from_arch(PRESETS["llama2-7b"])


def plan_config(args) -> ZeroConfig:
    """The ``ZeroConfig`` the flags describe, at stage 3 (which takes every option; the
    table shows each stage with what it takes: ``ZeroConfig.at_stage``). The recipe
    travels whole (``--precision``, reduced in ``--reduce-dtype`` or else in the
    gradients' dtype); ``--offload-dir`` places the offload on disk without a folder
    (``PLANNED_DISK``: the planner asks where, never which folder). With ``--strategy``
    ZeRO++ is checked at that stage exactly as asked, in the engine's words."""
    recipe = get_recipe(args.precision)
    if args.optimizer:
        recipe = recipe.with_optimizer(args.optimizer)
    if args.reduce_dtype:
        recipe = recipe.with_reduce_dtype(args.reduce_dtype)
    zeropp = dict(secondary_group=args.hpz, quantize_weights=args.quantize_weights,
                  quantize_grads=args.quantize_grads)
    config = ZeroConfig(
        stage=3, mixed_precision=recipe, **zeropp, quant_block=args.quant_block,
        prefetch=1 if args.prefetch is None else args.prefetch,
        shard_group=plan_time.shard_group(args, per_tp=args.recommend),
        offload=args.offload,
        offload_dir=PLANNED_DISK if args.offload_dir and args.offload else None,
        sub_group_size=args.sub_group_size or SUB_GROUP_SIZE)
    if args.strategy:
        replace(config.at_stage(stage_of(args.strategy)), **zeropp)
    if args.recommend and uses_zeropp(config):
        raise ValueError("--recommend does not weigh hpZ or quantized collectives yet; drop "
                         "--hpz, --quantize-weights and --quantize-grads (or plan them without "
                         "--recommend, with --time)")
    return config


def deepspeed_flags(args) -> None:
    """``--deepspeed FILE``: the flags a config sets, read through zeroshard's translator
    (``ZeroConfig.load``, ``spec/deepspeed.py``), which names the keys it ignores in one
    warning. ``"auto"`` values are the Trainer's to fill (batch sizes, bucket sizes,
    precision): they are left to the flags. A flag given beside the file for the same
    setting, with another value, is an error."""
    if not args.deepspeed:
        return
    data = _without_auto(read_json_object(args.deepspeed, "--deepspeed"))
    trainer = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "train_batch_size", "gradient_clipping", "optimizer", "scheduler",
               "steps_per_print", "wall_clock_breakdown")
    zero = (ZeroConfig.from_deepspeed(data, handled=trainer) if is_deepspeed(data)
            or any(k in data for k in trainer) else ZeroConfig.load(data))
    halves = [h for h in ("bf16", "fp16") if isinstance(data.get(h), dict)
              and isinstance(data[h].get("enabled"), bool)]
    wanted = {"strategy": STRATEGIES[zero.stage], "offload": zero.offload,
              "offload_dir": zero.offload_dir is not None, "hpz": zero.secondary_group,
              "shard_group": None if zero.shard_group is None else str(zero.shard_group),
              "quantize_weights": zero.quantize_weights, "quantize_grads": zero.quantize_grads}
    if halves or "mixed_precision" in data:
        wanted["precision"] = zero.recipe.name
    for name, value in wanted.items():
        given = getattr(args, name)
        if given in (None, False, DEFAULT_RECIPE) or given == value or (
                name == "strategy" and STRATEGIES[stage_of(given)] == value):
            if value not in (None, False):
                setattr(args, name, value)
            continue
        raise ValueError(f"--{name.replace('_', '-')}={given} contradicts --deepspeed="
                         f"{args.deepspeed}, which sets {value!r}; give one")


def _without_auto(data):
    """``data`` without its ``"auto"`` values (at any depth)."""
    if isinstance(data, dict):
        return {k: _without_auto(v) for k, v in data.items() if v != "auto"}
    return data


def _check_for_table(args, config: ZeroConfig) -> None:
    """What the plan table (with ``--min-gpus``, ``--sweep``) cannot take."""
    if config.secondary_group is not None and args.min_gpus:
        raise ValueError(f"--min-gpus searches GPU counts for plain ZeRO-3; --hpz="
                         f"{args.hpz} adds weights/{args.hpz} per GPU until backward: drop one")
    tp = args.tp or 1
    if tp > 1 and args.min_gpus:
        raise ValueError(f"--min-gpus searches data-parallel GPU counts only; drop --tp={tp}")
    if config.shard_group is not None and args.min_gpus:
        raise ValueError("--min-gpus searches GPU counts for plain sharding; under "
                         f"--shard-group={args.shard_group} memory depends on the group alone")
    if args.offload and (args.min_gpus or args.sweep):
        raise ValueError(f"--offload={args.offload} plans one GPU count; drop "
                         f"{'--min-gpus' if args.min_gpus else '--sweep'}")


def _plan_table(args, model: ModelSpec, config: ZeroConfig, budget: int, unit: int,
                sweep: list[int] | None) -> None:
    """Every strategy of ``config`` on the flags' layout: the table (or JSON), and with
    ``--plot`` its bars."""
    _check_for_table(args, config)
    dims = ParallelDims(args.gpus, args.tp or 1, config.shard_group)
    check_layout(dims, config)  # hpZ's K2 must divide the shard group
    work = Workload.of_mode(args.tokens, args.seq_len, checkpointing_mode(args),
                            flash_attention=args.flash_attention)
    shown = [STRATEGIES[stage_of(args.strategy)]] if args.strategy else list(STRATEGIES)
    result = plan_output.compute(args, model, dims, config, work, budget, sweep)
    if args.json:
        plan_output.json_out(args, model, dims, config, work, budget, shown, result)
    else:
        plan_output.text_out(args, model, dims, config, work, budget, shown, unit, result)
    if args.plot:
        render.plot(args.plot, model, config.recipe, args.gpus, budget, result.plans, shown,
                    unit, args.gib)


def run(args) -> int:
    """Flags → ``ZeroConfig``, ``ParallelDims`` and ``Workload`` → the planner → tables
    or JSON."""
    if args.list_models:
        render.models(PRESETS)
        return 0
    deepspeed_flags(args)
    check_flags(args)
    sweep = sweep_counts(args.sweep)
    model = resolve_model(args)
    model_rules(args, model)  # the trainer's rules for this model, before any planning
    model, config = plan_lora.apply(args, model), plan_config(args)
    if model.params > MAX_PARAMS:  # a model given by its dimensions or a config.json
        raise ValueError(f"the model has {model.params:,} parameters, more than the planner "
                         f"plans: at most {MAX_PARAMS:,}")
    unit = 2**30 if args.gib else 10**9
    budget = int(args.gpu_mem * unit)
    if args.html:
        plan_output.write_html(args, model, config)
    if args.recommend:
        plan_output.recommendation(args, model, config, budget, unit,
                                   plan_time.run_recommend(args, model, config, budget,
                                                           asked_checkpointing(args)))
    else:
        _plan_table(args, model, config, budget, unit, sweep)
    return 0
