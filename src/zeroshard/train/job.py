"""``zeroshard train`` as a job of processes.

The command's own process checks every setting and path, tokenizes ``--data`` once and
starts ``nproc`` ranks through the local launcher (``launch.py``), handing them the
settings in the environment (``launch``). Each rank runs the loop (``loop.py``), and an
error there is told once (``failure.py``; ``run_rank``). Under torchrun there is no
command's process: each rank reads its flags itself and goes straight to ``run_rank``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import traceback

from ..runtime.dist import release_process_groups
from . import datasource, early, failure, preflight
from .hfmodel import model_source
from .settings import TrainConfig

#: The launcher hands the resolved settings to its ranks here (not as arguments, which
#: torch.distributed.run would try to parse as its own).
CONFIG_ENV = "ZEROSHARD_TRAIN_CONFIG"


#: The most restarts ``--max-restarts`` takes: each costs a restart of every rank and a
#: resume (tens of seconds at least); a run failing more often than that needs a person.
MAX_RESTARTS = 1000


def handed_over() -> TrainConfig | None:
    """On a rank started by ``launch``: the settings it handed over; None elsewhere."""
    if CONFIG_ENV not in os.environ or failure.ERROR_DIR not in os.environ:
        return None  # (a variable left in a shell from a rank's environment is not ours)
    return TrainConfig.from_dict(json.loads(os.environ[CONFIG_ENV]), CONFIG_ENV)


def launch(cfg: TrainConfig, debug: bool = False, max_restarts: int = 0) -> int:
    """Check everything, then run ``cfg.nproc`` local ranks and wait for them; the
    launcher's exit code. ``debug``: the ranks' full tracebacks and the launcher's
    report, not the error's one line. ``max_restarts``: times torch's launcher starts
    every rank again after one fails (each resumes the last checkpoint: ``resume
    auto``)."""
    if max_restarts < 0 or max_restarts > MAX_RESTARTS:
        raise ValueError(f"--max-restarts={max_restarts}; expected 0 to {MAX_RESTARTS:,} (a "
                         "restart resumes the last checkpoint after a rank dies or a "
                         "collective times out; bad input ends the run at once)")
    if max_restarts and cfg.resume != "auto":
        raise ValueError(f"--max-restarts={max_restarts} needs --resume auto (and --save-dir): "
                         "a restart resumes the last checkpoint")
    cfg.accumulation(cfg.nproc)  # the batch must divide over the processes
    source = model_source(cfg)  # a Hugging Face folder read, the sequence length checked
    held = preflight.check(cfg, source)  # every path, before any process starts
    env = dict(os.environ)
    env[CONFIG_ENV] = json.dumps(cfg.to_dict())
    if debug:
        env[failure.DEBUG] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    launch_argv = ["--nproc-per-node", str(cfg.nproc), "--max-restarts", str(max_restarts),
                   "-m", "zeroshard", "train"]  # torchrun's, on loopback only
    with held:
        corpus = datasource.prepare(cfg, source.vocab, source.seq_len)  # tokenized once, here
        try:
            if corpus is not None:
                env[datasource.ENV] = str(corpus)
            return _wait(early.take(launch_argv, env) or subprocess.Popen(
                [sys.executable, "-m", "zeroshard.train.launch", *launch_argv], env=env))
        finally:
            if corpus is not None:
                shutil.rmtree(corpus.parent, ignore_errors=True)


def _wait(launcher: subprocess.Popen) -> int:
    """The launcher's exit code. Ctrl-C reaches the launcher and the ranks too (the
    terminal signals the whole process group): let the launcher stop the ranks and say
    so; a SIGINT sent to this process alone is passed on after a while."""
    while True:
        try:
            return launcher.wait()
        except KeyboardInterrupt:
            try:
                return launcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                launcher.send_signal(signal.SIGINT)


def run_rank(cfg: TrainConfig) -> int:
    """One rank's run; its exit code. Under ``launch`` an error is written for the
    launcher to print once (``failure.py``); under torchrun it is raised."""
    from .loop import train  # the engine and the loop: on the ranks, not in the command

    try:
        train(cfg)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says it once
        if failure.ERROR_DIR not in os.environ or failure.debugging():
            raise
        release_process_groups()
        return 130
    except Exception as exc:
        # the traceback holds train's frames, and with them the model
        rank = int(os.environ.get("RANK", "0"))
        if failure.ERROR_DIR in os.environ:
            code = failure.record(exc, rank)
            traceback.clear_frames(exc.__traceback__)
            release_process_groups()
            return code
        traceback.clear_frames(exc.__traceback__)
        release_process_groups()
        raise
    release_process_groups()
    return 0
