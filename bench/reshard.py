"""How far a resharded resume lands from the run it interrupts, next to how far runs at
different N land from each other anyway.

    python bench/reshard.py                    # GPT small, 20 + 20 steps, from N = 2 stage 3
    python bench/reshard.py --steps 10 --model tiny

Trains ``--steps`` steps with ``zeroshard train`` at N = 2, stage 3, saving half-way and
at the end; resumes the half-way checkpoint at other N and stages; and trains the same
steps uninterrupted at each of those N. Reported per resumed run, as the largest
difference over all weights relative to the largest weight (``max|a - b| / max|b|``):
against the uninterrupted run at N = 2, and the uninterrupted run at the new N against
it — the spread that changing N alone gives (a sum over another number of ranks rounds
differently, and Adam carries the difference forward).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from zeroshard.checkpoint.consolidated import export  # noqa: E402
from zeroshard.checkpoint.tensorfile import TensorFile  # noqa: E402
from zeroshard.cli import main as cli  # noqa: E402

#: (N, stage) resumed from the half-way checkpoint of N = 2, stage 3.
RESUMES = [(2, 3), (1, 1), (4, 2), (2, 0)]


def _run(folder: Path, args: list[str]) -> None:
    code = cli(["train", *args, "--save-dir", str(folder), "--eval-every", "1000",
                "--sample-chars", "0"])
    if code:
        raise SystemExit(f"zeroshard train {' '.join(args)} exited with {code}")


def _weights(folder: Path, tmp: Path) -> dict:
    out = tmp / (folder.name + "-export")
    export(folder, out)
    f = TensorFile(str(out / "model.safetensors"))
    return {k: f.rows(k).double() for k in f.keys()}


def _rel(a: dict, b: dict) -> float:
    scale = max(v.abs().max().item() for v in b.values())
    return max((a[k] - b[k]).abs().max().item() for k in b) / scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=40, help="total steps (resumed half-way)")
    a = p.parse_args()
    half = a.steps // 2
    common = ["--model", a.model, "--steps", str(a.steps)]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        _run(tmp / "n2s3", [*common, "--nproc", "2", "--stage", "3", "--save-every",
                            str(half)])
        reference = _weights(tmp / "n2s3", tmp)
        rows = []
        for n, stage in RESUMES:
            resumed = tmp / f"resume-n{n}s{stage}"
            _run(resumed, [*common, "--nproc", str(n), "--stage", str(stage), "--resume",
                           str(tmp / "n2s3" / f"step-{half:06d}")])
            whole = tmp / f"whole-n{n}s{stage}"
            _run(whole, [*common, "--nproc", str(n), "--stage", str(stage)])
            rows.append((n, stage, _rel(_weights(resumed, tmp), reference),
                         _rel(_weights(whole, tmp), reference)))
    print(f"\nGPT {a.model}, {half} + {a.steps - half} steps, interrupted at N = 2 stage 3")
    head = ("resumed at", "vs the run it interrupts", "uninterrupted at N vs N = 2")
    print(f"{head[0]:>14}  {head[1]:>26}  {head[2]:>28}")
    for n, stage, resumed, whole in rows:
        print(f"{f'N={n} stage {stage}':>14}  {resumed:>26.2e}  {whole:>28.2e}")


if __name__ == "__main__":
    main()
