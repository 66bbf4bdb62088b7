"""Trailing windows on the layouts that are not one whole-tile sequence per batch row, on one GPU:
packed sequences (cu_seqlens) and lengths that no kernel tile divides.

    PYTHONPATH=. python benchmarks/bench_layouts.py                    # Hopper kernels where they apply
    NSA_DSL_HOPPER=0 PYTHONPATH=. python benchmarks/bench_layouts.py   # the Triton kernels instead

B x T rows, HQ=64, HKV=4, D=128, bfloat16; window 512 and causal, forward and forward+backward
(median ms, benchmarks/timing.py). Layouts: 16 packed sequences cut at random (seed 0) from 65536
rows; one batch row of 65000; 4 rows of 8000. cuDNN dense (jax.nn.dot_product_attention) joins
where it computes the same thing (no packing) and the Hopper kernels run. One JSON line per row.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import measure  # noqa: E402

import nsa_dsl  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 64, 4, 128
PATTERNS = {
    "window512": ("pattern w\nblock 64\ncausal\nbranch main = window(512)\n", (511, 0)),
    "causal": ("pattern c\nblock 64\ncausal\nbranch main = local(2147483647)\n", None),
}


def layouts(rng):
    cuts = np.sort(rng.choice(np.arange(1, 65536), 15, replace=False))
    return {
        "packed16_64k": (1, 65536, np.concatenate([[0], cuts, [65536]]).astype(np.int32)),
        "ragged_65000": (1, 65000, None),
        "ragged_8000x4": (4, 8000, None),
    }


def main():
    rng = np.random.default_rng(0)
    kernels = "triton" if os.environ.get("NSA_DSL_HOPPER") == "0" else "hopper"
    for layout, (batch, seq_len, cu_seqlens) in layouts(rng).items():
        def normal(heads):
            return jnp.asarray(rng.standard_normal((batch, seq_len, heads, HEAD_DIM)), jnp.bfloat16)

        q, k, v, d_out = normal(HEADS_Q), normal(HEADS_KV), normal(HEADS_KV), normal(HEADS_Q)
        cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
        for name, (text, local_window) in PATTERNS.items():
            attention = nsa_dsl.compile(text)
            impls = {kernels: lambda q, k, v, attention=attention: attention(q, k, v, cu_seqlens=cu, platform="triton")}
            if cu is None and kernels == "hopper":
                impls["cudnn"] = lambda q, k, v, local=local_window: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, local_window_size=local, implementation="cudnn")
            for impl, call in impls.items():
                forward = jax.jit(call)

                def forward_backward(q, k, v, d_out, call=call):
                    return jax.vjp(call, q, k, v)[1](d_out)

                forward_backward = jax.jit(forward_backward)
                row = {"layout": layout, "pattern": name, "impl": impl}
                try:
                    row["fwd_ms"] = measure(lambda: forward(q, k, v), jax.block_until_ready, time_cap_s=0.75)["ms"]
                    row["fwdbwd_ms"] = measure(
                        lambda: forward_backward(q, k, v, d_out), jax.block_until_ready, time_cap_s=0.75)["ms"]
                except Exception as err:  # noqa: BLE001 - a failed row is reported, the others still run
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
