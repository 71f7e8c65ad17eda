"""The trainer's optimizer (``--optimizer``), by the planner's names, so that what
``zeroshard plan --optimizer`` plans is what ``zeroshard train`` and ``zeroshard verify``
run; and DeepSpeed's ``optimizer`` section read into the same settings.

Each is the class the engine steps exactly on shards (``spec/optimizers.py``):

- ``adamw``: torch's AdamW; weight decay on matrices only (dim >= 2), not biases or norms.
- ``sgd``: torch's SGD with momentum (0.9 unless ``momentum`` says), the same decay.
- ``lamb``: ``zeroshard.optim.Lamb`` (its trust ratios from whole-tensor norms).
- ``adafactor``: torch's Adafactor (factored second moments), its decay on every weight.
- ``muon``: torch's Muon for the hidden matrices, with its learning rate adjusted to
  match AdamW's update RMS (``adjust_lr_fn="match_rms_adamw"``, so one ``lr`` fits both),
  and AdamW for the embeddings, the output head, norms and biases — torch's documented
  use (Muon is for hidden layers only). The two step together; a checkpoint holds both.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..spec.optimizers import OPTIMIZERS

#: Each hyperparameter of TrainConfig, and the optimizers that take it.
HYPERPARAMETERS = {"betas": ("adamw", "lamb", "muon"), "eps": ("adamw", "lamb", "muon"),
                   "momentum": ("sgd", "muon")}

#: SGD's momentum when none is given: the planner counts SGD with one state per element.
SGD_MOMENTUM = 0.9


#: DeepSpeed's optimizer types (``deepspeed/runtime/config.py``) -> the planner's names.
#: Its Adam is AdamW unless ``adam_w_mode`` is false (DeepSpeed's default: true).
_DEEPSPEED_TYPES = {"adam": "adamw", "adamw": "adamw", "fusedadam": "adamw",
                    "cpuadam": "adamw", "deepspeedcpuadam": "adamw", "lamb": "lamb",
                    "fusedlamb": "lamb", "sgd": "sgd", "adafactor": "adafactor", "muon": "muon"}
#: DeepSpeed's optimizer parameters -> TrainConfig's settings.
_DEEPSPEED_PARAMS = {"lr": "lr", "betas": "betas", "eps": "eps",
                     "weight_decay": "weight_decay", "momentum": "momentum"}
#: Parameters that select an implementation, not the arithmetic, and the values that
#: leave the arithmetic as zeroshard's (None: any).
_DEEPSPEED_SWITCHES = {"adam_w_mode": True, "bias_correction": True, "amsgrad": False,
                       "torch_adam": None, "fused": None, "foreach": None}


def from_deepspeed_optimizer(section) -> dict:
    """The TrainConfig settings DeepSpeed's ``optimizer`` section gives (``"auto"``: left
    to the trainer's own value, as Hugging Face's integration fills it)."""
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ValueError(f"optimizer={section!r} must be a JSON object with a \"type\"")
    name = _DEEPSPEED_TYPES.get(section["type"].lower())
    if name is None:
        raise ValueError(f"optimizer.type={section['type']!r}; zeroshard's trainer runs Adam "
                         "and AdamW (as adamw), Lamb, SGD, Adafactor and Muon (1-bit and "
                         "0/1 Adam compress DeepSpeed's own communication)")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"optimizer.params={params!r} must be a JSON object")
    out = {"optimizer": name}
    for key, value in params.items():
        if value == "auto":
            continue
        if key in _DEEPSPEED_PARAMS:
            out[_DEEPSPEED_PARAMS[key]] = value
        elif key in _DEEPSPEED_SWITCHES:
            wanted = _DEEPSPEED_SWITCHES[key]
            if wanted is not None and value != wanted:
                raise ValueError(f"optimizer.params.{key}={value!r}: zeroshard's {name} runs "
                                 f"with {key}={wanted!r} only")
        else:
            known = ", ".join(repr(k) for k in [*_DEEPSPEED_PARAMS, *_DEEPSPEED_SWITCHES])
            raise ValueError(f"optimizer.params.{key} is not a setting zeroshard's trainer "
                             f"reads; expected some of {known}")
    return out


def _words(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_optimizer(cfg) -> None:
    """``cfg.optimizer`` and its hyperparameters against what the optimizer takes."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={cfg.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    for name, takers in HYPERPARAMETERS.items():
        value = getattr(cfg, name)
        if value is not None and cfg.optimizer not in takers:
            takes = [n for n, t in HYPERPARAMETERS.items() if cfg.optimizer in t]
            also = f", which takes {' and '.join(takes)}" if takes else ""
            raise ValueError(f"{name}={value!r} is a setting of {_words(takers)} only, not "
                             f"of optimizer={cfg.optimizer!r}{also}")
    if cfg.betas is not None:
        betas = list(cfg.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                      and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas={cfg.betas!r}; expected two numbers in [0, 1) "
                             "(--betas 0.9,0.95; in JSON [0.9, 0.95])")
    if cfg.eps is not None and not (0 < cfg.eps < 1 and math.isfinite(cfg.eps)):
        raise ValueError(f"eps={cfg.eps!r}; expected a small positive number, e.g. 1e-8")
    if cfg.momentum is not None and not 0 <= cfg.momentum < 1:
        raise ValueError(f"momentum={cfg.momentum!r}; expected a number in [0, 1)")


def _outer_names(model: nn.Module) -> set[str]:
    """Parameter names of the embeddings and the output head: not Muon's."""
    module = getattr(model, "module", model)  # a ShardedModel holds the original
    names = set()
    for prefix, m in module.named_modules():
        if isinstance(m, nn.Embedding):
            names.add(f"{prefix}.weight" if prefix else "weight")
    head = getattr(module, "get_output_embeddings", lambda: None)()
    if head is None:
        head = getattr(module, "head", None) or getattr(module, "lm_head", None)
    if isinstance(head, nn.Module):
        ids = {id(p) for p in head.parameters()}
        names |= {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}
    return names


def _decay_groups(named: list, cfg) -> list[dict]:
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    # both groups even where one is empty (LoRA's adapters are all matrices): a
    # checkpoint records the groups, and resuming one needs the same
    return [{"params": decay, "weight_decay": cfg.weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def _adam_kwargs(cfg) -> dict:
    out = {"lr": cfg.lr}
    if cfg.betas is not None:
        out["betas"] = tuple(cfg.betas)
    if cfg.eps is not None:
        out["eps"] = cfg.eps
    return out


def build_optimizer(model: nn.Module, cfg):
    """``cfg.optimizer`` over ``model``'s trainable parameters (a sharded model's
    shards): one optimizer, or for Muon a list of two (Muon's matrices, AdamW's rest)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(_decay_groups(named, cfg), **_adam_kwargs(cfg))
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(_decay_groups(named, cfg), lr=cfg.lr,
                               momentum=SGD_MOMENTUM if cfg.momentum is None else cfg.momentum)
    if cfg.optimizer == "lamb":
        from ..optim import Lamb

        return Lamb(_decay_groups(named, cfg), **_adam_kwargs(cfg))
    if cfg.optimizer == "adafactor":
        return torch.optim.Adafactor([p for _, p in named], lr=cfg.lr,
                                     weight_decay=cfg.weight_decay)
    outer = _outer_names(model)
    hidden = [p for n, p in named if p.dim() == 2 and n not in outer]
    rest = [(n, p) for n, p in named if not (p.dim() == 2 and n not in outer)]
    muon = {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
            "adjust_lr_fn": "match_rms_adamw"}
    if cfg.momentum is not None:
        muon["momentum"] = cfg.momentum
    opts = [torch.optim.Muon(hidden, **muon)] if hidden else []
    if rest:
        opts.append(torch.optim.AdamW(_decay_groups(rest, cfg), **_adam_kwargs(cfg)))
    return opts if len(opts) > 1 else opts[0]


def each(optimizer) -> list:
    """One optimizer or Muon's pair, as a list."""
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


class Schedules:
    """One learning-rate schedule per optimizer of Muon's pair, used as one: stepped
    together, saved and resumed together (a list of their states)."""

    def __init__(self, optimizers: list, lr_lambda):
        self.each = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in optimizers]

    def step(self) -> None:
        for s in self.each:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.each[0].get_last_lr()

    def state_dict(self) -> list[dict]:
        return [s.state_dict() for s in self.each]

    def load_state_dict(self, states: list[dict]) -> None:
        if not isinstance(states, list) or len(states) != len(self.each):
            raise ValueError("the checkpoint's learning-rate schedule is not Muon's pair: it "
                             "was saved with another --optimizer; resume with that one")
        for s, state in zip(self.each, states, strict=True):
            s.load_state_dict(state)


def schedule(optimizer, lr_lambda):
    """``lr_lambda``'s schedule of one optimizer (torch's LambdaLR), or of Muon's pair."""
    opts = each(optimizer)
    if len(opts) == 1:
        return torch.optim.lr_scheduler.LambdaLR(opts[0], lr_lambda)
    return Schedules(opts, lr_lambda)
