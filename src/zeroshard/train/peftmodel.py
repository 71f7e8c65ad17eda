"""``zeroshard train --lora R``: the model the trainer builds, with peft's LoRA adapters
on its frozen weights, and ``--compile``.

peft (``get_peft_model``) wraps the model before ``zs.shard``, so the adapters sit in
the units with the weights they adapt ([Note: partly frozen units] in
``runtime/unit.py``). A Hugging Face model is built on the meta device and its
weights read from the folder after sharding: peft's adapters are made on the meta
device too (``_move_adapter_to_device_of_base_layer``), so they are initialised as
peft initialises them (``LoraLayer.reset_lora_parameters`` with
``init_lora_weights=True``: A Kaiming-uniform, B zero) when their unit is materialized,
and the weights' names are the base model's inside peft's wrapper
(``base_model.model.`` before, ``.base_layer`` inside each adapted layer).
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..spec.lora import BUILTIN_TARGETS, LoraSpec, check_beside_tp


def check_adapters(cfg) -> None:
    """The LoRA settings of a TrainConfig, checked with the planner's ``LoraSpec``."""
    if cfg.compile is not None and not cfg.compile:
        raise ValueError(f"compile={cfg.compile!r} must name a torch.compile backend, such "
                         "as inductor or aot_eager")
    check_beside_tp(cfg.lora, cfg.tp)
    if cfg.lora is None:
        if cfg.lora_targets is not None:
            raise ValueError(f"lora_targets={cfg.lora_targets!r} needs lora, the adapters' "
                             "rank (--lora R)")
        return
    lora_spec(cfg)


def lora_spec(cfg) -> LoraSpec:
    return LoraSpec(cfg.lora, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)


def peft_config(cfg, builtin: bool):
    """peft's ``LoraConfig`` of the run: the targets given, or peft's default for a
    Hugging Face model (by its model_type), or the built-in GPT's."""
    try:
        import peft
    except ImportError:
        raise ValueError("lora needs peft, which is not installed: pip install peft") from None
    s = lora_spec(cfg)
    targets = list(s.targets) if s.targets else (list(BUILTIN_TARGETS) if builtin else None)
    return peft.LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout,
                           target_modules=targets)


def with_adapters(model: nn.Module, cfg, builtin: bool) -> nn.Module:
    """``model`` wrapped by peft with the run's adapters (every other weight frozen). The
    targets must name layers of the model and the rank fit them (``LoraSpec``'s rules),
    found on the meta model before launch (``hfmodel``'s ``meta``)."""
    import peft

    config = peft_config(cfg, builtin)
    if lora_spec(cfg).targets:
        _check_targets(model, lora_spec(cfg).targets)
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # what peft refuses besides: one line
        text = str(exc).strip().splitlines()[0]
        raise ValueError(f"lora_targets={cfg.lora_targets!r}: {text}") from None
    lora_spec(cfg).check_widths(_widths(wrapped))
    return wrapped


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers of ``model`` peft can adapt, by name: linear ones (torch's, and GPT-2's
    ``Conv1D``, a linear layer stored transposed)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Each target names a linear layer of ``model`` as peft matches names (the whole name,
    or its last parts): one line naming the first that does not, and the layers there are."""
    layers = _layers(model)
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in layers):
            names = sorted({n.rsplit(".", 1)[-1] for n in layers})
            raise ValueError(f"lora_targets={','.join(targets)!r}: {type(model).__name__} has no "
                             f"linear layer named {t!r}; its linear layers: {', '.join(names)}")


def _widths(peft_model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) features of every layer peft adapted, by name."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in peft_model.named_modules():
        if isinstance(m, LoraLayer):
            base = m.get_base_layer()
            weight = base.weight  # Linear: [out, in]; Conv1D: [in, out]
            n_out, n_in = weight.shape if isinstance(base, nn.Linear) else weight.shape[::-1]
            out[name.removeprefix("base_model.model.")] = (int(n_in), int(n_out))
    return out


def adapter_init(model: nn.Module, base_init):
    """``param_init`` for a peft model built on the meta device: A as peft initialises it
    (Kaiming-uniform, a = sqrt 5), B zero, every other module by ``base_init``."""
    from peft.tuners.lora import LoraLayer

    a_modules, b_modules = set(), set()
    for m in model.modules():
        if isinstance(m, LoraLayer):
            a_modules |= {id(x) for x in m.lora_A.values()}
            b_modules |= {id(x) for x in m.lora_B.values()}

    def init(module: nn.Module) -> None:
        if id(module) in a_modules:
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif id(module) in b_modules:
            nn.init.zeros_(module.weight)
        else:
            base_init(module)

    return init


def check_compile(backend: str | None) -> None:
    """``--compile``'s backend is one torch knows (``torch._dynamo.list_backends``), found
    before launch rather than at the first forward of every rank."""
    if backend is None:
        return
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=None)
    if backend not in known:
        shown = [b for b in known if "TESTING" not in b and "minifier" not in b]
        raise ValueError(f"compile={backend!r} is not a torch.compile backend; expected one "
                         f"of {', '.join(shown)}")


def compile_units(model, cfg) -> None:
    """``--compile``: every unit's forward compiled, the hooks eager around them."""
    if cfg.compile:
        model.compile(backend=cfg.compile)


def trainable_count(model) -> int | None:
    """Elements the run trains, where some are frozen (None: all of them train)."""
    total = sum(u.w_layout.numel for u in model.units)
    trained = sum(u.g_layout.numel for u in model.units)
    return None if trained == total else trained

