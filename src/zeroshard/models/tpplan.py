"""Tensor-parallel plans applied with torch's own styles.

A *plan* maps module names (``*`` matches one name in a path, as in
``parallelize_module``) to a style name, in transformers' vocabulary
(``transformers/distributed/tensor_parallel.py``'s ``ALL_PARALLEL_STYLES``), so the plan a
Hugging Face model ships (``model.tp_plan``: its config's ``base_model_tp_plan`` with the
vocabulary-parallel embedding and the ``lm_head`` entry) is read as it is. Each style
name becomes torch's own ``ColwiseParallel`` or ``RowwiseParallel``
(``torch.distributed.tensor.parallel``), applied by ``parallelize_module``: no
tensor-parallel layer is written here. The built-in GPT's plan is ``GPT.TP_PLAN``.
"""

from __future__ import annotations

import torch.nn as nn

#: Style names taken, and torch's style each becomes (transformers' meaning of the name).
STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise",
          "rowwise_rep", "rowwise_split_input")


def torch_style(name: str, where: str):
    """torch's parallel style for style ``name`` (of the plan entry ``where``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":  # input replicated, output this rank's columns
        return ColwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):  # output gathered whole
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":  # input this rank's columns, output summed (all-reduce)
        return RowwiseParallel()
    if name in ("embedding_rowwise", "rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate())  # a vocabulary-parallel embedding
    raise NotImplementedError(f"tensor-parallel plan entry {where!r}: style {name!r} is not "
                              f"taken; accepted: {', '.join(STYLES)}")


def parallelize(model: nn.Module, tp_mesh, plan: dict[str, str]) -> nn.Module:
    """``model`` with ``plan`` applied over ``tp_mesh`` (a 1-D mesh, the ``"tp"`` dim) by
    torch's ``parallelize_module``. Weights tied before (an embedding and its output
    head, both cut on the vocabulary) are tied again after, as one DTensor."""
    from torch.distributed.tensor.parallel import parallelize_module

    ties = _ties(model)
    styles = {key: torch_style(name, key) for key, name in plan.items()}
    parallelize_module(model, tp_mesh, styles)
    for owner, attr, module, name in ties:
        setattr(owner, attr, getattr(module, name))
    return model


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, attribute, first module, its attribute) of every parameter registered
    again after its first registration."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((m, attr, *first[id(p)]))
            else:
                first[id(p)] = (m, attr)
    return out


def hf_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan transformers ships for ``model`` (``model.tp_plan``), or a
    ValueError naming the class when it ships none."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"--tp: transformers ships no tensor-parallel plan for "
                         f"{type(model).__name__}; expected a model whose config has a "
                         "base_model_tp_plan (Llama, Mistral, Qwen2, ...), or --tp 1")
    return plan
