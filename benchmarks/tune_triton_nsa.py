"""Tile and launch settings of the Triton NSA kernels (compression attention, top-k scoring),
measured on a GPU in one process: the sweep behind TOKEN_ROWS, CMP_STEP_KEYS, TOPK_GROUPS and the compression
and top-k entries of LAUNCH in templates/triton (NOTES.md, session 4).

    PYTHONPATH=. python benchmarks/tune_triton_nsa.py [--seq-len 65536] [--kernels compression,topk] [--out DIR]

Setting: B=1, HQ=64, HKV=4, D=128, bfloat16 (issue 4's; --dtype), compress(64, 64), top-16 of 64-token
blocks forcing the query's own. Each setting patches the generated module's constants (the module
dispatch runs: its config is `dispatch.for_device(None)`), clears the jit caches so that the next
trace reads them, and times
  - the compression pattern alone, forward and forward+backward (TOKEN_ROWS, compression warps,
    CMP_STEP_KEYS, stages);
  - the selections (compression forward + top-k scoring), forward (TOPK_GROUPS, TOPK_CANDIDATES,
    top-k warps).
Prints one line per setting and writes tune_triton_nsa.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from timing import error_text, measure

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch

COMPRESSION = "pattern cmp\nblock 64\ncausal\nbranch cmp = compress(block=64, stride=64) gate g_cmp\n"
SELECTION = COMPRESSION + "branch slc = topk(16, block=64, score=cmp, force=local(1)) gate g_slc\n"
# (TOKEN_ROWS, compression num_warps, CMP_STEP_KEYS, num_stages) and (TOPK_GROUPS, TOPK_CANDIDATES, top-k
# num_warps) to time.
COMPRESSION_SETTINGS = [(128, 8, 32, 2), (64, 4, 64, 2), (64, 4, 32, 2), (64, 4, 32, 3), (64, 4, 64, 1),
                        (64, 4, 32, 1), (128, 8, 64, 2), (32, 4, 32, 2), (64, 8, 32, 2), (128, 4, 32, 2),
                        (128, 8, 32, 3), (128, 8, 16, 2)]
TOPK_SETTINGS = [(4, 64, 4), (4, 32, 4), (2, 64, 4), (4, 64, 2), (8, 32, 8), (8, 64, 4), (16, 64, 4), (4, 64, 8),
                 (4, 128, 4), (4, 128, 8), (2, 128, 4), (8, 128, 8), (8, 64, 8), (16, 64, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--time-cap-s", type=float, default=0.5)
    parser.add_argument("--kernels", default="compression,topk", help="which sweeps to run (default both)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for tune_triton_nsa.json")
    args = parser.parse_args()

    keys = jax.random.split(jax.random.key(0), 4)
    dtype = jnp.dtype(args.dtype)
    q = jax.random.normal(keys[0], (1, args.seq_len, 64, 128), dtype)
    k, v = (jax.random.normal(key, (1, args.seq_len, 4, 128), dtype) for key in keys[1:3])
    g_cmp = jax.random.uniform(keys[3], (1, args.seq_len, 64), dtype)
    compression, selection = nsa_dsl.compile(COMPRESSION), nsa_dsl.compile(SELECTION)
    modules = [codegen.load_module("triton", a.plan, dispatch.for_device(None)) for a in (compression, selection)]
    launch = dict(modules[0].LAUNCH)
    rows, groups, candidates = modules[0].TOKEN_ROWS, modules[0].TOPK_GROUPS, modules[0].TOPK_CANDIDATES
    cmp_step = modules[0].CMP_STEP_KEYS
    results = []

    def use(**settings):
        for module in modules:
            module.TOKEN_ROWS = settings.get("rows", rows)
            module.TOPK_GROUPS = settings.get("groups", groups)
            module.TOPK_CANDIDATES = settings.get("candidates", candidates)
            module.CMP_STEP_KEYS = settings.get("cmp_step", cmp_step)
            module.LAUNCH = {**launch, **settings.get("launch", {})}
        dispatch.kernel.cache_clear()
        jax.clear_caches()

    def timed(call):
        try:
            return round(measure(call, jax.block_until_ready, time_cap_s=args.time_cap_s)["ms"], 3)
        except Exception as err:  # noqa: BLE001 - every setting is its own measurement
            return error_text(err)

    sweeps = set(args.kernels.split(","))
    for token_rows, warps, step, stages in COMPRESSION_SETTINGS if "compression" in sweeps else ():
        use(rows=token_rows, cmp_step=step,
            launch={"compression_forward": (warps, stages), "compression_backward_dq": (warps, stages)})
        forward = jax.jit(lambda q, k, v: compression(q, k, v, g_cmp=g_cmp, platform="triton"))
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
        row = {"kernel": "compression", "token_rows": token_rows, "num_warps": warps, "step": step,
               "num_stages": stages,
               "fwd_ms": timed(lambda f=forward: f(q, k, v)), "fwd_bwd_ms": timed(lambda g=grads: g(q, k, v))}
        print(row, flush=True)
        results.append(row)
    for topk_groups, topk_candidates, warps in TOPK_SETTINGS if "topk" in sweeps else ():
        use(groups=topk_groups, candidates=topk_candidates, launch={"topk_selection": (warps, 2)})
        selections = jax.jit(lambda q, k, v: selection.selections(q, k, v, platform="triton"))
        row = {"kernel": "topk_selection", "groups": topk_groups, "candidates": topk_candidates, "num_warps": warps,
               "selections_ms": timed(lambda s=selections: s(q, k, v))}
        print(row, flush=True)
        results.append(row)

    settings = {**vars(args), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_triton_nsa.json"), "w") as f:
        json.dump({"settings": settings, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
