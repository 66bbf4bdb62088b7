"""Packed training on the Triton platform: a window of 512 and `causal` over T tokens cut into
--documents packed sequences (cu_seqlens), forward and forward + backward, at bench_gpu's heads
(HQ 64, HKV 4, D 128, bfloat16), one JSON line a measurement:

    python3 benchmarks/bench_packed.py [--length 65536] [--documents 16] [--tag main]

On a Hopper GPU these run the Mosaic GPU window/causal kernels behind the finiteness check that
keeps a packed call with a non-finite value off them (hopper_window.py.j2's hopper_unless_leaking).
To time a change to that path, run the script under each tree's PYTHONPATH in one device call,
with one NSA_DSL_CACHE_DIR for both (the kernels are shared; a cold forward + backward compiles for
~170 s on an H100). `--kinds fwd+bwd` skips the forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from timing import measure

PATTERNS = {"window512": "window(512)", "causal": "local(2147483647)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--kinds", default="fwd,fwd+bwd", help="comma-separated subset of fwd,fwd+bwd")
    parser.add_argument("--tag", default="", help="a label copied into every line (e.g. the tree's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import nsa_dsl

    # Triton's interpreter on a CPU takes no bfloat16.
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float16
    rng = np.random.default_rng(args.seed)
    cuts = np.sort(rng.choice(np.arange(1, args.length), args.documents - 1, replace=False))
    cu_seqlens = jnp.asarray(np.concatenate([[0], cuts, [args.length]]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, args.length, 64, 128)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((1, args.length, 4, 128)), dtype) for _ in range(2))
    cotangent = jnp.asarray(rng.standard_normal(q.shape), dtype)

    for name, keys in PATTERNS.items():
        pattern = nsa_dsl.compile(f"pattern packed_{name}\nblock 64\ncausal\nbranch main = {keys}\n")

        def forward(q, k, v, pattern=pattern):
            return pattern(q, k, v, cu_seqlens=cu_seqlens, platform="triton")

        def loss(q, k, v):
            return jnp.sum(forward(q, k, v).astype(jnp.float32) * cotangent)

        calls = {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}
        for kind in args.kinds.split(","):
            result = measure(lambda call=calls[kind]: call(q, k, v), jax.block_until_ready)
            print(json.dumps(dict(tag=args.tag, device=jax.devices()[0].device_kind, T=args.length,
                                  documents=args.documents, pattern=name, kind=kind, ms=round(result["ms"], 3),
                                  samples_ms=[round(x, 3) for x in result["samples_ms"]],
                                  first_call_s=round(result["first_call_s"], 1))), flush=True)


if __name__ == "__main__":
    main()
