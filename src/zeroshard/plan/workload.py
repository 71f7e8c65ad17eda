"""What one rank processes per micro-batch (:class:`Workload`), and the activation
bytes it saves.

Activations are not sharded (each rank runs its own micro-batch). With the
architecture known they follow its family, output layer and loss included
(``plan/activations.py``). For a bare count with a width and depth, the source
documents' formula:

- with activation checkpointing, the layer inputs plus one layer's recompute:
  ``tokens·h·(L + 17)·bytes`` — L inputs of ``tokens·h`` elements, and Korthikanti
  et al.'s 34·tokens·h 16-bit bytes (= 17 elements) for the layer being recomputed,
  plus ``5·a·s·tokens`` when the heads are known and no flash kernel is used;
- without it, Korthikanti et al.'s per-layer ``tokens·h·(34 + 5·a·s/h)`` 16-bit bytes,
  or ``34·tokens·h`` when flash attention never stores the s×s scores.

Tensor parallelism of degree K (``tp``; Shoeybi et al., 2019, "Megatron-LM") splits
every layer's matrices over K GPUs. Activations follow Korthikanti et al. (2022,
eq. 3, tensor parallelism without sequence parallelism): per layer
``tokens·h·(10 + 24/K + 5·a·s/(h·K))`` 16-bit bytes, since the layer norms, dropouts
and layer inputs stay replicated. TP's own traffic is activations: two all-reduces of
``tokens·h`` elements in forward and two in backward per layer (the f and g operators
of Megatron-LM, fig. 4), and two more when checkpointing recomputes the forward. With
``tp = 1`` every formula is the one above, to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.formulas import ring_all_reduce
from ..spec.recipes import Recipe
from .activations import Saved, family_saved, korthikanti_saved
from .arch import ModelSpec
from .tp import tp_layer_collectives, tp_root_bytes

#: What a checkpointed block keeps (``Workload.checkpoint_mode``).
CHECKPOINT_MODES = ("full", "selective", "full+offload")


@dataclass(frozen=True)
class Workload:
    """What one rank processes per micro-batch; drives the activation model."""

    tokens: int = 2048
    """Tokens per micro-batch per GPU (sequence length × micro-batch size)."""
    seq_len: int | None = None
    """Sequence length s for the attention term; None means ``tokens`` (batch 1)."""
    checkpointing: bool = True
    """Activation checkpointing: keep block inputs only, recompute in backward."""
    flash_attention: bool = False
    """Attention through a flash kernel: the s×s probabilities are never stored, in the
    forward nor in a checkpointed block's recompute."""
    checkpoint_every: int = 1
    """With checkpointing: every k-th block is checkpointed, the others keep everything
    (torchtitan's per-layer selective checkpointing); 1 is full checkpointing."""
    cpu: bool = False
    """The step runs on CPU: dropout keeps noise of the activation dtype, and attention
    with dropout takes the math path (``plan/activations.py``)."""
    checkpoint_mode: str = "full"
    """With checkpointing, what a checkpointed block keeps (``ZeroConfig.
    activation_checkpointing``'s modes): "full" its input; "selective" its input and its
    linear layers' outputs; "full+offload" its input in host memory (on a device)."""

    @classmethod
    def of_mode(cls, tokens: int, seq_len: int | None, mode: str | int, **kw) -> Workload:
        """The workload of a ``ZeroConfig.activation_checkpointing`` mode ("none", "full",
        "selective", "full+offload" or every k-th block)."""
        if mode == "none":
            return cls(tokens, seq_len, False, **kw)
        if isinstance(mode, int):
            return cls(tokens, seq_len, True, checkpoint_every=mode, **kw)
        return cls(tokens, seq_len, True, checkpoint_mode=mode, **kw)

    @property
    def mode(self) -> str | int:
        """This workload's checkpointing as ``ZeroConfig.activation_checkpointing``
        writes it."""
        if not self.checkpointing:
            return "none"
        return self.checkpoint_every if self.checkpoint_every > 1 else self.checkpoint_mode

    @property
    def keep(self) -> str:
        """What a checkpointed block keeps on the device (``plan/activations.py``'s
        ``KEEPS``): host memory holds an offloaded input only where a device runs."""
        if self.checkpoint_mode == "full+offload":
            return "input" if self.cpu else "host"
        return {"full": "input", "selective": "linear"}[self.checkpoint_mode]

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens={self.tokens!r} must be a positive integer")
        if self.seq_len is not None:
            if not isinstance(self.seq_len, int) or self.seq_len <= 0:
                raise ValueError(f"seq_len={self.seq_len!r} must be a positive integer")
            if self.tokens % self.seq_len:
                raise ValueError(
                    f"tokens={self.tokens} is not a multiple of seq_len={self.seq_len}"
                )
        k = self.checkpoint_every
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"checkpoint_every={k!r} must be a positive integer")
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint_mode={self.checkpoint_mode!r}; expected one of "
                             f"{', '.join(map(repr, CHECKPOINT_MODES))}")
        if k > 1 and self.checkpoint_mode != "full":
            raise ValueError(f"checkpoint_every={k} checkpoints every k-th block in full; "
                             f"checkpoint_mode={self.checkpoint_mode!r} goes with k = 1")


def activation_saved(model: ModelSpec, recipe: Recipe, work: Workload,
                     tp: int = 1) -> Saved | None:
    """Activation bytes per GPU by when backward frees them (``plan/activations.py``):
    the family's model when the architecture is known (output layer and loss included),
    else the source documents' Korthikanti et al. constants; None when the shape is
    unknown."""
    if not model.activations_modelled:
        return None
    b, seq = recipe.activation_bytes, work.seq_len or work.tokens
    every = work.checkpoint_every if work.checkpointing else None
    if model.arch is not None:
        return family_saved(model.arch, b, work.tokens, seq, work.flash_attention, every, tp,
                            work.cpu, work.keep)
    if every not in (None, 1):
        raise NotImplementedError("checkpointing every k-th block needs the architecture "
                                  "(a preset, --hf-config or dimensions)")
    return korthikanti_saved(model.hidden, model.layers, model.heads, b, work.tokens, seq,
                             work.flash_attention, work.checkpointing, tp, work.keep)


def activation_bytes(model: ModelSpec, recipe: Recipe, work: Workload,
                     tp: int = 1) -> int | None:
    """Activation bytes per GPU at their peak (:attr:`Saved.peak` of
    :func:`activation_saved`); None when the shape is unknown."""
    saved = activation_saved(model, recipe, work, tp)
    return None if saved is None else saved.peak


def tp_comm_bytes(model: ModelSpec, recipe: Recipe, work: Workload, tp: int) -> int:
    """Bytes one GPU sends per micro-batch in TP's activation collectives (``plan/tp.py``):
    per layer r all-reduces of ``tokens·h`` elements in forward and c in backward (a
    bare count: Megatron-LM's 2 and 2), r more for a fully checkpointed block's recomputed
    forward, and the root's (a vocabulary-parallel embedding and output head)."""
    if tp == 1:
        return 0
    if model.hidden is None or model.layers is None:
        raise ValueError("tensor parallelism needs the model's shape: give --hidden and --layers")
    r, c = tp_layer_collectives(model)
    full = work.checkpointing and work.mode != "selective"  # selective keeps what TP reduces
    recomputed = model.layers // work.checkpoint_every if full else 0
    b = recipe.activation_bytes
    one = ring_all_reduce(work.tokens * model.hidden * b, tp)
    return ((model.layers * (r + c) + recomputed * r) * one
            + tp_root_bytes(model, b, work.tokens, tp))
