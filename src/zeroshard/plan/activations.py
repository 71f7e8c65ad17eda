"""Activations: the bytes autograd saves for backward, per architecture family.

Counted per token as the engine's profiler counts them (every tensor autograd saves, its
storage once, from the moment it is saved until backward unpacks it), with b the bytes
of the activation dtype, h the width, f the MLP width, q = heads·head_dim, kv =
kv_heads·head_dim, a heads and s the sequence length. Each family is written as its
Hugging Face implementation runs (transformers 5; the built-in GPT is the "gpt" family):

- **LayerNorm** saves its input, mean and rstd (2 of dtype b) and the next linear its
  output: ``2·b·h + 2·b`` (the input may already be counted).
- **RMSNorm** (Llama, Qwen, Mistral) upcasts to fp32: the fp32 input (4h), rstd (4),
  the normalised tensor back in b (``b·h``) and its output ``b·h`` saved by the next
  linear: ``(4 + 2b)·h + 4``. Gemma-2's multiplies by ``1 + weight`` in fp32, so it keeps
  the fp32 normalised tensor: ``8h + 4``, plus ``b·h`` where a linear follows.
- **Attention with flash** (``scaled_dot_product_attention``'s flash kernel) saves q,
  k, v, its output and the fp32 log-sum-exp per head, ``4a``; GPT-2's and NeoX's fused
  qkv projection keep its whole ``3q`` storage alive through the v view.
- **Attention without flash** (transformers' eager path): q, k and v (k and v repeated
  to q's width under grouped-query attention), the s×s probabilities and the output
  copy for the output projection; Llama, NeoX and Gemma-2 take the softmax in fp32 and
  cast it back, keeping both (``a·s·(4 + b)`` per token, ``4·a·s`` in fp32), GPT-2 in
  its dtype (``a·s·b``); Gemma-2's soft-capping keeps its tanh (``a·s·b``) too.
- **MLP**: GELU keeps fc's output and its own (``2·b·f``; GPT-2's ``gelu_new``, written
  as separate operations, three more); SwiGLU/GeGLU gate, activation, up and product
  (``4·b·f``).
- **Output layer and loss**: the final norm, the fp32 log-softmax over the vocabulary
  (``4V``: the loss upcasts the logits, cross-entropy keeps its log-softmax), the labels
  (int64, 8) and Gemma-2's logit soft-capping (``b·V``); the input ids (8).

Dropout where the architecture has it (GPT-2's configs: 0.1 on the residual stream, the
embeddings and the attention probabilities; Llama-family models train without) keeps a
mask per element it touches: one byte on CUDA (``native_dropout``), a noise tensor of
the activation dtype on CPU (torch's ``_dropout_impl``: ``input * noise``). Attention
dropout keeps flash on CUDA (its kernel draws the mask from a saved seed), but on CPU,
whose flash kernel has no dropout, ``scaled_dot_product_attention`` takes its math path:
q, k and v scaled or copied in fp32 (``12·q`` bytes), the fp32 probabilities, noise and
dropped probabilities (``12·a·s``) and the output copied for the output projection
(``b·q``); without flash, transformers' eager path adds the mask and the dropped
probabilities (``a·s·(m + b)``). Measured on CPU with the profiler for every family at
two sequence lengths and two micro-batches, fp32 and bf16, flash and eager, in
``tests/plan/test_activations.py`` (within 2 %); GPT-2 with dropout in a profiled
``zeroshard train --hf-model`` run (``tests/plan/test_peak.py``).

Checkpointing (``Workload.checkpointing``; ``runtime/checkpointing.py`` is what it
models): every k-th block (``checkpoint_every``; torchtitan's per-layer checkpointing)
keeps only what its mode keeps, the others everything; during backward one checkpointed
block is recomputed at a time, after the output layer's tensors are gone, while the
input ids wait for the embedding's backward. Measured with the profiler, which counts a
checkpoint's holdings (``tests/plan/test_checkpointing.py``):

- **full** keeps the block input (``b·h``). The recompute saves the block's tensors
  again but for that input where the block saves it as it is (a LayerNorm does; an
  RMSNorm only in fp32, where its upcast is the tensor itself).
- **selective** keeps the outputs of the linear layers too (the matrix multiplications:
  ``3q`` fused or ``q + 2kv``, ``h``, ``f`` or ``2f`` gated, ``h``; the column-parallel
  ones split by tensor parallelism), and recomputes the rest; of those outputs the
  block itself saves v (``kv``, with flash or no repetition), the MLP's input
  projections (``f``, ``2f`` gated) and a fused qkv (``3q``, with flash: the eager path
  saves copies of q, k and v), under qk-norms in fp32 q and k, and Gemma-2's post-norms
  in fp32 the output projections': its recompute does not save those again.
- **full+offload** keeps the block input in host memory: on a device none of it, and the
  recompute saves its own copy; on the CPU it is "full".
- A rotary model's blocks share the cos and sin tables (``2·s·d·b`` per sequence
  position, batch 1, d the rotated share of the head dimension), which the rotation
  saves and a checkpoint holds as its arguments, and so the eager path's additive
  causal mask (``s·b`` per token; Gemma-2 has a second for its sliding window), which
  no block saves without checkpointing.

A bare parameter count (no family) keeps Korthikanti et al.'s constants, as the source
documents write them: ``34·t·h`` 16-bit bytes per layer plus ``5·a·s·t`` without flash.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.formulas import ceil_div
from .arch import Architecture

#: Bytes per token of the int64 input ids the embedding keeps, and of the loss's labels.
INDEX_BYTES = 8


def _eager_softmax(b: int) -> int:
    """Bytes per s×s element of transformers' fp32 softmax and its cast back to b."""
    return 4 + (b if b < 4 else 0)


def _norm(arch: Architecture, b: int, width: int, groups: int = 1) -> int:
    """One norm of ``width`` elements (``groups`` statistics), without its output."""
    if arch.norm_bias:  # LayerNorm: mean and rstd in the activation dtype
        return 2 * b * groups
    if arch.family == "gemma2":
        return 8 * width + 4 * groups
    return (4 + b) * width + 4 * groups


def _mask(b: int, cpu: bool) -> int:
    """Bytes per element a dropout keeps: CUDA's bool mask, CPU's noise in dtype b."""
    return b if cpu else 1


def block_parts(arch: Architecture, b: int, seq: int, flash: bool,
                batch: int = 2, cpu: bool = False) -> tuple[int, int]:
    """(replicated, split) bytes per token of one block of ``batch`` sequences: the
    norms and the block input, which tensor parallelism replicates, and attention and
    MLP, which it splits; ``cpu``: dropout as it runs on CPU."""
    h, f, q, kv, a = arch.hidden, arch.ffn, arch.q_width, arch.kv_width, arch.heads
    fam = arch.family
    if fam == "gpt":  # the block input and the residual before ln2: two LayerNorm inputs
        norms = 2 * (b * h + _norm(arch, b, h) + b * h)
    elif fam == "neox":  # one input feeds both LayerNorms (parallel residual)
        norms = b * h + 2 * (_norm(arch, b, h) + b * h)
    elif fam == "gemma2":  # four norms, two feeding a linear
        norms = 4 * _norm(arch, b, h) + 2 * b * h
    else:
        norms = 2 * (_norm(arch, b, h) + b * h)
    if arch.qk_norm:
        norms += _norm(arch, b, q, a) + _norm(arch, b, kv, arch.kv_heads or a)
    if arch.dropout:  # after the attention's and the MLP's output projections
        norms += 2 * _mask(b, cpu) * h
    if arch.attention_dropout and flash and cpu:  # the math path (module docstring)
        attn = 12 * q + 12 * a * seq + b * q
    elif flash:
        lse = 4 * a
        if fam == "gpt":
            attn = 3 * b * q + b * q + lse  # the fused qkv storage; the output
        elif fam == "neox":
            attn = 2 * b * q + 3 * b * q + 2 * b * q + lse  # rotated q, k; qkv; output, copy
        else:
            attn = b * (2 * q + 2 * kv) + lse
    else:
        probs = a * seq * (b if fam == "gpt" else _eager_softmax(b))
        if fam == "gemma2":
            probs += a * seq * b  # the soft-cap's tanh
        if arch.attention_dropout:
            probs += a * seq * (_mask(b, cpu) + b)
        attn = 4 * b * q + probs
        if fam == "neox" and batch == 1:  # v stays a view of the fused qkv output
            attn += 2 * b * q
    mlp = (4 if arch.gated_mlp else 2) * b * f
    if arch.gelu_tanh_unfused:
        mlp += 3 * b * f
    return norms, attn + mlp


def loss_bytes(arch: Architecture) -> int:
    """Bytes per token the loss itself saves, whatever the logits' dtype: its fp32
    log-softmax over the vocabulary (``4V``) and the int64 labels."""
    return 4 * arch.vocab + INDEX_BYTES


def head_bytes(arch: Architecture, b: int, cpu: bool = False) -> int:
    """Bytes per token of the final norm, the output layer and the loss, and the
    embedding's input ids (and its dropout's mask)."""
    h, v = arch.hidden, arch.vocab
    norm = _norm(arch, b, h) + b * h + (b * h if arch.norm_bias else 0)
    softcap = b * v if arch.family == "gemma2" else 0
    return norm + softcap + loss_bytes(arch) + _embedding_bytes(arch, b, cpu)


def _embedding_bytes(arch: Architecture, b: int, cpu: bool) -> int:
    """Bytes per token the embedding keeps to the end of backward: the input ids and
    its dropout's mask."""
    return INDEX_BYTES + (_mask(b, cpu) * arch.hidden if arch.embedding_dropout else 0)


def loss_backward_bytes(arch: Architecture) -> int:
    """Bytes per token alive beside the saved tensors while the loss runs backward: the
    dense fp32 gradient of the log-softmax output (from the loss) and of the logits
    (from the log-softmax's backward), ``8V``; the cast of the latter to the head's
    dtype comes after the first is freed. Autograd's own gradients, which the
    profiler's saved-tensor count does not see."""
    return 8 * arch.vocab


@dataclass(frozen=True)
class Saved:
    """A micro-batch's saved bytes, by when backward frees them."""

    blocks: int
    """Every block's at the end of the forward (a checkpointed block: what its mode
    keeps)."""
    recompute: int = 0
    """One checkpointed block's recompute, beyond what the block kept: 0 without
    checkpointing."""
    head: int = 0
    """The output layer's and the loss's, the input ids included: gone once the head's
    backward ran, before any block is recomputed."""
    kept: int = 0
    """Of ``head``, what outlives every block's backward: the embedding's input ids."""

    @property
    def peak(self) -> int:
        """The most saved at once: every block's with the head's, or with one recomputed
        block's and the input ids."""
        return self.blocks + max(self.head, self.recompute + self.kept)


#: What a checkpointed block keeps on the device, per ``Workload.checkpoint_mode``.
KEEPS = ("input", "linear", "host")


def _linear_outputs(arch: Architecture, b: int, tp: int) -> tuple[int, int]:
    """(replicated, split) bytes per token of a block's linear layers' outputs: the
    output projections' (partial sums, full width under tensor parallelism), and the qkv
    and MLP input projections'."""
    h, f, q, kv = arch.hidden, arch.ffn, arch.q_width, arch.kv_width
    qkv = 3 * q if arch.family in ("gpt", "neox") else q + 2 * kv
    mlp_in = (2 if arch.gated_mlp else 1) * f
    return 2 * b * h, ceil_div(b * (qkv + mlp_in), tp)


def _saved_again(arch: Architecture, b: int, flash: bool, keep: str, tp: int,
                 batch: int) -> int:
    """Bytes per token a checkpointed block's recompute saves that the block kept already
    (the same storage, counted once): its input where the first norm saves it as it is,
    and under "linear" the linear outputs the block itself saves (module docstring)."""
    if keep == "host":
        return 0
    h, f, q, kv = arch.hidden, arch.ffn, arch.q_width, arch.kv_width
    same = b * h if arch.norm_bias or b == 4 else 0
    if keep == "input":
        return same
    if arch.family in ("gpt", "neox"):  # eager attention saves copies of q, k and v
        split = 3 * q if flash or (arch.family == "neox" and batch == 1) else 0
    else:
        repeated = not flash and (arch.kv_heads or arch.heads) != arch.heads
        split = 0 if repeated else kv
        if arch.qk_norm and b == 4:
            split += q + kv
    split += (2 if arch.gated_mlp else 1) * f
    if arch.family == "gemma2" and b == 4 and tp == 1:  # its post-norms save their inputs
        same += 2 * b * h
    return same + ceil_div(b * split, tp)


def _rotary_tables(arch: Architecture, b: int, seq: int) -> int:
    """Bytes of a rotary model's cos and sin tables (batch 1), shared by every block."""
    if arch.max_positions:
        return 0
    return 2 * seq * int(arch.q_width // arch.heads * arch.rotary_fraction) * b


def family_saved(arch: Architecture, b: int, tokens: int, seq: int, flash: bool,
                 checkpoint_every: int | None, tp: int = 1, cpu: bool = False,
                 keep: str = "input") -> Saved:
    """The :class:`Saved` bytes of a micro-batch of ``tokens`` tokens (sequences of
    ``seq``): every block, or with checkpointing every k-th block's ``keep`` (one of
    :data:`KEEPS`) and one recomputed block, and the output layer and loss; ``cpu``:
    dropout as on CPU."""
    replicated, split = block_parts(arch, b, seq, flash, tokens // seq, cpu)
    block = tokens * replicated + ceil_div(tokens * split, tp)
    head = tokens * head_bytes(arch, b, cpu)
    kept = tokens * _embedding_bytes(arch, b, cpu)
    shared = _rotary_tables(arch, b, seq)
    if checkpoint_every is None:
        return Saved(arch.layers * block + shared, 0, head, kept)
    holds = {"input": b * arch.hidden, "host": 0}.get(keep)
    if holds is None:
        rep, spl = _linear_outputs(arch, b, tp)
        holds = b * arch.hidden + rep + spl
    ckpt = arch.layers // checkpoint_every
    stored = (arch.layers - ckpt) * block + ckpt * tokens * holds + shared
    again = tokens * _saved_again(arch, b, flash, keep, tp, tokens // seq)
    masks = 0 if flash else tokens * seq * b * (2 if arch.family == "gemma2" else 1)
    return Saved(stored + masks, block - again, head, kept)


def family_bytes(arch: Architecture, b: int, tokens: int, seq: int, flash: bool,
                 checkpoint_every: int | None, tp: int = 1) -> int:
    """Peak saved bytes of a micro-batch (:attr:`Saved.peak` of :func:`family_saved`)."""
    return family_saved(arch, b, tokens, seq, flash, checkpoint_every, tp).peak


def korthikanti_saved(hidden: int, layers: int, heads: int | None, b: int, tokens: int,
                      seq: int, flash: bool, checkpointing: bool,
                      tp: int = 1, keep: str = "input") -> Saved | None:
    """The source documents' formula for a bare count: per layer ``t·h·(10 + 24/K)``
    16-bit bytes plus ``5·a·s·t/K`` without flash (Korthikanti et al., 2022, eq. 3);
    with checkpointing the L layer inputs plus one layer's recompute (selective: the
    inputs and the linear layers' outputs of a GPT block, ``10·t·h`` elements with
    ``f = 4h``; offloaded: nothing on the device). No output layer: a bare count has no
    vocabulary."""
    per_layer_16bit = ceil_div((10 * tp + 24) * tokens * hidden, tp)
    if not flash:
        if heads is None:
            if not checkpointing:
                return None
        else:
            per_layer_16bit += ceil_div(5 * heads * seq * tokens, tp)
    if not checkpointing:
        return Saved(layers * per_layer_16bit * b // 2)
    holds = {"input": 1, "host": 0}.get(keep, 10)  # elements of t·h per layer
    return Saved(tokens * hidden * layers * b * holds, per_layer_16bit * b // 2)


def korthikanti_bytes(hidden: int, layers: int, heads: int | None, b: int, tokens: int,
                      seq: int, flash: bool, checkpointing: bool, tp: int = 1) -> int | None:
    """Peak saved bytes of :func:`korthikanti_saved`; None when the heads are needed and
    unknown."""
    saved = korthikanti_saved(hidden, layers, heads, b, tokens, seq, flash, checkpointing, tp)
    return None if saved is None else saved.peak
