"""``zs.verify``: is *this* model, with *this* optimizer and configuration, sharded over N
processes, computing what the unsharded model computes?

The sharded side runs on N fresh local processes (``runtime/spawn.py``: gloo on the
host, NCCL where CUDA is); the reference, and a second reference with one-ulp nudges
([Note: the bound] in ``verdict.py``), in this process on the plain model. Nothing is
written but a checkpoint in a temporary folder, removed at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..runtime.spawn import RankFailure, spawn
from ..spec.config import ZeroConfig
from .certificate import Certificate
from .reference import run_reference
from .shardedrun import run_rank
from .trial import Trial, model_loss
from .verdict import compare, overall

#: Planner names of the optimizers whose state the planner counts (``spec/optimizers.py``).
_PLANNED = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Muon": "muon",
            "Adafactor": "adafactor", "Lamb": "lamb", "HostAdamW": "adamw"}


def verify(build_model: Callable, build_optimizer: Callable, batches: Sequence,
           config=None, *, nproc: int = 2, loss: Callable = model_loss,
           clip: float | None = None, schedule: Callable[[int], float] | None = None,
           seed: int = 0, timeout: float = 600.0, title: str | None = None, tp: int = 1,
           tp_plan: Callable | None = None) -> Certificate:
    """Run ``len(batches)`` steps of ``build_model()`` sharded by ``config`` (anything
    ``zs.shard`` takes: a ZeroConfig, a dict of its fields, a DeepSpeed config or a JSON
    path) on ``nproc`` processes, and the same steps of the unsharded model here, on the
    same global batches; return the :class:`Certificate` (``.ok``, ``.verdict``,
    ``.print()``). ``build_model`` and ``build_optimizer(model)`` must be importable by
    name (module-level functions, or ``functools.partial`` of them): the ranks are other
    processes. ``loss(model, batch)`` defaults to the model's own output (a scalar, or
    ``.loss``); ``clip`` clips the global gradient norm on both sides; ``schedule(step)``
    is the learning rate's factor (torch's ``LambdaLR``), for every optimizer. With
    ``tp`` > 1 each layer is split over ``tp`` consecutive ranks by ``tp_plan(model)``
    (torch's ``parallelize_module`` plan) and ZeRO runs over the ``nproc / tp`` others.

    Like any program that starts processes, call it from a script's
    ``if __name__ == "__main__":`` block: each rank imports the script again."""
    zero = ZeroConfig.load(config) if config is not None else ZeroConfig()
    trial = Trial(build_model, build_optimizer, list(batches), zero, nproc, loss, clip,
                  schedule, seed, timeout, tp=tp, tp_plan=tp_plan)
    return certify(trial, title)


def certify(trial: Trial, title: str | None = None, notes: list[str] | None = None
            ) -> Certificate:
    """The :class:`Certificate` of a checked :class:`Trial` (``verify``'s work, and
    ``zeroshard verify``'s)."""
    zero, seed, nproc, timeout = trial.config, trial.seed, trial.nproc, trial.timeout
    # the reference first: a model or optimizer that cannot be built fails here, plainly
    reference = run_reference(trial)
    nudged = [run_reference(trial, nudge=seed + 1)]
    if trial.tp > 1:  # tensor parallelism reorders the forward's and backward's own sums
        nudged.append(run_reference(trial, exact=True))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        sharded = spawn(run_rank, nproc, trial, backend=backend, timeout=timeout)[0]
    except RankFailure as exc:
        raise RuntimeError(f"the sharded run failed before it could be compared: "
                           f"{exc.one_line()}") from exc
    rows = compare(sharded["outcome"], reference, nudged, zero.recipe)
    opt_name = _planner_name(reference.optimizers)
    return Certificate(
        overall(rows), rows, title or _title(zero, nproc, opt_name, trial),
        "the unsharded model in one process (the recipe's casts in plain torch)",
        memory=_memory(sharded, zero, opt_name), comm=_comm(sharded, zero, opt_name),
        notes=[*(notes or []), *_notes(reference)])


def _planner_name(classes: list[str]) -> str | None:
    """The planner's name of the trial's optimizer (Muon beside AdamW: muon), or None."""
    names = {_PLANNED.get(c) for c in classes}
    if "muon" in names:
        return "muon"
    return names.pop() if len(names) == 1 else None


def _title(zero: ZeroConfig, nproc: int, opt_name: str | None, trial: Trial) -> str:
    recipe = zero.recipe.with_optimizer(opt_name) if opt_name else zero.recipe
    parts = [f"stage {zero.stage}", recipe.name, f"N = {nproc}", f"{trial.steps} steps"]
    if trial.tp > 1:
        parts.insert(2, f"TP {trial.tp}")
    if zero.offload:
        parts.append(f"offload {zero.offload}")
    if zero.activation_checkpointing not in (None, "none"):
        parts.append(f"checkpointing {zero.activation_checkpointing}")
    return ", ".join(parts)


def _with_optimizer(zero: ZeroConfig, opt_name: str) -> ZeroConfig:
    """``zero`` with its recipe's state counted for the planner's optimizer ``opt_name``."""
    from dataclasses import replace

    return replace(zero, mixed_precision=zero.recipe.with_optimizer(opt_name))


def _memory(sharded: dict, zero: ZeroConfig, opt_name: str | None) -> dict:
    """Rank 0's bytes by category, measured by the ledger at the last step, beside the
    planner's for the same layout (weights, grads and optimizer; the rest is measured
    only)."""
    from ..plan.placement import model_state_bytes

    held = sharded["memory"]
    planned: tuple = (None, None, None)
    params = sum(sharded["units"])
    trainable = sharded["trainable"] if sharded["trainable"] < params else None
    if opt_name is not None:
        config = _with_optimizer(zero, opt_name)
        try:
            planned = model_state_bytes(params, sharded["dims"], config, trainable=trainable,
                                        shapes=_as_planned(sharded, opt_name))
        except ValueError:  # a count the planner does not make (Muon beside LoRA)
            planned = (None, None, None)
    out = {k: (held.get(k, 0), p) for k, p in zip(("params", "grads", "optimizer"), planned,
                                                  strict=True)}
    out.update({k: (held.get(k, 0), None) for k in ("padding", "gathered", "buffers")})
    return out


def _as_planned(sharded: dict, opt_name: str) -> list[tuple[int, ...]]:
    """The shapes as the planner should count them: beside Muon it counts every matrix
    as Muon's, so a matrix the user gave AdamW (an embedding, the head) goes in as the
    vector of its elements, which the planner counts with AdamW's two states."""
    if opt_name != "muon":
        return sharded["shapes"]
    out = []
    for name, shapes in zip(sharded["optimizers"], sharded["stepped"], strict=True):
        muon = _PLANNED.get(name) == "muon"
        out += [s if muon or len(s) != 2 else (s[0] * s[1],) for s in shapes]
    return out


def _comm(sharded: dict, zero: ZeroConfig, opt_name: str | None) -> dict:
    """Bytes rank 0 sent per step (the engine's checks aside) beside the planner's: the
    stage's collectives, and the optimizer's own (Muon's owner computes over the
    matrices Muon steps, Adafactor's and LAMB's sums)."""
    from ..plan.comm import optimizer_comm
    from ..train.report import planned_comm

    steps = max(1, sharded.get("steps", 1))
    sent = sum(s["bytes"] for kind, s in sharded["comm"].items() if kind != "check")
    if sharded["dims"].tp > 1:  # tensor parallelism's own traffic needs the architecture
        return {"measured": sent / steps, "planned": None}
    params = sum(sharded["units"])
    trainable = sharded["trainable"] if sharded["trainable"] < params else None
    planned = planned_comm(params, sharded["dims"], zero, 1, sharded["units"], trainable)
    if opt_name is not None:
        config = _with_optimizer(zero, opt_name)
        own = [s for name, s in zip(sharded["optimizers"], sharded["stepped"], strict=True)
               if _PLANNED.get(name) == opt_name]
        planned += optimizer_comm([s for shapes in own for s in shapes], sharded["dims"],
                                  config)
    return {"measured": sent / steps, "planned": planned}


def _notes(reference) -> list[str]:
    if reference.dropout_off:
        return [f"dropout was off on both sides ({reference.dropout_off} modules with p > 0): "
                "each rank draws its own masks, which no reference can replay"]
    return []
