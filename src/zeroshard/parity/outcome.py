"""What one side of a parity check ends with, as full tensors by parameter name: the
initial weights, the gradients of step 1, every slice's loss, the weights and the
optimizer state after K steps."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Outcome:
    """One side's tensors, full (unsharded), on the host."""

    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    """The weights before the first step."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """The reduced gradients of step 1 (what the optimizer's first step reads, before
    clipping), in the dtype the optimizer sees."""
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """``"step k, rank r"`` -> the loss of rank r's rows at step k."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """The weights after K steps (the fp32 master where the recipe keeps one)."""
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Optimizer state key (``exp_avg``, ``momentum_buffer``, ``step``...) -> parameter
    name -> its full state tensor."""
    optimizers: list[str] = field(default_factory=list)
    """The optimizers' class names."""
    dropout_off: int = 0
    """Dropout modules whose p > 0 the check set to 0 (a rank's draws are its own)."""

    def categories(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every category compared, in the report's order."""
        out = {"initial weights": self.initial, "losses": self.losses,
               "gradients, step 1": self.grads, "weights": self.weights}
        out.update({f"optimizer {key}": v for key, v in sorted(self.state.items())})
        return out


def optimizers_of(optimizer) -> list:
    """``build_optimizer``'s result as a list (one optimizer, or Muon's and AdamW's)."""
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"build_optimizer returned {type(optimizer).__name__}; expected a "
                         "torch.optim.Optimizer or a list of them")
    return [optimizer]


def optimizer_state(optimizers: list, names: dict[int, str]) -> dict:
    """The plain optimizers' state by key and parameter name (``names``: id -> name)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, value in state.items():
                t = torch.as_tensor(value).detach().cpu().clone()
                out.setdefault(key, {})[names[id(p)]] = t.reshape(t.shape if t.dim() else ())
    return out


def read_checkpoint(path: str) -> tuple[dict, dict]:
    """(weights, optimizer state by key) of a zeroshard checkpoint, each tensor whole:
    every file's rows joined in row order (``checkpoint/sharded.py``'s [Note: format]);
    a state alike on every rank (the file's ``whole`` list) and scalars from one file.
    Written beside tensor parallelism, each file's rows are a box of the full tensor
    (:func:`_read_boxes`)."""
    from ..checkpoint.sanity import MANIFEST
    from ..checkpoint.tensorfile import TensorFile

    manifest = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("tp", 1) > 1:
        return _read_boxes(path, manifest)

    pieces: dict[str, list] = {}
    for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        f = TensorFile(os.path.join(path, fname))
        rows = json.loads(f.metadata["rows"])
        whole = set(json.loads(f.metadata.get("whole", "[]")))
        for key in f.keys():
            if key.startswith("__") or key.endswith("::buffer"):
                continue
            if not f.shape(key) or key in whole:
                pieces.setdefault(key, [(0, f.rows(key))])
            else:
                pieces.setdefault(key, []).append((rows[key.split("::")[0]][0], f.rows(key)))
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        t = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
        _put(weights, state, key, t)
    return weights, state


def _put(weights: dict, state: dict, key: str, value: torch.Tensor) -> None:
    """A checkpoint's tensor ``key`` — ``name`` (the weights) or ``name::state key`` —
    into its place."""
    name, _, skey = key.partition("::")
    if skey:
        state.setdefault(skey, {})[name] = value
    else:
        weights[name] = value


def _read_boxes(path: str, manifest: dict) -> tuple[dict, dict]:
    """A checkpoint written beside tensor parallelism read whole: each parameter, and
    each optimizer state shaped as its rows (Adam's moments, Muon's momentum), placed
    from every file's box ([Note: checkpoints across tp degrees] in
    ``checkpoint/tplayout.py``); a step count from one file. A state of another shape
    (Adafactor's factored statistics) is left out of the comparison."""
    from ..checkpoint.tensorfile import TensorFile
    from ..checkpoint.tplayout import pieces, place

    files = {f: TensorFile(os.path.join(path, f)) for f in manifest["files"]}
    keys: dict[str, set] = {}
    for f in files.values():
        for key in f.keys():
            if not key.startswith("__") and not key.endswith("::buffer"):
                keys.setdefault(key.split("::")[0], set()).add(key)
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, meta in manifest["params"].items():
        shape = tuple(meta["shape"])
        want = {0: (0, shape[0] if shape else 1)}
        for key in sorted(keys.get(name, ())):
            held = [(files[f], fa, fb, have, common)
                    for f, fa, fb, have, common in pieces(manifest, name, want)]
            first = held[0][0]
            if not first.shape(key):  # a step count
                value = first.rows(key)
            else:
                try:
                    value = torch.empty(shape or (1,), dtype=first.rows(key, 0, 1).dtype)
                    for f, fa, fb, have, common in held:
                        place(value, want, f.rows(key, fa, fb), have, common)
                except RuntimeError:  # not shaped as the parameter's rows
                    continue
                value = value.reshape(shape)
            _put(weights, state, key, value)
    return weights, state
