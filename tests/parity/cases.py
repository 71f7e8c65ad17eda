"""Models, optimizers, batches and the deliberately wrong doubles the parity tests hand to
``zs.verify`` (importable by name: the ranks unpickle them)."""

from __future__ import annotations

import torch

from zeroshard.models.gpt import GPT, get_preset


def gpt() -> torch.nn.Module:
    """The built-in GPT at its tiny preset (the loss is its forward's, given targets)."""
    return GPT(get_preset("tiny"))


class LlamaLoss(torch.nn.Module):
    """A Hugging Face Llama of a few thousand parameters (grouped key/value heads), its
    loss the next-token cross-entropy of ``(x, y)``."""

    def __init__(self):
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        self.lm = transformers.LlamaForCausalLM(cfg)

    def forward(self, x, y):
        logits = self.lm(input_ids=x, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), y.reshape(-1))


def llama() -> torch.nn.Module:
    return LlamaLoss()


def batches(steps: int = 3, rows: int = 4, seq: int = 16, vocab: int = 64) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        t = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _hidden(model) -> tuple[list, list]:
    """(hidden matrices, the rest): Muon's and AdamW's, embeddings and heads with AdamW."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    outer = ("wte", "wpe", "embed", "lm_head", "head")
    hidden = [p for n, p in named if p.dim() == 2 and not any(o in n for o in outer)]
    ids = {id(p) for p in hidden}
    return hidden, [p for _, p in named if id(p) not in ids]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def muon(model):
    hidden, rest = _hidden(model)
    return [torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-2)]


def adafactor(model):
    return torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)


OPTIMIZERS = {"adamw": adamw, "muon": muon, "adafactor": adafactor}


class AdamW(torch.optim.Optimizer):
    """A test double: normalised SGD (each update divided by its tensor's norm) under an
    elementwise optimizer's name, so the engine steps it on each rank's rows — which it
    then treats as the whole tensor, dividing by the norm of the rows it holds."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


def rows_as_whole(model):
    return AdamW(model.parameters())


def gpt_with_a_wrong_divisor() -> torch.nn.Module:
    """A test double: the engine's reduce-scatter made to sum without dividing by N (the
    patch lives in the rank that builds the model: the ranks are fresh processes)."""
    from zeroshard.runtime import collectives

    original = collectives.Collectives.reduce_scatter

    def reduce_scatter(self, out, inp, *, mean=False, async_op=False, unit=None):
        return original(self, out, inp, mean=False, async_op=async_op, unit=unit)

    collectives.Collectives.reduce_scatter = reduce_scatter
    return gpt()


def nondeterministic() -> torch.nn.Module:
    """A model whose weights depend on the process that builds it."""
    import os

    torch.manual_seed(os.getpid())
    return gpt()
