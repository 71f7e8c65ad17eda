"""zeroshard.hf.Trainer against transformers' own Trainer, in turns in the same ranks: the
step-time ratio with a confidence interval.

    python bench/trainers.py                          # both pairs, N = 2
    python bench/trainers.py --pairs zs3:fsdp2 --rounds 5 --steps 30

Pairs: ``zs0:ddp`` (zeroshard.hf.Trainer at stage 0 against the Trainer's DDP of the
plain model) and ``zs3:fsdp2`` (stage 3 against the Trainer over torch's FSDP2, a Llama
decoder layer per unit as zeroshard's default units). The Trainer's own FSDP2 route,
accelerate's plugin (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``), does
not run on CPU: accelerate turns FSDP on for multi-GPU types only and trains DDP instead,
silently; so the FSDP2 member is the stock Trainer over ``fully_shard``, through the
same hook zeroshard.hf uses (``_fsdp2_trainer``). ``zs3:ddp`` is a third pair. A Trainer runs a
whole loop, so the pair is run in *rounds*: in every round each member trains a fresh
model of the same initial weights on the same batches for ``--steps`` optimizer steps, in the same
processes, the two ``train()`` loops taking turns step by step (each in a thread of its
own, a callback passing a baton at every step's end: one runs at a time, in the same
order on every rank), the first member swapped every round. So step k of one member and
step k of the other see the same global batch within a second of each other, and a slow
spell of this shared machine falls on both; their ratio is one sample (a Trainer
callback times each optimizer step on rank 0, from ``on_step_begin`` to
``on_step_end``: the micro-batches' forward and backward, clipping, the step and the
scheduler; the first ``--warmup`` steps of each round are dropped). Reported per pair:
each member's median step time, the median of the per-step ratios and a 95 % bootstrap
interval for it (2,000 resamples, seeded), and both members' training losses, which
must agree (the pair trains the same function; a pair whose losses differ is reported
and the command exits with status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

PAIRS = ["zs0:ddp", "zs3:fsdp2"]
#: relative difference of the mean training losses past which a pair did not train the
#: same function (fp32; FSDP2 and zeroshard sum the same gradients in other orders)
LOSS_TOL = 1e-5
#: the model: a Llama of 4 layers, width 256 (5.3 M parameters), sequences of 128
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)


def _members(pair: str) -> list[str]:
    members = pair.split(":")
    known = {"zs0", "zs1", "zs2", "zs3", "ddp", "fsdp2"}  # any two
    if len(members) != 2 or not set(members) <= known:
        raise SystemExit(f"bench/trainers.py: --pairs {pair!r}: expected two of "
                         f"{', '.join(sorted(known))} joined by ':'")
    return members


def _trainer(member: str, folder: str, steps: int, batch: int):
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import zeroshard.hf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    n = 2 * batch * steps * int(os.environ["WORLD_SIZE"])
    ids = torch.randint(0, MODEL["vocab_size"], (n, 128),
                        generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(folder, use_cpu=True, ddp_backend="gloo", max_steps=steps,
                             per_device_train_batch_size=batch, gradient_accumulation_steps=2,
                             learning_rate=1e-3, warmup_steps=2, weight_decay=0.1,
                             max_grad_norm=1.0, logging_steps=steps, save_strategy="no",
                             report_to=[], disable_tqdm=True, seed=0)
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    if member.startswith("zs"):
        return zeroshard.hf.Trainer(model=model, args=args, train_dataset=data,
                                    zero={"stage": int(member[2])})
    if member == "fsdp2":
        return _fsdp2_trainer(Trainer)(model=model, args=args, train_dataset=data)
    return Trainer(model=model, args=args, train_dataset=data)


def _fsdp2_trainer(trainer_cls):
    """The stock Trainer over torch's FSDP2 (``fully_shard`` on each decoder layer, then
    the root: zeroshard's default units), where accelerate cannot: on CPU it ignores its
    FSDP plugin (``AcceleratorState`` turns FSDP on for multi-GPU types only) and trains
    DDP instead, silently (``fsdp="full_shard"`` with ``use_cpu=True``: the model comes
    back in ``DistributedDataParallel``). It takes the hook zeroshard.hf takes: a model
    from ``_wrap_model`` other than ``self.model`` is not prepared (no DDP); accumulation
    defers FSDP2's reduction as accelerate's ``no_sync`` does for FSDP2
    (``set_requires_gradient_sync``); accelerate clips the DTensor gradients by their
    global norm."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    class Outside(nn.Module):
        """What ``_wrap_model`` returns: the FSDP2 model, and its ``no_sync``."""

        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)

    class FSDP2Trainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for layer in self.model.model.layers:
                fully_shard(layer)
            fully_shard(self.model)
            self.model_wrapped = Outside(self.model)

        def _wrap_model(self, model, training=True, dataloader=None):
            return self.model_wrapped

    return FSDP2Trainer


def _rank(pairs: list[str], folder: str, rounds: int, steps: int, batch: int) -> dict:
    """On every rank: each pair's rounds; rank 0's step times and the losses."""
    import torch.distributed as dist
    import transformers

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500", HF_HUB_OFFLINE="1")
    transformers.logging.set_verbosity_error()
    out = {}
    for pair in pairs:
        members = _members(pair)
        times = {m: [] for m in members}
        losses = {m: [] for m in members}
        for r in range(rounds):
            order = members if r % 2 == 0 else members[::-1]
            trainers = [_trainer(m, folder, steps, batch) for m in order]
            for member, (clock, trainer) in zip(order, _in_turns(trainers)):
                times[member].append(clock)
                losses[member].append([x["loss"] for x in trainer.state.log_history
                                       if "loss" in x])
        out[pair] = {"times": times, "losses": losses}
    return out


def _in_turns(trainers: list) -> list:
    """Train the trainers step by step in turns: each ``train()`` runs in a thread of its
    own, and a callback passes a baton at every ``on_step_end`` and waits for it to come
    back, so exactly one trainer runs at any moment, step k of the first, then step k of
    the second, in the same order on every rank (their collectives pair up across ranks).
    Returns each trainer's step times (``on_step_begin`` to ``on_step_end``)."""
    import threading

    from transformers import TrainerCallback

    turns = [threading.Event() for _ in trainers]
    finished = [False] * len(trainers)

    def pass_baton(k: int) -> None:
        nxt = next(((k + j) % len(trainers) for j in range(1, len(trainers) + 1)
                    if not finished[(k + j) % len(trainers)]), None)
        if nxt is not None:
            turns[nxt].set()

    class Baton(TrainerCallback):
        def __init__(self, k: int):
            self.k, self.times = k, []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)
            if state.global_step < state.max_steps:  # the last step keeps the baton
                turns[self.k].clear()
                pass_baton(self.k)
                turns[self.k].wait()

    batons = [Baton(k) for k in range(len(trainers))]
    errors: list = []

    def run(k: int) -> None:
        turns[k].wait()
        try:
            trainers[k].add_callback(batons[k])
            trainers[k].train()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
        finally:
            turns[k].clear()
            finished[k] = True
            pass_baton(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(trainers))]
    for t in threads:
        t.start()
    turns[0].set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [(b.times, t) for b, t in zip(batons, trainers)]


def _summary(result: dict, warmup: int) -> dict:
    members = list(result["times"])
    a, b = (result["times"][m] for m in members)
    ratios = [x / y for ra, rb in zip(a, b) for x, y in zip(ra[warmup:], rb[warmup:])]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    loss = {m: statistics.mean(statistics.mean(r) for r in result["losses"][m]) for m in members}
    return {"members": members,
            "median_ms": {m: 1e3 * statistics.median(t for r in result["times"][m]
                                                     for t in r[warmup:]) for m in members},
            "ratio": statistics.median(ratios), "interval": (boots[50], boots[1949]),
            "samples": len(ratios), "loss": loss,
            "same_loss": abs(loss[members[0]] - loss[members[1]]) <= LOSS_TOL * abs(
                loss[members[1]])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"default {','.join(PAIRS)}")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="rounds per pair (default 4)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps a round (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps of a round not timed")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-batch")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = p.parse_args(argv)
    pairs = [x.strip() for x in a.pairs.split(",") if x.strip()]
    for pair in pairs:
        _members(pair)
    if a.warmup >= a.steps:
        raise SystemExit("bench/trainers.py: --warmup must be below --steps")
    import tempfile

    from zeroshard.runtime.spawn import spawn

    start = time.time()
    with tempfile.TemporaryDirectory() as folder:
        raw = spawn(_rank, a.nproc, pairs, folder, a.rounds, a.steps, a.batch,
                    timeout=3600)[0]
    summary = {pair: _summary(raw[pair], a.warmup) for pair in pairs}
    print(f"bench/trainers.py: N = {a.nproc}, {a.rounds} rounds x {a.steps} steps "
          f"({a.warmup} untimed), {a.batch} x 128 tokens per rank and micro-batch, "
          f"2 micro-batches a step, {time.time() - start:.0f} s")
    failed = False
    for pair, s in summary.items():
        m0, m1 = s["members"]
        lo, hi = s["interval"]
        print(f"{pair}: {m0} {s['median_ms'][m0]:.1f} ms, {m1} {s['median_ms'][m1]:.1f} ms "
              f"a step; ratio {s['ratio']:.3f} (95% {lo:.3f}-{hi:.3f}, {s['samples']} steps); "
              f"mean loss {s['loss'][m0]:.6f} vs {s['loss'][m1]:.6f}"
              f"{'' if s['same_loss'] else '  <- the losses differ'}")
        failed |= not s["same_loss"]
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "summary": summary}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
