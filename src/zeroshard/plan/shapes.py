"""Parameter shapes of an architecture, as transformers lays them out, for the
optimizers whose bytes depend on shapes (``plan/placement.py``, ``plan/comm.py``).

A Linear's weight is ``[out, in]`` (dim 0 the rows a rank keeps), except GPT-2's
``Conv1D``, which is ``[in, out]`` and fuses q, k and v into one ``c_attn``; GPT-NeoX
fuses them into one ``query_key_value`` ``[3·h, h]``. The shapes add up to
:attr:`~zeroshard.plan.arch.Architecture.params` (checked in the tests).
"""

from __future__ import annotations

from .arch import Architecture


def arch_shapes(a: Architecture) -> list[tuple[int, ...]]:
    """Every parameter's shape: embeddings, then block by block, the final norm and an
    untied head."""
    h, f, q, kv, v = a.hidden, a.ffn, a.q_width, a.kv_width, a.vocab
    norm = [(h,), (h,)] if a.norm_bias else [(h,)]
    out: list[tuple[int, ...]] = [(v, h)]
    if a.max_positions:
        out.append((a.max_positions, h))
    for _ in range(a.layers):
        out += _block(a, h, f, q, kv, norm)
    out += norm
    if not a.tied:
        out.append((v, h))
    return out


def _block(a: Architecture, h: int, f: int, q: int, kv: int, norm) -> list[tuple[int, ...]]:
    bias = a.linear_bias
    if a.family == "gpt":  # Conv1D [in, out]: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
        mats = [(h, q + 2 * kv), (q, h), (h, f), (f, h)]
        return [*norm, *norm, *mats, (q + 2 * kv,), (h,), (f,), (h,)] if bias else [
            *norm, *norm, *mats]
    if a.family == "neox":  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h
        mats = [(q + 2 * kv, h), (h, q), (f, h), (h, f)]
        return [*norm, *norm, *mats, (q + 2 * kv,), (h,), (f,), (h,)] if bias else [
            *norm, *norm, *mats]
    out = [(q, h), (kv, h), (kv, h), (h, q)]  # q, k, v, o
    if bias or a.qkv_bias:
        out += [(q,), (kv,), (kv,)]
    if bias or a.o_bias:
        out.append((h,))
    out += [(f, h), (f, h), (h, f)] if a.gated_mlp else [(f, h), (h, f)]
    if bias or a.mlp_bias:
        out += [(f,), (f,), (h,)] if a.gated_mlp else [(f,), (h,)]
    if a.qk_norm:
        out += [(a.dim,), (a.dim,)]
    return out + norm * a.norms
