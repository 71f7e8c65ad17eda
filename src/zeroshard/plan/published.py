"""Published training runs that calibrate the step-time model (docs/steptime.md).

Each :class:`Run` is one row of a table somebody else measured: a model trained with
FSDP (ZeRO-3) on a number of GPUs, its micro-batch, sequence length and checkpointing,
and the tokens per second per GPU it reached. :func:`replay` predicts each row with
:func:`~zeroshard.plan.steptime.step_time` on the run's accelerator preset and returns
the signed error, so the efficiencies in ``hardware.ACCELERATORS`` can be held against
the table (``tests/plan/test_published.py``).

Sources (every figure below is copied from them):

- **torchtitan, A100**: pytorch/torchtitan ``docs/performance.md`` (2024): FSDP2 on 64
  A100 80 GB, Llama 3 at 8,192 tokens, Llama 2 at 4,096; WPS per GPU.
- **torchtitan, H100**: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``
  (Dec 2024): Llama 3.1 8B, FSDP, local batch 2 of 8,192 tokens, selective checkpointing,
  without torch.compile, on 8 and 128 H100s of Meta's Grand Teton (HBM2e, 500 W cap).
- **IBM/PyTorch FSDP**: foundation-model-stack/fms-fsdp ``README.md`` and the PyTorch blog
  "Maximizing training throughput using PyTorch FSDP" (IBM and Meta, 2024): Llama 2 on
  128 A100s at 4,096 tokens.
- **LLM Foundry MPT**: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``,
  "H100 80GB BF16": MPT with FSDP FULL_SHARD, amp_bf16, flash attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.recipes import get_recipe
from .arch import PRESETS, ModelSpec
from .hardware import ACCELERATORS, Cluster, get_network
from .memory import Workload
from .steptime import Schedule, step_time

#: What every run is replayed as: ZeRO-3, bf16 mixed AdamW reduced in bf16, prefetch 1.
ZERO3_BF16 = ZeroConfig(stage=3, mixed_precision=get_recipe("bf16-mixed-adamw"))


@dataclass(frozen=True)
class Run:
    """One published measurement."""

    source: str
    """Who measured it (the module docstring names the document)."""
    model: str
    """A preset name, or an MPT size (``mpt-7b``) built from its YAML's dimensions."""
    params: int | None
    """The parameter count the source reports (None: the preset's own)."""
    accelerator: str
    """``a100`` or ``h100`` (a preset of ``hardware.ACCELERATORS``)."""
    gpus: int
    """GPUs in the run, all data-parallel (FSDP)."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per GPU per forward."""
    checkpoint_every: int
    """Activation checkpointing: every k-th block recomputed (1: full; torchtitan's
    selective layer and op checkpointing recompute about half: 2); 0: none."""
    tokens_per_gpu: float
    """What the source measured: tokens per second per GPU."""
    note: str = ""
    """What else the row needs to be read right."""
    shard_group: int | None = None
    """HSDP: sharded inside groups of this many GPUs (a node), replicated across."""


#: MPT sizes (llm-foundry ``scripts/train/yamls/pretrain/mpt-*.yaml``): d_model, n_layers,
#: n_heads; the MLP is 4·d_model wide, GELU, no gating.
MPT = {"mpt-1b": (2048, 24, 16), "mpt-3b": (2560, 32, 20), "mpt-7b": (4096, 32, 32),
       "mpt-13b": (5120, 40, 40), "mpt-30b": (7168, 48, 64), "mpt-70b": (8192, 80, 64)}

TT, TTH, IBM, MOS = ("torchtitan A100", "torchtitan H100", "IBM/PyTorch FSDP",
                     "LLM Foundry MPT")
RUNS: tuple[Run, ...] = (
    Run(TT, "llama3-8b", None, "a100", 64, 8192, 1, 2, 2904, "selective (layer)"),
    Run(TT, "llama3-70b", None, "a100", 64, 8192, 1, 1, 331, "full"),
    Run(TT, "llama2-13b", None, "a100", 64, 4096, 2, 0, 2162),
    Run(TT, "llama2-13b", None, "a100", 64, 4096, 2, 2, 1914, "selective (layer)"),
    Run(TT, "llama2-70b", None, "a100", 64, 4096, 2, 1, 353, "full"),
    Run(TTH, "llama3-8b", None, "h100", 8, 8192, 2, 2, 5762,
        "selective; 500 W HBM2e H100s, below the SXM peak"),
    Run(TTH, "llama3-8b", None, "h100", 128, 8192, 2, 2, 5605,
        "selective; 500 W HBM2e H100s, below the SXM peak"),
    Run(IBM, "llama2-7b", None, "a100", 128, 4096, 2, 0, 3760, "HSDP", 8),
    Run(IBM, "llama2-13b", None, "a100", 128, 4096, 1, 0, 1700, "HSDP", 8),
    Run(IBM, "llama2-70b", None, "a100", 128, 4096, 6, 1, 380),
    Run(MOS, "mpt-1b", 1_315_950_592, "h100", 64, 2048, 20, 0, 44402),
    Run(MOS, "mpt-3b", 2_651_837_440, "h100", 16, 2048, 10, 0, 24142),
    Run(MOS, "mpt-7b", 6_658_859_008, "h100", 8, 2048, 6, 0, 10643),
    Run(MOS, "mpt-7b", 6_667_247_616, "h100", 8, 4096, 16, 1, 8611),
    Run(MOS, "mpt-13b", 12_853_954_560, "h100", 8, 2048, 2, 0, 4792),
    Run(MOS, "mpt-13b", 12_864_440_320, "h100", 8, 4096, 10, 1, 4717),
    Run(MOS, "mpt-30b", 29_975_214_080, "h100", 16, 2048, 10, 1, 2263),
    Run(MOS, "mpt-70b", 64_862_437_376, "h100", 64, 2048, 8, 1, 1039),
)


def model_of(run: Run) -> ModelSpec:
    """The run's model: its preset, or an MPT size with the count the source reports."""
    if run.model in PRESETS:
        return ModelSpec.from_arch(PRESETS[run.model])
    hidden, layers, heads = MPT[run.model]
    return ModelSpec(run.model, run.params, hidden, layers, heads)


@dataclass(frozen=True)
class Replayed:
    """A run and what the model predicts for it."""

    run: Run
    predicted: float
    """Tokens per second per GPU."""

    @property
    def error(self) -> float:
        """Signed relative error of the prediction: predicted / measured - 1."""
        return self.predicted / self.run.tokens_per_gpu - 1


def replay(runs: tuple[Run, ...] = RUNS, accelerators=None) -> list[Replayed]:
    """Each run predicted on its accelerator preset (or ``accelerators[name]``): ZeRO-3,
    bf16 mixed AdamW, one block per unit, prefetch 1, one micro-batch a step (steady
    state), flash attention, nodes of 8 on NVLink 4 + NDR (H100) or NVLink 3 + HDR
    (A100)."""
    accelerators = accelerators or ACCELERATORS
    out = []
    for run in runs:
        acc = accelerators[run.accelerator]
        net = get_network("nvlink4-ndr" if run.accelerator == "h100" else "nvlink3-hdr")
        tokens = run.micro_batch * run.seq_len
        work = Workload(tokens, run.seq_len, run.checkpoint_every > 0, True,
                        max(1, run.checkpoint_every))
        dims = ParallelDims(run.gpus, shard=run.shard_group)
        t = step_time(model_of(run), dims, ZERO3_BF16, work, Cluster(acc, net), Schedule())
        out.append(Replayed(run, t.tokens_per_gpu))
    return out


def median_abs_error(rows: list[Replayed]) -> float:
    """The median of |error| over the rows."""
    return median(abs(r.error) for r in rows)
