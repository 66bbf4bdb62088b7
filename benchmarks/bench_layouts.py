"""Trailing windows on the layouts that are not one whole-tile sequence per batch row, on one GPU:
packed sequences (cu_seqlens) and lengths that no kernel tile divides.

    PYTHONPATH=. python benchmarks/bench_layouts.py                    # nsa_dsl (Hopper kernels) and cuDNN
    NSA_DSL_HOPPER=0 PYTHONPATH=. python benchmarks/bench_layouts.py   # nsa_dsl's Triton kernels instead
    PYTHONPATH=. python benchmarks/bench_layouts.py --flex             # PyTorch FlexAttention (torch.compile)
    PYTHONPATH=. python benchmarks/bench_layouts.py --layouts packed16_64k --tag main   # one layout, rows labelled

B x T rows, HQ=64, HKV=4, D=128, bfloat16; window 512 and causal, forward and forward+backward
(median ms, benchmarks/timing.py: the same measurement for every row). Layouts: 16 packed
sequences cut at random (seed 0) from 65536 rows; one batch row of 65000; 4 rows of 8000.
cuDNN dense (jax.nn.dot_product_attention) where it computes the same thing (no packing);
FlexAttention for every layout, packed ones through a document mask, in its own process (the
same input values: seeded generators). One JSON line per row.

On a Hopper the packed layout runs behind the finiteness check of packed calls: to time a change there,
run `--layouts packed16_64k` under each tree's PYTHONPATH with one NSA_DSL_CACHE_DIR (the kernels are
shared; a cold forward + backward compiles for ~170 s on an H100) and tell the rows apart by `--tag`.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import measure  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, WINDOW = 64, 4, 128, 512
PATTERNS = {
    "window512": "pattern w\nblock 64\ncausal\nbranch main = window(512)\n",
    "causal": "pattern c\nblock 64\ncausal\nbranch main = local(2147483647)\n",
}


LAYOUTS = ("packed16_64k", "ragged_65000", "ragged_8000x4")


def layouts(chosen):
    """(name, B, T, cu_seqlens or None, q, k, v, d_out as float32 numpy) for the layouts `chosen`,
    each layout's values from a generator of its own (the same whichever layouts a process runs)."""
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, 65536), 15, replace=False))
    shapes = [
        ("packed16_64k", 1, 65536, np.concatenate([[0], cuts, [65536]]).astype(np.int32)),
        ("ragged_65000", 1, 65000, None),
        ("ragged_8000x4", 4, 8000, None),
    ]
    for index, (name, batch, seq_len, cu_seqlens) in enumerate(shapes):
        if name not in chosen:
            continue
        rng = np.random.default_rng((0, index))

        def normal(heads):
            return rng.standard_normal((batch, seq_len, heads, HEAD_DIM), dtype=np.float32)

        yield name, batch, seq_len, cu_seqlens, normal(HEADS_Q), normal(HEADS_KV), normal(HEADS_KV), normal(HEADS_Q)


def timed(row, forward, forward_backward, sync, tag):
    try:
        row["fwd_ms"] = measure(forward, sync, time_cap_s=0.75)["ms"]
        row["fwdbwd_ms"] = measure(forward_backward, sync, time_cap_s=0.75)["ms"]
    except Exception as err:  # noqa: BLE001 - a failed row is reported, the others still run
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    print(json.dumps(dict(row, tag=tag) if tag else row), flush=True)


def jax_rows(chosen, tag):
    import jax
    import jax.numpy as jnp

    import nsa_dsl

    kernels = "nsa_dsl-triton" if os.environ.get("NSA_DSL_HOPPER") == "0" else "nsa_dsl-hopper"
    for layout, _, _, cu_seqlens, *arrays in layouts(chosen):
        q, k, v, d_out = (jnp.asarray(a, jnp.bfloat16) for a in arrays)
        cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
        for name, text in PATTERNS.items():
            attention = nsa_dsl.compile(text)
            impls = {kernels: lambda q, k, v, attention=attention: attention(q, k, v, cu_seqlens=cu, platform="triton")}
            if cu is None and kernels == "nsa_dsl-hopper":
                local = (WINDOW - 1, 0) if name == "window512" else None
                impls["cudnn"] = lambda q, k, v, local=local: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, local_window_size=local, implementation="cudnn")
            for impl, call in impls.items():
                forward = jax.jit(call)
                forward_backward = jax.jit(lambda q, k, v, d_out, call=call: jax.vjp(call, q, k, v)[1](d_out))
                timed({"layout": layout, "pattern": name, "impl": impl}, lambda: forward(q, k, v),
                      lambda: forward_backward(q, k, v, d_out), jax.block_until_ready, tag)


def flex_rows(chosen, tag):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    for layout, batch, seq_len, cu_seqlens, *arrays in layouts(chosen):
        # FlexAttention's layout is [B, H, T, D]: transposed once, outside the timing.
        q, k, v, d_out = (torch.from_numpy(a).to("cuda", torch.bfloat16).transpose(1, 2).contiguous() for a in arrays)
        leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
        documents = torch.zeros(seq_len, dtype=torch.int32, device="cuda")
        if cu_seqlens is not None:
            documents = torch.bucketize(torch.arange(seq_len, device="cuda"), torch.from_numpy(cu_seqlens[1:]).cuda(),
                                        right=True).to(torch.int32)
        for name in PATTERNS:
            window = WINDOW if name == "window512" else seq_len

            def visible(b, h, q_idx, kv_idx, window=window):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < window) & (documents[q_idx] == documents[kv_idx])

            mask = create_block_mask(visible, None, None, seq_len, seq_len, device="cuda")

            def forward(q=q, k=k, v=v, mask=mask):
                with torch.no_grad():
                    return flex(q, k, v, block_mask=mask, enable_gqa=True)

            def forward_backward(mask=mask):
                out = flex(*leaves, block_mask=mask, enable_gqa=True)
                return torch.autograd.grad(out, leaves, d_out)

            timed({"layout": layout, "pattern": name, "impl": "flex"}, forward, forward_backward,
                  lambda _: torch.cuda.synchronize(), tag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flex", action="store_true", help="PyTorch FlexAttention's rows instead of JAX's")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {','.join(LAYOUTS)}")
    parser.add_argument("--tag", default="", help="a label added to every row (e.g. the tree's)")
    args = parser.parse_args()
    chosen = args.layouts.split(",")
    unknown = set(chosen) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    (flex_rows if args.flex else jax_rows)(chosen, args.tag)


if __name__ == "__main__":
    main()
