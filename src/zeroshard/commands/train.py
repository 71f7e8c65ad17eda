"""zeroshard train — a model trained sharded over N processes: the built-in GPT on the
built-in corpus, or a local Hugging Face causal LM (--hf-model DIR) on your text
(--data PATH), tokenized once before the ranks start:

  zeroshard train --hf-model ./my-llama --data ./notes/ --stage 3 --nproc 2 \\
                  --save-dir runs/ckpt --tensorboard runs/tb
  zeroshard export runs/ckpt ./my-llama-tuned     # a folder from_pretrained loads

Launches --nproc local processes through PyTorch's own launcher (torch.distributed.run,
with its rendezvous store on the loopback interface only: ``train/launch.py``).
Under torchrun the same command runs as one rank of a larger job, e.g. on two 8-GPU
nodes:

  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
           --rdzv-endpoint HOST:29500 -m zeroshard train --stage 3 --mixed-precision bf16

Flags override --config, which overrides the defaults. --config takes a JSON file of
this command's settings, named as the flags with underscores (the engine's at top level
or under "zero", as in {"steps": 200, "zero": {"stage": 2, "mixed_precision": "bf16"}}),
or a DeepSpeed config, whose zero_optimization.stage, bf16.enabled,
zero_optimization.reduce_bucket_size, .stage3_prefetch_bucket_size,
.stage3_param_persistence_threshold (read by the engine's translator, as zs.shard reads
them), gradient_clipping, gradient_accumulation_steps, train_micro_batch_size_per_gpu
and train_batch_size are honoured; other keys are named in one warning. One file may
hold both kinds of key; a setting given both ways, or a key given twice, is refused.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from .._errorline import DEBUG
from ..spec.config import ZeroConfig
from ..spec.optimizers import OPTIMIZERS
from ..train import early, flags, job, launchenv
from ..train.settings import TrainConfig, engine_keys, resolve
from . import train_adapters

#: How each engine field (ZeroConfig's) shows as a flag named after it (mixed_precision:
#: --mixed-precision). A field left out still gets a flag, typed after its default.
_ENGINE_FLAGS = {
    "stage": dict(metavar="{0,1,2,3}", help="ZeRO stage: 0 DDP; 1 shards optimizer state; "
                  "2 and gradients; 3 and parameters"),
    "mixed_precision": dict(metavar="{fp32,bf16,RECIPE}", shown="fp32", help="fp32, bf16 "
                            "(bf16 compute and gradients, fp32 master and optimizer state) "
                            "or a recipe name"),
    "reduce_dtype": dict(metavar="{fp32,bf16}", shown="fp32 under bf16, else the gradients'",
                         help="dtype gradients are summed in across ranks"),
    "units": dict(metavar="{blocks,model,N}", help="unit policy: one unit per transformer "
                  "block, the whole model as one unit, or units of at least N parameters"),
    "param_persistence_threshold": dict(metavar="N", shown="0: none", help="stage 3: "
                                        "parameters of fewer than N elements stay whole on "
                                        "every rank"),
    "prefetch": dict(metavar="K", help="stage 3: units all-gathered ahead of use"),
    "prefetch_bucket_size": dict(metavar="N", shown="0: no limit", help="stage 3: elements "
                                 "prefetched at once (the next unit always is)"),
    "reduce_bucket_size": dict(metavar="N", type=int, shown="stage 0: DDP's 25 MiB; 1-3: 0, "
                               "one per unit", help="coalesce "
                               "consecutive units' gradient reductions up to N elements"),
    "sync_module_states": dict(shown="on", help="broadcast rank 0's weights and buffers at "
                               "shard time"),
    "broadcast_buffers": dict(shown="on", help="broadcast rank 0's buffers before every "
                              "forward (torch DDP's default)"),
    "check_collectives": dict(shown="on", help="ranks exchange a fingerprint of each "
                              "collective and stop at once, naming each rank's position, "
                              "when they are out of step"),
    "offload_dir": dict(metavar="DIR", shown="none", help="with --offload: the master and "
                        "optimizer state in scratch files under DIR, streamed through host "
                        "memory at the step (disk offload)"),
    "sub_group_size": dict(metavar="N", help="disk offload: elements stepped at once (the host "
                           "holds two sub-groups)"),
    "generate_gather": dict(metavar="{auto,whole,unit}", help="stage 3: the end-of-run "
                            "sample's weights gathered once for it, or unit by unit at "
                            "every token; auto: once where they fit"),
    "activation_checkpointing": dict(
        metavar="{none,full,selective,full+offload,K}", help="recompute activations in "
        "backward instead of keeping them, each transformer block at its unit's boundary: "
        "full keeps the block inputs; selective the linear layers' outputs too; K every "
        "K-th block full; full+offload the inputs in host memory"),
    "nonfinite": dict(metavar="{raise,skip,ignore}", shown="skip, stopping after "
                      "--max-skipped consecutive skips", help="a step whose reduced gradients "
                      "hold a NaN or inf, on every rank alike"),
}


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ZeroConfig field the trainer takes, its dest the field's name."""
    g = p.add_argument_group("engine (ZeroConfig: zs.shard's settings, one flag per field)")
    defaults = {f.name: f.default for f in fields(ZeroConfig)}
    for name in engine_keys():
        spec = dict(_ENGINE_FLAGS.get(name, {}))
        default = defaults[name]
        kwargs = {"dest": name, "metavar": spec.pop("metavar", None)}
        if isinstance(default, bool):
            kwargs = {"dest": name, "action": argparse.BooleanOptionalAction}
        elif isinstance(default, (int, float)):
            kwargs["type"] = type(default)
        if "type" in spec:  # a number whose default (None) the stage fills in
            kwargs["type"] = spec.pop("type")
        shown = spec.pop("shown", default)
        help_text = spec.pop("help", f"ZeroConfig.{name}")
        flag = "--" + name.replace("_", "-")
        g.add_argument(flag, help=f"{help_text} (default {shown})", **kwargs)
        if name == "mixed_precision":  # the trainer's earlier name for it
            g.add_argument("--precision", dest=name, metavar=kwargs["metavar"],
                           help="alias of --mixed-precision")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--nproc", type=int, help=f"local processes (default {d.nproc})")
    p.add_argument("--model", help="GPT preset: tiny, small (0.84M, default) or medium (10.8M)")
    p.add_argument("--hf-model", metavar="DIR",
                   help="fine-tune this local Hugging Face causal LM (config.json, "
                        "safetensors weights, a tokenizer) instead of the built-in GPT")
    p.add_argument("--data", metavar="PATH",
                   help="training text for --hf-model: text files or a folder of them, JSON "
                        "lines, or token files (default: the built-in corpus)")
    p.add_argument("--data-field", metavar="NAME",
                   help=f"the text field of each JSON line (default {d.data_field})")
    p.add_argument("--val-fraction", type=float, metavar="F",
                   help=f"share of --data held out for validation (default {d.val_fraction})")
    p.add_argument("--seq-len", type=int, metavar="L",
                   help="tokens per sequence (default: the built-in GPT's block size; for "
                        "--hf-model the smaller of its longest sequence and 1024)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard scalars here: losses, learning rate, tokens/s, "
                        "gradient norm, memory by category, skipped steps")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--batch", type=int, help=f"global batch in sequences (default {d.batch})")
    p.add_argument("--micro-batch", type=int,
                   help="sequences per process per forward; accumulation follows "
                        "(default: batch / N)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    add_optimizer_arguments(p)
    p.add_argument("--warmup", type=int, help="warm-up steps (default 10%% of --steps)")
    p.add_argument("--clip", type=float, help=f"gradient-norm clip, 0 for none (default {d.clip})")
    p.add_argument("--seed", type=int, help=f"seed (default {d.seed})")
    p.add_argument("--eval-every", type=int, help=f"steps between evaluations "
                                                  f"(default {d.eval_every})")
    p.add_argument("--sample-chars", type=int, help=f"text to sample at the end: bytes, or "
                                                    f"for --hf-model about as many characters "
                                                    f"(default {d.sample_chars})")
    p.add_argument("--json-log", metavar="FILE", help="one JSON object per step")
    p.add_argument("--save-dir", metavar="DIR", help="write sharded checkpoints here")
    p.add_argument("--save-every", type=int, help="checkpoint every this many steps "
                                                  "(default: only at the end)")
    p.add_argument("--resume", metavar="CKPT", help="a checkpoint path, 'latest' in "
                                                    "--save-dir, or 'auto': latest when "
                                                    "there is one, else a first start; any "
                                                    "--nproc and --stage")
    p.add_argument("--init-from", metavar="PATH", help="initial weights from consolidated "
                                                       "safetensors, or a checkpoint's "
                                                       "weights alone (with --lora: the "
                                                       "base model's)")
    p.add_argument("--max-restarts", type=int, metavar="K", default=0,
                   help="start every process again, up to K times (at most 1,000), after one "
                        "dies or a collective times out (bad input ends the run at once); "
                        "with --resume auto each restart resumes the last checkpoint "
                        "(default 0; under torchrun, torchrun's own flag)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help=f"how long a rank waits for the others in any collective before it "
                        f"fails (default {d.timeout:g})")
    p.add_argument("--profile", metavar="DIR", help="profile two steps (turns on the engine's "
                                                    "profiler): trace, lifetime chart, peak "
                                                    "and plan against measurement")
    p.add_argument("--max-skipped", type=int, metavar="K",
                   help=f"stop after K steps in a row skipped for non-finite gradients "
                        f"(default {d.max_skipped})")
    p.add_argument("--keep-last", type=int, metavar="K",
                   help="keep only the K checkpoints saved last in --save-dir (default: all)")
    # tensor parallelism
    p.add_argument("--tp", type=int, metavar="K",
                   help="tensor-parallel degree: each layer split over K consecutive "
                        "processes with torch's own styles (the built-in GPT's plan, or the "
                        "one transformers ships for --hf-model), ZeRO over the N / K "
                        f"data-parallel ones (default {d.tp})")
    p.add_argument("--config", metavar="FILE", help="JSON settings or a DeepSpeed config")
    p.add_argument("--debug", action="store_true",
                   help=f"a failing rank's full traceback and the launcher's report, not "
                        f"just the error's one line (or {DEBUG}=1)")
    _add_engine_flags(p)
    train_adapters.add_arguments(p)


def _betas(text: str) -> list[float]:
    """``--betas 0.9,0.95``."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two numbers as B1,B2 (e.g. "
                                         "0.9,0.95)") from None


def add_optimizer_arguments(p: argparse.ArgumentParser) -> None:
    """--optimizer and its hyperparameters (``train/optimizer.py``), shared with verify."""
    d = TrainConfig()
    p.add_argument("--optimizer", choices=list(OPTIMIZERS),
                   help="adamw, sgd (momentum), lamb, adafactor, or muon (Muon for the hidden "
                        "matrices, AdamW for embeddings, head, norms and biases): the "
                        f"planner's names (default {d.optimizer})")
    p.add_argument("--weight-decay", type=float, metavar="W",
                   help=f"weight decay of the matrices (default {d.weight_decay})")
    p.add_argument("--betas", type=_betas, metavar="B1,B2",
                   help="adamw's, lamb's (muon's AdamW's) betas (default 0.9,0.999)")
    p.add_argument("--eps", type=float, help="adamw's, lamb's and muon's epsilon "
                                             "(default: theirs)")
    p.add_argument("--momentum", type=float, metavar="M",
                   help="sgd's momentum (default 0.9) or muon's (default 0.95)")


def config_of(args) -> TrainConfig:
    """The run's settings: the defaults, then --config, then the flags given."""
    flags = {k: getattr(args, k) for k in vars(args) if not k.startswith("_")}
    cfg = resolve({**flags, "clip": flags["clip"] or None}, args.config)
    return replace(cfg, clip=None) if flags["clip"] == 0 else cfg


def run(args) -> int:
    with flags.named(args):  # bad input names the flag typed (or the --config key)
        cfg = job.handed_over()
        if cfg is None:  # the command itself, or a rank of torchrun
            launchenv.check(early.on_a_rank())  # RANK, WORLD_SIZE... left from another launch
            cfg = config_of(args)  # flags checked before anything launches
        if early.on_a_rank():  # a rank: of this command's launcher, or of torchrun
            return job.run_rank(cfg)
        return job.launch(cfg, debug=args.debug, max_restarts=args.max_restarts)
