"""nsa_dsl against its peers on one GPU, side by side in one run.

    PYTHONPATH=. python benchmarks/bench_gpu.py [--lengths 8192,32768,65536] [--json PATH]

Per-token block selection (the selection branch of Native Sparse Attention) at issue 4's
setting: B=1, HQ=64, HKV=4, D=128, 16 selected blocks of 64 tokens, bfloat16, the same random
per-token selections (sorted, distinct, causal block ids) for every implementation:
  nsa_dsl triton   nsa_dsl.native_sparse_attention(..., platform="triton") (jax-triton kernels)
  nsa_dsl xla      the same call with platform="xla"
  fla              fla.ops.nsa.parallel_nsa (flash-linear-attention, PyTorch + Triton)
  ejkernel         ejkernel's native_sparse_attention (JAX), where it imports
  cudnn dense      jax.nn.dot_product_attention(implementation="cudnn"), dense causal: the
                   cost sparse attention has to beat
Forward and forward+backward, median ms (JAX: jitted calls with block_until_ready; PyTorch:
triton.testing.do_bench), ratios against nsa_dsl triton. Every case runs in its own try/except.
FLA runs in a PyTorch-only child process on the same inputs; run with
XLA_PYTHON_CLIENT_PREALLOCATE=false so that JAX leaves it GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

B, HQ, HKV, D, S, BLOCK = 1, 64, 4, 128, 16, 64


def log(*parts) -> None:
    print(*parts, flush=True)


def selections(rng: np.random.Generator, seq_len: int) -> np.ndarray:
    """[B, T, HKV, S] sorted distinct causal block ids (fewer valid early on: -1 padded)."""
    blocks = np.arange(seq_len) // BLOCK
    keys = rng.random((B, seq_len, HKV, seq_len // BLOCK + 1))
    keys = np.where(np.arange(keys.shape[-1]) <= blocks[None, :, None, None], keys, -1.0)
    top = np.argsort(-keys, axis=-1)[..., :S]
    top = np.where(np.take_along_axis(keys, top, axis=-1) >= 0, top, seq_len)
    top = np.sort(top, axis=-1)
    return np.where(top < seq_len, top, -1).astype(np.int32)


def jax_median_ms(fn, *args, repeats: int = 10) -> float:
    for _ in range(2):
        jax_block(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax_block(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def jax_block(tree):
    import jax

    for leaf in jax.tree.leaves(tree):
        leaf.block_until_ready()


def bench_jax(name, attend, q, k, v, d_out) -> dict:
    import jax

    forward = jax.jit(attend)
    forward_backward = jax.jit(lambda q, k, v, d: jax.vjp(attend, q, k, v)[1](d))
    row = {"impl": name}
    for mode, fn, args in (("fwd", forward, (q, k, v)), ("fwdbwd", forward_backward, (q, k, v, d_out))):
        try:
            row[mode] = jax_median_ms(fn, *args)
        except Exception as err:  # noqa: BLE001 - a failing peer is reported, the run goes on
            row[mode] = None
            row[f"{mode}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            traceback.print_exc(limit=2)
    return row


def bench_fla(q, k, v, indices, d_out) -> dict:
    import torch
    from fla.ops.nsa import parallel_nsa
    from triton.testing import do_bench

    as_torch = lambda x: torch.from_numpy(np.asarray(x, dtype=np.float32)).to("cuda", torch.bfloat16)  # noqa: E731
    tq, tk, tv, tdo = (as_torch(x) for x in (q, k, v, d_out))
    tq.requires_grad_(), tk.requires_grad_(), tv.requires_grad_()
    ti = torch.from_numpy(np.where(indices >= 0, indices, 0)).to("cuda", torch.long)
    counts = torch.from_numpy((indices >= 0).sum(-1)).to("cuda", torch.long)

    def forward():
        return parallel_nsa(tq, tk, tv, g_cmp=None, g_slc=None, block_indices=ti, block_counts=counts, block_size=BLOCK)

    def forward_backward():
        out = forward()
        out.backward(tdo)

    row = {"impl": "fla parallel_nsa"}
    for mode, fn in (("fwd", forward), ("fwdbwd", forward_backward)):
        try:
            row[mode] = do_bench(fn, warmup=50, rep=300, return_mode="median")
        except Exception as err:  # noqa: BLE001
            row[mode] = None
            row[f"{mode}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            traceback.print_exc(limit=2)
    return row


def fla_in_child(seq_len: int) -> dict:
    """FLA's timings from a PyTorch-only child process, on the same inputs (same seeds): in a
    process that has initialised jax's CUDA backend, triton's PyTorch driver fails to start."""
    import subprocess

    # Triton's PyTorch driver needs a writable cache dir to build its launcher; on the H200 image
    # the default one failed ("Could not create or locate cache dir", 2026-11-29).
    env = {**os.environ, "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR", "/tmp/triton_cache_fla")}
    os.makedirs(env["TRITON_CACHE_DIR"], exist_ok=True)
    done = subprocess.run(
        [sys.executable, __file__, "--impls", "fla", "--lengths", str(seq_len)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            row.pop("seq_len")
            return row
    return {"impl": "fla parallel_nsa", "fwd": None, "fwdbwd": None, "error": done.stderr.strip().splitlines()[-1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768,65536")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_gpu.json"))
    parser.add_argument("--impls", default="triton,xla,fla,ejkernel,cudnn")
    args = parser.parse_args()

    impls = args.impls.split(",")
    if impls == ["fla"]:  # the child process of a full run: PyTorch only
        for seq_len in (int(x) for x in args.lengths.split(",")):
            rng = np.random.default_rng(seq_len)
            q = rng.standard_normal((B, seq_len, HQ, D), dtype=np.float32)
            k, v = (rng.standard_normal((B, seq_len, HKV, D), dtype=np.float32) for _ in range(2))
            d_out = rng.standard_normal(q.shape, dtype=np.float32)
            print(json.dumps({"seq_len": seq_len, **bench_fla(q, k, v, selections(rng, seq_len), d_out)}), flush=True)
        return

    import jax
    import jax.numpy as jnp

    import nsa_dsl

    log(f"devices {jax.devices()}; jax {jax.__version__}")
    log(f"setting: B={B} HQ={HQ} HKV={HKV} D={D} S={S} block={BLOCK} bfloat16, random per-token selections")
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK)
    results = []
    for seq_len in (int(x) for x in args.lengths.split(",")):
        rng = np.random.default_rng(seq_len)
        q = rng.standard_normal((B, seq_len, HQ, D), dtype=np.float32)
        k, v = (rng.standard_normal((B, seq_len, HKV, D), dtype=np.float32) for _ in range(2))
        d_out = rng.standard_normal(q.shape, dtype=np.float32)
        indices = selections(rng, seq_len)
        jq, jk, jv, jd = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, d_out))
        ji = jnp.asarray(indices)
        rows = []
        for platform in ("triton", "xla"):
            if platform in impls:
                attend = lambda q, k, v, p=platform: nsa_dsl.native_sparse_attention(  # noqa: E731
                    q, k, v, None, None, ji, S, None, platform=p, cfg=cfg)
                rows.append(bench_jax(f"nsa_dsl {platform}", attend, jq, jk, jv, jd))
        if "fla" in impls:
            rows.append(fla_in_child(seq_len))
        if "ejkernel" in impls:
            try:
                from ejkernel.modules.operations import native_sparse_attention as ej_nsa

                attend = lambda q, k, v: ej_nsa(q, k, v, None, None, ji, S, None)  # noqa: E731
                rows.append(bench_jax("ejkernel", attend, jq, jk, jv, jd))
            except Exception as err:  # noqa: BLE001
                rows.append({"impl": "ejkernel", "fwd": None, "fwdbwd": None, "error": repr(err)[:200]})
        if "cudnn" in impls:
            attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
            rows.append(bench_jax("cudnn dense causal", attend, jq, jk, jv, jd))
        base = rows[0] if rows and rows[0]["impl"] == "nsa_dsl triton" else None
        log(f"\nT={seq_len}")
        log(f"{'impl':<22}{'fwd ms':>10}{'fwd+bwd ms':>12}{'fwd x':>8}{'f+b x':>8}   (x = impl time / nsa_dsl triton time)")
        for row in rows:
            cells = []
            for mode in ("fwd", "fwdbwd"):
                cells.append(f"{row[mode]:.2f}" if row.get(mode) else "-")
            ratios = []
            for mode in ("fwd", "fwdbwd"):
                ok = base and row.get(mode) and base.get(mode)
                ratios.append(f"{row[mode] / base[mode]:.2f}" if ok else "-")
            log(f"{row['impl']:<22}{cells[0]:>10}{cells[1]:>12}{ratios[0]:>8}{ratios[1]:>8}"
                + (f"   {row.get('error') or row.get('fwd_error') or row.get('fwdbwd_error')}" if not row.get("fwd") else ""))
            results.append({"seq_len": seq_len, **row})
    with open(args.json, "w") as f:
        json.dump({"setting": dict(B=B, HQ=HQ, HKV=HKV, D=D, S=S, block=BLOCK, dtype="bfloat16"), "results": results}, f, indent=1)
    log(f"\nJSON written to {args.json}")


if __name__ == "__main__":
    main()
