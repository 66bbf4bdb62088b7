"""Compile a pattern, run the generated XLA attention on random data, check it, time it.

    python examples/quickstart.py [--seq-len 2048] [--window 256]

Compiles examples/longformer.nsa (a sliding window plus the first key block as global
tokens), runs the generated kernel under jax.jit on CPU, and prints its largest error against
a dense float64 reference of the same pattern and its time per call.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

import nsa_dsl
from nsa_dsl.runtime.check import reference_output

PATTERN = Path(__file__).resolve().parent / "longformer.nsa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()

    attention = nsa_dsl.compile(PATTERN, window=args.window)
    plan = attention.plan
    print(f"pattern {plan.name}: block {plan.block_size}, {'causal' if plan.causal else 'bidirectional'}, "
          f"params {dict(plan.params)}")
    print(f"generated module: {attention.module_path()}")

    batch, seq_len, heads_q, heads_kv, head_dim = 1, args.seq_len, 8, 2, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, seq_len, heads_q, head_dim), dtype=np.float32)
    k = rng.standard_normal((batch, seq_len, heads_kv, head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, seq_len, heads_kv, head_dim), dtype=np.float32)

    run = jax.jit(attention)
    start = time.perf_counter()
    out = np.asarray(run(q, k, v))
    print(f"first call (compiles): {time.perf_counter() - start:.2f} s")
    calls = 10
    start = time.perf_counter()
    for _ in range(calls):
        run(q, k, v).block_until_ready()
    per_call = (time.perf_counter() - start) / calls

    expected = reference_output(plan, q, k, v)
    error = np.abs(out - expected).max() / np.abs(expected).max()
    print(f"B={batch} T={seq_len} HQ={heads_q} HKV={heads_kv} D={head_dim} float32 on {jax.default_backend()}")
    print(f"max relative error vs float64 reference: {error:.2e}")
    print(f"time per call: {per_call * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
