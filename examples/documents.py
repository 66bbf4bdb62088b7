"""Document packing: several documents in one batch row, separated by cu_seqlens.

    python examples/documents.py

Packs four documents of different lengths into one row, runs examples/documents.nsa on the
packed row with `cu_seqlens`, and shows that each document's output equals the output of that
document run on its own: no query sees another document's keys, and block ids count from each
document's start.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

import nsa_dsl

PATTERN = Path(__file__).resolve().parent / "documents.nsa"


def main() -> None:
    attention = jax.jit(nsa_dsl.compile(PATTERN))
    lengths = [300, 77, 520, 129]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    heads_q, heads_kv, head_dim = 8, 2, 64
    rng = np.random.default_rng(0)
    total = int(cu_seqlens[-1])
    q = rng.standard_normal((1, total, heads_q, head_dim), dtype=np.float32)
    k = rng.standard_normal((1, total, heads_kv, head_dim), dtype=np.float32)
    v = rng.standard_normal((1, total, heads_kv, head_dim), dtype=np.float32)

    packed = np.asarray(attention(q, k, v, cu_seqlens=cu_seqlens))
    print(f"packed {len(lengths)} documents of lengths {lengths} into T={total}; cu_seqlens={cu_seqlens.tolist()}")
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        alone = np.asarray(attention(q[:, start:end], k[:, start:end], v[:, start:end]))
        error = np.abs(packed[:, start:end] - alone).max() / np.abs(alone).max()
        print(f"  document [{start:4d}, {end:4d}): packed vs alone, max relative difference {error:.1e}")


if __name__ == "__main__":
    main()
