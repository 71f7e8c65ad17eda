"""Architectures: parameter counts from transformer dimensions, and presets.

A decoder-only transformer of hidden size h, L layers, vocabulary V holds

- embeddings ``V·h`` (plus ``max_positions·h`` for learned positions), and a separate
  ``V·h`` head unless it is tied to the embedding;
- per layer: attention ``h·q + 2·h·kv + q·h`` (q = heads·head_dim; the k and v
  projections kv = kv_heads·head_dim wide, smaller under grouped-query attention), an
  MLP of ``3·h·f`` (gated: gate, up, down) or ``2·h·f`` (plain), ``norms`` norms of h
  (two, Gemma-2 four), Qwen3's per-head q and k norms (``2·head_dim``), and biases where
  the family has them;
- a final norm.

The root unit (what the engine keeps outside the blocks: embeddings, final norm, head)
and one block are :attr:`Architecture.root_params` and :attr:`Architecture.block_params`.
Every preset and every ``--hf-config`` family is checked in the tests against the model
transformers itself builds on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.formulas import ceil_div
from ..spec.lora import MODULES

#: Activation-model families (``plan/activations.py``): GPT-2's sequential pre-norm
#: block with LayerNorm and a GELU MLP; Llama's with RMSNorm and SwiGLU (Mistral,
#: Qwen2, Qwen3); GPT-NeoX's parallel residual; Gemma-2's four norms and soft-capping.
FAMILIES = ("gpt", "llama", "neox", "gemma2")
#: How each family's layers are named, unless an architecture says otherwise.
_NAMING = {"gpt": "gpt2", "llama": "llama", "neox": "neox", "gemma2": "llama"}


@dataclass(frozen=True)
class Architecture:
    """Dimensions of a decoder-only transformer; validated at construction."""

    name: str
    """Label shown in tables."""
    hidden: int
    """Model width h."""
    layers: int
    """Number of transformer blocks L."""
    heads: int
    """Attention heads a (the activation model needs it)."""
    ffn: int
    """MLP inner width f."""
    vocab: int
    """Vocabulary size V."""
    kv_heads: int | None = None
    """Key/value heads under grouped-query attention; None means ``heads``."""
    head_dim: int | None = None
    """Per-head width; None means ``hidden // heads``."""
    tied: bool = False
    """The output head shares the token-embedding matrix."""
    max_positions: int = 0
    """Rows of a learned position embedding (GPT-2); 0 for rotary models."""
    gated_mlp: bool = True
    """Three MLP matrices (SwiGLU: gate, up, down) instead of two."""
    norm_bias: bool = False
    """Norms carry a bias (LayerNorm) rather than a weight only (RMSNorm)."""
    linear_bias: bool = False
    """Every attention and MLP projection carries a bias (GPT-2, GPT-NeoX)."""
    qkv_bias: bool = False
    """The q, k and v projections carry a bias (Qwen2; Llama's ``attention_bias``)."""
    o_bias: bool = False
    """The attention output projection carries a bias (Llama's ``attention_bias``)."""
    mlp_bias: bool = False
    """The MLP projections carry biases (Llama's ``mlp_bias``)."""
    qk_norm: bool = False
    """An RMSNorm of head_dim on every query and key head (Qwen3)."""
    norms: int = 2
    """Norms per block (Gemma-2: four, around attention and around the MLP)."""
    family: str = "llama"
    """Activation-model family, one of :data:`FAMILIES`."""
    gelu_tanh_unfused: bool = False
    """GPT-2's ``gelu_new``: the tanh GELU written as separate operations, three more
    MLP-wide tensors saved than a fused GELU."""
    dropout: float = 0.0
    """Dropout on the residual stream after attention and after the MLP (GPT-2's
    ``resid_pdrop``); it keeps a mask per element in training."""
    embedding_dropout: float = 0.0
    """Dropout on the embeddings' output (GPT-2's ``embd_pdrop``)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (GPT-2's ``attn_pdrop``)."""
    rotary_fraction: float = 1.0
    """Of each head's dimensions, the share a rotary model rotates (GPT-NeoX's
    ``partial_rotary_factor``, 0.25 in Pythia): the width of its cos and sin tables."""
    naming: str = ""
    """How its block's layers are named (LoRA's targets, ``spec/lora.py`` ``MODULES``):
    ``llama`` (Mistral, Qwen and Gemma-2 too), ``gpt2``, ``neox``, ``zeroshard`` (the
    built-in GPT); empty: the family's (a GPT-NeoX without parallel residuals is of the
    ``gpt`` family but named as ``neox``)."""

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "ffn", "vocab", "norms"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field}={value!r} must be a positive integer")
        for field in ("kv_heads", "head_dim"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{self.name}: {field}={value!r} must be a positive integer")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"{self.name}: hidden={self.hidden} is not divisible by heads={self.heads}; "
                "give head_dim explicitly"
            )
        for field in ("dropout", "embedding_dropout", "attention_dropout"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{self.name}: {field}={value!r} must be in [0, 1)")
        if self.max_positions < 0:
            raise ValueError(f"{self.name}: max_positions={self.max_positions} must be >= 0")
        r = self.rotary_fraction
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"{self.name}: rotary_fraction={r!r} must be in (0, 1]")
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family={self.family!r}; expected one of "
                             f"{', '.join(FAMILIES)}")
        if not self.naming:
            object.__setattr__(self, "naming", _NAMING[self.family])
        if self.naming not in MODULES:
            raise ValueError(f"{self.name}: naming={self.naming!r}; expected one of "
                             f"{', '.join(MODULES)}")

    def tp_sizes(self) -> dict[str, int]:
        """What tensor parallelism's plan splits in this model (``plan/tp.py``): the
        heads, the key/value heads, the MLP width, and the vocabulary where the
        embedding and head are split (every family but the built-in GPT's)."""
        sizes = {"attention heads": self.heads, "key/value heads": self.kv_heads or self.heads,
                 "MLP width": self.ffn}
        if self.family != "gpt":
            sizes["vocabulary"] = self.vocab
        return sizes

    @property
    def dim(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Query width heads·head_dim (= h unless head_dim is given)."""
        return self.heads * self.dim

    @property
    def kv_width(self) -> int:
        """Key (and value) width kv_heads·head_dim."""
        return (self.kv_heads or self.heads) * self.dim

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block."""
        h, f, q, kv = self.hidden, self.ffn, self.q_width, self.kv_width
        matrices = (3 if self.gated_mlp else 2) * f
        per_layer = h * q + 2 * h * kv + q * h + matrices * h
        per_layer += self.norms * h * (2 if self.norm_bias else 1)
        if self.qk_norm:
            per_layer += 2 * self.dim
        if self.linear_bias or self.qkv_bias:
            per_layer += q + 2 * kv
        if self.linear_bias or self.o_bias:
            per_layer += h
        if self.linear_bias or self.mlp_bias:
            per_layer += (2 if self.gated_mlp else 1) * f + h
        return per_layer

    @property
    def root_params(self) -> int:
        """Embeddings, the final norm and an untied head: the root unit, which stage 3
        gathers at the first forward and again at the start of backward."""
        h = self.hidden
        head = 0 if self.tied else self.vocab * h
        return (self.vocab + self.max_positions) * h + h * (2 if self.norm_bias else 1) + head

    @property
    def params(self) -> int:
        """Total parameter count, norms and biases included."""
        return self.root_params + self.layers * self.block_params


def _llama(name, hidden, layers, heads, ffn, vocab=32000, kv_heads=None, tied=False, **kw):
    return Architecture(name, hidden, layers, heads, ffn, vocab, kv_heads=kv_heads, tied=tied,
                        **kw)


def _gpt2(name, hidden, layers, heads):
    return Architecture(
        name, hidden, layers, heads, 4 * hidden, 50257, tied=True, max_positions=1024,
        gated_mlp=False, norm_bias=True, linear_bias=True, family="gpt",
        gelu_tanh_unfused=True,
    )


PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        _llama("llama2-7b", 4096, 32, 32, 11008),
        _llama("llama2-13b", 5120, 40, 40, 13824),
        _llama("llama2-70b", 8192, 80, 64, 28672, kv_heads=8),
        _llama("llama3-8b", 4096, 32, 32, 14336, vocab=128256, kv_heads=8),
        _llama("llama3-70b", 8192, 80, 64, 28672, vocab=128256, kv_heads=8),
        _llama("mistral-7b", 4096, 32, 32, 14336, kv_heads=8),
        # Qwen/Qwen2.5-7B and Qwen/Qwen3-8B, google/gemma-2-9b: their config.json files
        _llama("qwen2.5-7b", 3584, 28, 28, 18944, vocab=152064, kv_heads=4, qkv_bias=True),
        _llama("qwen3-8b", 4096, 36, 32, 12288, vocab=151936, kv_heads=8, head_dim=128,
               qk_norm=True),
        _llama("gemma2-9b", 3584, 42, 16, 14336, vocab=256000, kv_heads=8, head_dim=256,
               tied=True, norms=4, family="gemma2"),
        _gpt2("gpt2", 768, 12, 12),
        _gpt2("gpt2-medium", 1024, 24, 16),
        _gpt2("gpt2-large", 1280, 36, 20),
        _gpt2("gpt2-xl", 1600, 48, 25),
        Architecture(
            "pythia-160m", 768, 12, 12, 3072, 50304, gated_mlp=False, norm_bias=True,
            linear_bias=True, family="neox", rotary_fraction=0.25,
        ),
    )
}


def get_preset(name: str) -> Architecture:
    """A preset by name; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(PRESETS)}"
        ) from None


@dataclass(frozen=True)
class ModelSpec:
    """What the memory model needs: a parameter count and, for activations, shape."""

    name: str
    """Label shown in tables."""
    params: int
    """Total parameters P."""
    hidden: int | None = None
    """Width h; without it and ``layers`` activations are not modelled."""
    layers: int | None = None
    """Transformer blocks L."""
    heads: int | None = None
    """Attention heads; only the no-flash-attention formula needs them."""
    arch: Architecture | None = None
    """The full architecture when known: the activation model of its family, the output
    layer and loss, and the real root and block sizes. None (a bare count): the source
    documents' Korthikanti et al. constants and units of P / L."""
    shapes: tuple[tuple[int, ...], ...] | None = None
    """Every parameter's shape, where the optimizer's bytes depend on them (Muon,
    Adafactor): an ``nn.Module``'s own; an architecture's come from ``plan/shapes.py``."""
    trainable: int | None = None
    """Parameters that train, of ``params`` (LoRA's adapters, ``plan/adaptercount.py``): they
    alone have gradients and optimizer state. None: every one."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, int) or self.params <= 0:
            raise ValueError(f"params={self.params!r} must be a positive integer")
        if self.trainable is not None and not (isinstance(self.trainable, int)
                                               and 0 <= self.trainable <= self.params):
            raise ValueError(f"trainable={self.trainable!r} must be an integer in [0, "
                             f"params={self.params}]")
        for field in ("hidden", "layers", "heads"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{field}={value!r} must be a positive integer")

    @classmethod
    def from_arch(cls, arch: Architecture) -> ModelSpec:
        return cls(arch.name, arch.params, arch.hidden, arch.layers, arch.heads, arch)

    @classmethod
    def from_module(cls, module, name: str | None = None) -> ModelSpec:
        """Count an ``nn.Module``'s parameters (each shared tensor once).

        Duck-typed, so this module still imports no torch."""
        seen, total, shapes = set(), 0, []
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
                shapes.append(tuple(p.shape))
        return cls(name or type(module).__name__, total, shapes=tuple(shapes))

    @property
    def activations_modelled(self) -> bool:
        return self.hidden is not None and self.layers is not None

    @property
    def block_params(self) -> int:
        """One block's parameters; P / L for a bare count (embeddings spread over the
        blocks), P for a model without layers."""
        if self.arch is not None:
            return self.arch.block_params
        return ceil_div(self.params, self.layers or 1)

    @property
    def root_params(self) -> int:
        """The root unit (embeddings, final norm, head); for a bare count, P / L."""
        return self.arch.root_params if self.arch is not None else self.block_params
