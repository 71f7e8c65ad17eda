"""Faults put into the ranks of a ``zeroshard train`` run by ``tests/train/test_elastic.py``.

Python imports ``sitecustomize`` at start-up from the path, so a launch whose
PYTHONPATH begins with this folder and whose environment holds ``ZEROSHARD_TEST_FAULTS``
(a JSON list of faults) runs them in its ranks, whichever launcher started the ranks
(torchrun or ``zeroshard train``'s own) and without a line of test code in the package.
A fault fires on one rank (``rank``) of one attempt (``attempt``, torchrun's
``TORCHELASTIC_RESTART_COUNT``) when it is about to train step ``step`` (counted from
1), or in its save of that step:

- ``kill``: SIGKILL itself;
- ``stop``: SIGSTOP itself (a hung rank: the others' collective timeout ends the attempt);
- ``kill-in-save``: write half of its checkpoint file, then SIGKILL itself;
- ``node``: SIGKILL its torchrun agent, the agent's other workers and itself (a node lost).

Each fault first appends ``{"how", "step", "time"}`` to the file ``ZEROSHARD_TEST_FAULT_LOG``
names, so a test can time what followed.
"""

import json
import os

PLAN = os.environ.get("ZEROSHARD_TEST_FAULTS")


def _mine() -> list[dict]:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    rank = int(os.environ["RANK"])
    return [f for f in json.loads(PLAN) if f["attempt"] == attempt and f["rank"] == rank]


def _fire(fault: dict) -> None:
    import signal
    import time

    with open(os.environ["ZEROSHARD_TEST_FAULT_LOG"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"how": fault["how"], "step": fault["step"],
                             "time": time.time()}) + "\n")
    if fault["how"] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if fault["how"] == "node":
        agent = os.getppid()
        os.kill(agent, signal.SIGKILL)
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == agent and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _install(faults: list[dict]) -> None:
    import zeroshard.checkpoint.sharded as sharded
    import zeroshard.train.loop as loop

    steps = {f["step"]: f for f in faults if f["how"] != "kill-in-save"}
    saves = {f"step-{f['step']:06d}.partial": f for f in faults if f["how"] == "kill-in-save"}
    train_step, write_tensors = loop.train_step, sharded.write_tensors

    def faulty_step(run, step):
        if step + 1 in steps:
            _fire(steps.pop(step + 1))
        return train_step(run, step)

    def faulty_write(path, entries, metadata=None):
        fault = saves.pop(os.path.basename(os.path.dirname(path)), None)
        if fault:
            entries = list(entries)
            write_tensors(path, entries[: len(entries) // 2], metadata)
            _fire(fault)
        return write_tensors(path, entries, metadata)

    loop.train_step, sharded.write_tensors = faulty_step, faulty_write


if PLAN and "RANK" in os.environ and _mine():
    _install(_mine())
