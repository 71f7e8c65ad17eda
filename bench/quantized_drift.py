"""How far ZeRO++'s quantized collectives (qwZ weights, qgZ gradients: int8 blocks with
fp32 scales) move a run from the exact one.

    python bench/quantized_drift.py              # both models (about 6 minutes on 2 cores)
    python bench/quantized_drift.py --only gpt   # zeroshard train's default run only

1. ``zeroshard train``'s default run (GPT small, stage 3, N = 2, 400 steps) exact and
   with ``--quantize-weights --quantize-grads``: train loss at steps 100, 200 and 400
   (the mean of the 10 steps up to each) and the final validation loss.
2. A Hugging Face Llama (``LlamaForCausalLM`` from a small config: 4 layers, hidden
   128, the built-in corpus's 256 byte tokens), stage 3, N = 2, 200 AdamW steps at
   lr 1e-3: the same measurements at steps 50, 100 and 200.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from zeroshard.cli import main as cli  # noqa: E402
from zeroshard.runtime.spawn import spawn

QUANT = {"quantize_weights": True, "quantize_grads": True}


def _gpt(quantized: bool) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        flags = ["--quantize-weights", "--quantize-grads"] if quantized else []
        if cli(["train", "--sample-chars", "0", "--json-log", str(log), *flags]):
            raise SystemExit("zeroshard train failed")
        rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["loss"] for r in rows], rows[-1]["val_loss"]


def _llama(quantized: bool, steps: int) -> tuple[list[float], float]:
    import torch
    import transformers

    import zeroshard as zs
    from zeroshard.data import Corpus

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    net = zs.shard(transformers.LlamaForCausalLM(cfg), stage=3, **(QUANT if quantized else {}))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    corpus, rank, world = Corpus.builtin(), torch.distributed.get_rank(), 2
    losses = []
    for step in range(steps):
        x, _ = corpus.batch("train", 0, step, 16, 64)
        rows = slice(rank * 8, (rank + 1) * 8)
        loss = net(input_ids=x[rows], labels=x[rows], use_cache=False).loss
        loss.backward()
        net.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1)
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    with torch.no_grad():
        x, _ = corpus.batch("val", 7919, 0, 16, 64)
        rows = slice(rank * 8, (rank + 1) * 8)
        t = net(input_ids=x[rows], labels=x[rows], use_cache=False).loss.reshape(1)
        torch.distributed.all_reduce(t)
    return losses, t.item() / world


def _report(name: str, at: list[int], exact, quant) -> None:
    (el, ev), (ql, qv) = exact, quant
    print(f"\n{name}: train loss (mean of the 10 steps up to each), exact -> quantized")
    for s in at:
        e, q = sum(el[s - 10:s]) / 10, sum(ql[s - 10:s]) / 10
        print(f"  step {s:>4}: {e:.4f} -> {q:.4f}  ({(q - e) / e:+.2%})")
    print(f"  final validation loss: {ev:.4f} -> {qv:.4f}  ({(qv - ev) / ev:+.2%})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["gpt", "llama"])
    a = p.parse_args()
    if a.only in (None, "gpt"):
        _report("zeroshard train (GPT small, stage 3, N = 2)", [100, 200, 400],
                _gpt(False), _gpt(True))
    if a.only in (None, "llama"):
        runs = [spawn(_llama, 2, q, 200, timeout=1800)[0] for q in (False, True)]
        _report("Hugging Face Llama (4 x 128, stage 3, N = 2)", [50, 100, 200], *runs)


if __name__ == "__main__":
    main()
