"""The order in which an epoch visits a split's windows: a keyed pseudo-random permutation
of ``0 .. n-1`` evaluated one index at a time, so no rank ever builds the whole
permutation (a 100-billion-token corpus at 1,024 tokens a window has ~10^8 windows, and
``torch.randperm`` of that is 800 MB per rank per epoch).

The permutation is a four-round balanced Feistel network on the smallest even number of
bits that covers ``n``, walked in cycles until the value falls below ``n`` (Black and
Rogaway, "Ciphers with Arbitrary Finite Domains", CT-RSA 2002): a Feistel network is a
bijection for any round function, and cycle walking restricts a bijection of a larger
domain to ``0 .. n-1`` while keeping it one. The round function is SplitMix64's finaliser
(Steele, Lea and Flood, OOPSLA 2014).
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 4
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _keys(*parts: object) -> list[np.uint64]:
    """One 64-bit round key per round, from the text of ``parts`` (any ints, negative
    seeds included)."""
    text = ":".join(str(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8 * _ROUNDS).digest()
    return [np.uint64(int.from_bytes(digest[8 * r:8 * r + 8], "little"))
            for r in range(_ROUNDS)]


def _mix(z: np.ndarray, key: np.uint64) -> np.ndarray:
    z = (z + key) * _GAMMA  # uint64 arrays wrap modulo 2**64, which is what a hash wants
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, n: int, *key: object) -> np.ndarray:
    """Element ``index`` (an int array, each in ``0 .. n-1``) of the permutation of
    ``0 .. n-1`` keyed by ``key``; the same key always gives the same permutation."""
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return index.astype(np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _keys(*key)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << shift) | right

    out = encrypt(index)
    outside = out >= np.uint64(n)
    while outside.any():  # the domain is under 4n, so few values walk more than a few steps
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
