"""Tensor parallelism as the engine runs it: which parameters its plan splits over the tp
GPUs and which it leaves whole on each, and the activation collectives it issues.

The plans are those ``zeroshard train --tp`` applies with torch's own styles
(``models/tpplan.py``): the built-in GPT's (``GPT.TP_PLAN``, the ``"gpt"`` family) and, for
the other families, the one transformers ships (``model.tp_plan``: q, k, v and the MLP's
input matrices column-parallel, the attention's and the MLP's output matrices
row-parallel, the embedding vocabulary-parallel, the output head column-parallel with
its output gathered). So, per block, every attention and MLP matrix is split, and the
biases of the column-parallel ones; the norms and the row-parallel biases stay whole.
The GPT keeps its embeddings and tied head whole; the others split the vocabulary.

Collectives per micro-batch (each over the tp GPUs, ``t·h`` activations unless said):
a row-parallel layer all-reduces its output in forward, a column-parallel one its input
gradient in backward — one each, since torch's ``ColwiseParallel`` makes each layer's
replicated input a DTensor of its own (so q, k and v are three all-reduces, not
Megatron-LM's one), ``c`` = 4 per GPT block (q, k, v, the MLP's first), 5 per gated
block (gate and up), 2 for GPT-NeoX's fused qkv; ``r`` = 2. Checkpointing recomputes a
block's forward: ``r`` more. The vocabulary-parallel embedding all-reduces its output in
forward; the head gathers its ``t·V`` logits in forward and all-reduces its input
gradient in backward. A bare parameter count (no architecture) is split whole over tp,
with Megatron-LM's 4 all-reduces per layer (6 with checkpointing).
"""

from __future__ import annotations

from ..spec.formulas import ceil_div, ring_all_reduce, ring_one_way
from .arch import Architecture, ModelSpec


def _block(arch: Architecture) -> tuple[int, int]:
    """(split, whole) parameters of one block under its family's plan."""
    h, f, q, kv = arch.hidden, arch.ffn, arch.q_width, arch.kv_width
    inner = 2 if arch.gated_mlp else 1  # the MLP's column-parallel matrices
    split = h * q + 2 * h * kv + q * h + (inner + 1) * f * h
    if arch.linear_bias or arch.qkv_bias:
        split += q + 2 * kv
    if arch.linear_bias or arch.mlp_bias:
        split += inner * f
    return split, arch.block_params - split


def _root(arch: Architecture) -> tuple[int, int]:
    """(split, whole) parameters of the root unit: embeddings, final norm, head."""
    if arch.family == "gpt":
        return 0, arch.root_params
    split = arch.vocab * arch.hidden * (1 if arch.tied else 2)
    return split, arch.root_params - split


def _local(split: int, whole: int, tp: int) -> int:
    return whole + split // tp


def tp_units(model: ModelSpec, tp: int, blocks_per_unit: int = 1) -> tuple[int, int]:
    """(root unit, a unit of ``blocks_per_unit`` blocks) parameters on one GPU of ``tp``."""
    if model.arch is None:
        if model.layers is None:
            return ceil_div(model.params, tp), ceil_div(model.params, tp)
        return (ceil_div(model.root_params, tp),
                ceil_div(min(blocks_per_unit, model.layers) * model.block_params, tp))
    split, whole = _block(model.arch)
    blocks = min(blocks_per_unit, model.layers)
    return _local(*_root(model.arch), tp), blocks * _local(split, whole, tp)


def tp_params(model: ModelSpec, tp: int) -> int:
    """Parameters one GPU of ``tp`` holds."""
    if model.arch is None:
        return ceil_div(model.params, tp)
    return _local(*_root(model.arch), tp) + model.layers * _local(*_block(model.arch), tp)


def tp_counted(model: ModelSpec, tp: int) -> int:
    """The count the planner's functions take as ``params`` (each divides it by tp):
    ``tp × tp_params``, a whole parameter counted on every tp GPU; P itself for a bare
    count or tp = 1."""
    if model.arch is None or tp == 1:
        return model.params
    return tp * tp_params(model, tp)


def tp_layer_collectives(model: ModelSpec) -> tuple[int, int]:
    """(r, c): a block's all-reduces in forward (row-parallel outputs) and in backward
    (column-parallel input gradients)."""
    arch = model.arch
    if arch is None:
        return 2, 2
    qkv = 1 if arch.family == "neox" else 3
    return 2, qkv + (2 if arch.gated_mlp else 1)


def tp_root_bytes(model: ModelSpec, b: int, tokens: int, tp: int) -> int:
    """Bytes one GPU sends per micro-batch for the root's collectives: the embedding's
    output all-reduce, the head's logits all-gather and its input-gradient all-reduce
    (none for the GPT family, whose root stays whole)."""
    arch = model.arch
    if arch is None or arch.family == "gpt" or tp == 1:
        return 0
    act = tokens * arch.hidden * b
    return 2 * ring_all_reduce(act, tp) + ring_one_way(tokens * arch.vocab * b, tp)


def tp_unit_counts(model: ModelSpec, tp: int, units: list[int]) -> list[int]:
    """``units`` (the units' parameter counts, ``memory.unit_sizes``: the root first) as
    :func:`tp_counted` counts them: tp × each unit's parameters on one GPU."""
    if model.arch is None or tp == 1 or not model.layers:
        return units
    root = _local(*_root(model.arch), tp)
    block = _local(*_block(model.arch), tp)
    return [tp * root] + [tp * block * (u // model.arch.block_params) for u in units[1:]]
