"""The training state's bytes per GPU by category, wherever it lives.

Stage k shards the first k of (optimizer state, gradients, weights) over the K ranks of
a shard group (ZeRO paper, section 5; ``ShardPolicy``), after tensor parallelism of
degree tp divides all three. With the 2/2/12 recipe over N = K ranks:

    DDP     16P            ZeRO-2  2P + 14P/N
    ZeRO-1  4P + 12P/N     ZeRO-3  16P/N

Offloaded (``ZeroConfig.offload``), the optimizer category holds a master even when
the recipe has none: the engine steps an fp32 host copy beside the device's fp32
weights (4 + 8 bytes an element for fp32 AdamW). Where each category lives is
``offload.placed_bytes``'s question; the sums here are what the engine's ledger counts
per category over every placement.

Every figure is an integer number of bytes; sharded figures round up (a rank holds
whole elements).
"""

from __future__ import annotations

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import ceil_div
from ..spec.policy import ShardPolicy
from ..spec.recipes import DTYPE_BYTES, Recipe
from .layout import check_layout
from .optimizer import state_bytes

#: The master's bytes when the recipe has none: the engine keeps an fp32 host copy.
HOST_MASTER_BYTES = DTYPE_BYTES["fp32"]


def master_bytes(recipe: Recipe, offloaded: bool) -> int:
    """Bytes per element of the master: the recipe's, or 4 offloaded without one."""
    m = recipe.master_bytes
    return m or (HOST_MASTER_BYTES if offloaded else 0)


def optimizer_bytes(config: ZeroConfig) -> int:
    """Bytes per element of the optimizer category: the master and the optimizer
    states, with the host master offload adds when the recipe has none."""
    recipe = config.recipe
    offloaded = config.policy.offloads_optimizer
    return master_bytes(recipe, offloaded) + recipe.optimizer_bytes - recipe.master_bytes


def owned(params: int, dims: ParallelDims, policy: ShardPolicy) -> int:
    """Elements whose optimizer state this GPU holds: P/tp when nothing is sharded,
    over K above."""
    k = dims.shard_size if policy.shards_optimizer else 1
    return ceil_div(ceil_div(params, dims.tp), k)


def model_state_bytes(params: int, dims: ParallelDims, config: ZeroConfig,
                      trainable: int | None = None,
                      shapes: list[tuple[int, ...]] | None = None) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per GPU, every placement together (the engine's
    ledger categories): ``config``'s stage shards the first k of (optimizer, grads,
    weights) over the layout's K ranks, after TP divides all by tp; the optimizer's
    bytes are :func:`optimizer_bytes` (a host master offloaded), or, for an optimizer
    whose state depends on the shapes (``Recipe.shaped_state``: Muon, Adafactor), the
    master's plus the state ``plan/optimizer.state_bytes`` counts from ``shapes``.
    ``trainable``: of the ``params``, those that train (LoRA's adapters), which alone
    have gradients and optimizer state; frozen ones are weights only, at the weights'
    dtype."""
    check_layout(dims, config)
    policy, recipe = config.policy, config.recipe
    trained = params if trainable is None else trainable

    def part(bytes_per_param: int, count: int, sharded: bool) -> int:
        total = ceil_div(bytes_per_param * count, dims.tp)
        return ceil_div(total, dims.shard_size) if sharded else total

    if recipe.shaped_state:
        if shapes is None:
            raise ValueError(f"optimizer {recipe.optimizer!r} keeps state that depends on "
                             "each parameter's shape: plan a preset (--model), a "
                             "config.json (--hf-config) or a module, not a bare count")
        if trainable is not None:
            raise ValueError(f"optimizer {recipe.optimizer!r} with LoRA adapters: the "
                             "planner knows the base model's shapes, not the adapters'; "
                             "plan --lora with --optimizer adamw")
        m = master_bytes(recipe, policy.offloads_optimizer)
        optimizer = part(m, params, policy.shards_optimizer) + state_bytes(shapes, dims,
                                                                           config)
    else:
        optimizer = part(optimizer_bytes(config), trained, policy.shards_optimizer)
    return (part(recipe.weight_bytes, params, policy.shards_params),
            part(recipe.grad_bytes, trained, policy.shards_grads), optimizer)
