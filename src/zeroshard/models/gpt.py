"""A small GPT: token and position embeddings, pre-norm blocks of causal self-attention
and an MLP, a final norm, and an output head tied to the token embedding (nanoGPT's
shape, so its parameter groups and unit boundaries are the familiar ones).

The query, key and value projections are three linears, as in torchtitan's and
Llama's attention: tensor parallelism (:attr:`GPT.TP_PLAN`) cuts each on its output
rows, which gives a tp rank whole heads; a fused ``[3h, h]`` projection cut the same way
would give the first rank the queries and part of the keys. The three draw their
initial weights from the stream one fused weight would have, in the same order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """Dimensions of the built-in GPT."""

    vocab: int = 256
    """Vocabulary size (256: bytes)."""
    block_size: int = 64
    """Longest sequence (rows of the position embedding)."""
    layers: int = 4
    """Transformer blocks."""
    heads: int = 4
    """Attention heads."""
    hidden: int = 128
    """Model width."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs deterministic)."""
    checkpointing: bool = False
    """Recompute each block's activations in backward (``torch.utils.checkpoint``)
    instead of keeping them: activations shrink to the block inputs."""

    def __post_init__(self) -> None:
        for name in ("vocab", "block_size", "layers", "heads", "hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be positive")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig.hidden={self.hidden} is not divisible by "
                             f"heads={self.heads}")


#: Size presets: "small" (0.84M parameters) for tests and the default run, "medium"
#: (10.8M) for benchmarks.
PRESETS = {
    "tiny": GPTConfig(vocab=256, block_size=32, layers=2, heads=2, hidden=32),
    "small": GPTConfig(vocab=256, block_size=128, layers=4, heads=4, hidden=128),
    "medium": GPTConfig(vocab=256, block_size=256, layers=6, heads=6, hidden=384),
}


def get_preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; expected one of "
                         f"{', '.join(PRESETS)}") from None


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.hidden)
        self.q = nn.Linear(c.hidden, c.hidden)
        self.k = nn.Linear(c.hidden, c.hidden)
        self.v = nn.Linear(c.hidden, c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.ln2 = nn.LayerNorm(c.hidden)
        self.fc = nn.Linear(c.hidden, 4 * c.hidden)
        self.out = nn.Linear(4 * c.hidden, c.hidden)
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        a = self.ln1(x)
        # -1 heads: under tensor parallelism this rank's heads (TP_PLAN)
        q, k, v = (z(a).view(b, t, -1, h // self.heads).transpose(1, 2)
                   for z in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None)`` returns logits, or the
    mean cross-entropy when targets are given."""

    TP_PLAN = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
               "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
    """Tensor parallelism (``models/tpplan.py``; Megatron-LM's split, Shoeybi et al., 2019):
    q, k, v and the MLP's first linear cut on their output rows (whole heads per tp
    rank), the attention's and the MLP's output projections on their input columns and
    summed; embeddings, norms and the tied head stay whole on every tp rank."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.block_size, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.apply(self.init_module)

    @staticmethod
    def init_module(m: nn.Module) -> None:
        """Initialise one module's own parameters (GPT-2's scheme: N(0, 0.02) weights,
        zero biases, unit norms); usable as ``zs.shard(..., param_init=)``."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            m.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size="
                             f"{self.config.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.config.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None, forward=None) -> torch.Tensor:
        """Sample ``new_tokens`` continuations of ``idx`` [b, t]. ``forward`` (default:
        this module) lets a sharded wrapper run the steps; with the same generator seed
        every rank samples the same tokens, so stage 3's gathers stay in step."""
        forward = forward or self
        for _ in range(new_tokens):
            logits = forward(idx[:, -self.config.block_size:])[:, -1, :].float()
            probs = torch.softmax(logits / temperature, dim=-1)
            # sampled on the host, where the generator lives: the same tokens on any device
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator)
            idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        return idx
