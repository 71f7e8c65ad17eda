"""What the module the user holds shows under a unit's parameter names.

[Note: module view] At stage 3 a released unit's full parameters keep an empty storage:
autograd's saved references to them must stay valid, so the storage object stays and
the next gather refills it (``unit.py``). A tensor over an empty storage has a null
data pointer, and reading one's values kills the process. So the module must not show
them then: as FSDP2 registers its sharded DTensor parameters on the module at reshard
and the unsharded ones at unshard (``FSDPParam.to_sharded`` / ``to_unsharded`` and
``_setattr_on_modules`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), a
unit whose parameters are released shows, under each name that registers one, this
rank's rows of the compute weights as a ``Shard(0)`` DTensor parameter of the full shape
(``dtensor.py``), and its full parameters from its gather to its release. Whatever walks
the module between forwards (``state_dict()``, ``named_parameters()``, ``save_pretrained``)
then reads this rank's values, or the full ones through ``p.full_tensor()`` (a
collective), never an empty tensor.

The DTensors are views of the weight shard, made once; a swap is one dict write per
registration, as FSDP2's ``unsafe_setattr_param``. Nothing is allocated or copied, so
the engine's memory and speed are unchanged. Units whose parameters stay whole (stages
0-2, the persistent unit of stage 3) always show the full parameters.
"""

from __future__ import annotations

import torch.nn as nn

from .dtensor import to_dtensor


class ModuleView:
    """The registrations of one unit's parameters on the module, and what they show."""

    def __init__(self, unit) -> None:
        index = {id(p): i for i, p in enumerate(unit.params)}
        self.places = [(m, name, index[id(p)], _plain(m)) for m in unit.module.modules()
                       for name, p in m._parameters.items() if p is not None and id(p) in index]
        """(module, attribute name, parameter index, whether the module keeps torch's own
        ``__setattr__``) of every registration (tied parameters have several)."""
        self.sharded: list[nn.Parameter] | None = None
        """What a released unit shows: its rows of each parameter, as DTensors."""
        if unit.w_shard is not None:
            rows = unit.w_layout.shard_views(unit.w_shard, unit.rank)
            self.sharded = [nn.Parameter(to_dtensor(unit, i, r), requires_grad=p.requires_grad)
                            for i, (r, p) in enumerate(zip(rows, unit.params))]

    def show(self, params: list[nn.Parameter]) -> None:
        """Register ``params[i]`` under every name of parameter i."""
        for module, name, i, plain in self.places:
            if plain:
                module._parameters[name] = params[i]  # FSDP2's fast path
            else:  # a module with its own __setattr__ sees the change
                setattr(module, name, params[i])



def _plain(module: nn.Module) -> bool:
    """Whether ``module`` sets attributes with ``nn.Module.__setattr__`` itself (FSDP2's
    ``unsafe_setattr_param`` asks the same)."""
    return getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__
