"""Tile and launch settings of the Triton static-branch kernels, measured on a GPU in one call.

Run from the repository root on a machine with a GPU build of jax, triton and jax-triton:

    PYTHONPATH=. python benchmarks/tune_triton_static.py --out DIR/tune_triton_static.json
        [--budget-s 220] [--workers 8] [--lengths 32768,65536] [--dry-run]

Patterns (the range form: key ranges computed in the kernel): `window(512)` causal and plain causal
(`local(2147483647)`: every key block up to the query's), block 64, at B=1, HQ=64, HKV=4, D=128,
bfloat16 (the issue's setting), T = 32k and 64k.

1. Forward: each candidate (queries, keys, heads) tile and (num_warps, num_stages) of
   STATIC_TILES["static_forward"] / LAUNCH["static_forward"], both patterns, both lengths.
2. Forward + backward, for the best forward settings of each pattern: candidate dq and dk/dv tiles
   and launch settings.
3. cuDNN's dense causal and 512-token window attention (jax.nn.dot_product_attention) in the same
   run, for the ratios the issue's targets are stated in.

Compilation is the slow part (Triton compiles every variant), so candidates run in a pool of
worker processes that compile in parallel and take turns on the GPU for the timings (a lock), so
that no two timings overlap. Every candidate runs in its own try/except; the run stops handing out
candidates when the --budget-s is near and reports what it has. The JSON (rewritten after every
result) holds every measurement and the best settings as STATIC_TILES / LAUNCH entries.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
import traceback
from importlib import metadata

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PATTERNS = {
    "window": "pattern sliding_window\nblock {block}\ncausal\nbranch main = window(512)\n",
    "causal": "pattern dense_causal\nblock {block}\ncausal\nbranch main = local(2147483647)\n",
}
# Forward candidates: (queries, keys, heads) of a tile, (num_warps, num_stages). Rows of a tile are
# heads x queries; 128 rows need 8 warps to keep the float32 accumulator out of local memory.
FORWARD = [
    ((128, 64, 1), (8, 3)),
    ((128, 64, 1), (8, 2)),
    ((128, 128, 1), (8, 2)),
    ((128, 128, 1), (8, 3)),
    ((64, 64, 2), (8, 3)),
    ((64, 128, 2), (8, 2)),
    ((32, 64, 4), (8, 3)),
    ((64, 64, 1), (4, 3)),
    ((64, 128, 1), (4, 2)),
    ((128, 32, 1), (8, 4)),
    ((64, 32, 2), (8, 4)),
    ((128, 64, 1), (4, 2)),
]
# Backward candidates: dq (queries, keys, heads), (warps, stages); dk/dv (queries, keys, 1), (warps, stages).
BACKWARD = [
    (((128, 64, 1), (8, 2)), ((64, 128, 1), (8, 2))),
    (((128, 32, 1), (4, 3)), ((32, 128, 1), (4, 3))),
    (((64, 64, 1), (4, 3)), ((64, 64, 1), (8, 2))),
    (((64, 64, 2), (8, 2)), ((32, 64, 1), (4, 2))),
]
# Two gated range branches (default settings): one fused launch against two launches combined in JAX.
FUSED_BRANCHES = (("swa", "window(512)", "g_swa"), ("sink", "global(first=1)", "g_slc"))
BEST_FORWARD = 2  # forward settings of each pattern measured with every backward candidate
MAX_REL_ERROR = 2e-2  # against cuDNN in bfloat16: a candidate past it is reported, never chosen

# The issue's cuDNN figures on the same kind of H200 (median ms at 32k / 64k), for when the in-run
# cuDNN measurement fails.
ISSUE_CUDNN_MS = {
    ("causal", "fwd"): {32768: 29.4, 65536: 118.0},
    ("causal", "fwdbwd"): {32768: 113.5, 65536: 447.0},
    ("window", "fwd"): {32768: 1.45, 65536: 3.15},
}


def log(*parts) -> None:
    print(*parts, flush=True)


# ---- worker side ---------------------------------------------------------------------------------

_gpu_lock = None
_deadline = 0.0


def _start_worker(lock, deadline: float) -> None:
    global _gpu_lock, _deadline
    _gpu_lock, _deadline = lock, deadline
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, REPO_ROOT)


def _median_ms(fn, args, min_repeats: int = 5, min_seconds: float = 1.0) -> float:
    """Median wall time of fn(*args) (blocked until ready) after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    started = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - started < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(shape, length: int, dtype):
    import jax

    batch, heads_q, heads_kv, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(length), 4)
    q = jax.random.normal(keys[0], (batch, length, heads_q, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, length, heads_kv, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, length, heads_kv, head_dim), dtype)
    d_out = jax.random.normal(keys[3], (batch, length, heads_q, head_dim), dtype)
    return q, k, v, d_out


def _timed(make_fn, shape, lengths, dtype, mode: str, reference=None) -> tuple[dict, float | None]:
    """({T: ms}, error) of make_fn(T), a function of (q, k, v) or (q, k, v, d_out), compiled
    outside the GPU lock and timed inside it; error: max over its outputs of max |ours - reference|
    / max |reference| at the shortest length, `reference` making the reference function as make_fn."""
    import jax

    result, error = {}, None
    for length in lengths:
        q, k, v, d_out = _inputs(shape, length, dtype)
        args = (q, k, v) if mode == "fwd" else (q, k, v, d_out)
        compiled = jax.jit(make_fn(length)).lower(*args).compile()  # Triton compiles here, in parallel
        with _gpu_lock:
            if time.time() > _deadline:
                raise TimeoutError("budget spent before this candidate's timing")
            if reference is not None and length == min(lengths):
                pairs = zip(jax.tree.leaves(compiled(*args)), jax.tree.leaves(jax.jit(reference(length))(*args)))
                error = max(
                    float(jnp_max_abs(a - b) / max(float(jnp_max_abs(b)), 1e-30)) for a, b in pairs
                )
            result[length] = _median_ms(compiled, args)
        del q, k, v, d_out, compiled
    return result, error


def jnp_max_abs(x) -> float:
    import jax.numpy as jnp

    return float(jnp.max(jnp.abs(x.astype(jnp.float32))))


def measure_ours(pattern: str, mode: str, tiles: dict, launch: dict, shape, lengths, dtype_name: str, block: int,
                 check: bool) -> tuple[dict, float | None]:
    """One candidate: the generated module of `pattern` with `tiles` / `launch` entries set,
    checked against cuDNN (the same attention) when `check`."""
    import jax
    import jax.numpy as jnp

    import nsa_dsl
    from nsa_dsl import codegen
    from nsa_dsl.runtime import dispatch

    attention = nsa_dsl.compile(PATTERNS[pattern].format(block=block))
    module = codegen.load_module("triton", attention.plan, None)
    module.STATIC_TILES.update(tiles)
    module.LAUNCH.update(launch)
    dtype = jnp.dtype(dtype_name)
    scale = 1.0 / math.sqrt(shape[3])

    def make_fn(length):
        tables = dispatch.branch_tables(attention.plan, length)

        def forward(q, k, v):
            return module.attention(q, k, v, gates={}, tables=tables, cu_seqlens=None, softmax_scale=scale)

        def forward_backward(q, k, v, d_out):
            out, pullback = jax.vjp(forward, q, k, v)
            return out, pullback(d_out)

        return forward if mode == "fwd" else forward_backward

    reference = functools.partial(cudnn_function, pattern, mode) if check else None
    return _timed(make_fn, shape, lengths, dtype, mode, reference)


def measure_fusion(fused: bool, mode: str, shape, lengths, dtype_name: str, block: int) -> tuple[dict, None]:
    """FUSED_BRANCHES as one pattern (one launch, gates applied in the kernel) or as one pattern a
    branch, combined as sum of gate * output in JAX (what separate launches cost)."""
    import jax
    import jax.numpy as jnp

    import nsa_dsl
    from nsa_dsl import codegen

    def module_of(branches):
        text = f"pattern fusion\nblock {block}\ncausal\n" + "".join(
            f"branch {name} = {keys}{f' gate {gate}' if gate else ''}\n" for name, keys, gate in branches
        )
        return codegen.load_module("triton", nsa_dsl.compile(text).plan, None)

    scale = 1.0 / math.sqrt(shape[3])
    fused_module = module_of(FUSED_BRANCHES) if fused else None
    separate = [module_of([(name, keys, None)]) for name, keys, _ in FUSED_BRANCHES] if not fused else []

    def make_fn(length):
        batch, heads_q = shape[0], shape[1]
        keys = jax.random.split(jax.random.PRNGKey(7), len(FUSED_BRANCHES))
        gates = {gate: jax.random.uniform(key, (batch, length, heads_q), jnp.float32, 0.25, 1.5)
                 for key, (_, _, gate) in zip(keys, FUSED_BRANCHES)}

        def forward(q, k, v):
            options = {"tables": {}, "cu_seqlens": None, "softmax_scale": scale}
            if fused:
                return fused_module.attention(q, k, v, gates=gates, **options)
            out = sum(gates[gate][..., None] * module.attention(q, k, v, gates={}, **options).astype(jnp.float32)
                      for module, (_, _, gate) in zip(separate, FUSED_BRANCHES))
            return out.astype(q.dtype)

        def forward_backward(q, k, v, d_out):
            out, pullback = jax.vjp(forward, q, k, v)
            return out, pullback(d_out)

        return forward if mode == "fwd" else forward_backward

    return _timed(make_fn, shape, lengths, jnp.dtype(dtype_name), mode)


def cudnn_function(pattern: str, mode: str, length: int):
    """cuDNN's dense attention of `pattern` (causal, or a causal 512-token window)."""
    import jax

    window = {"local_window_size": (511, 0)} if pattern == "window" else {}

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn", **window)

    def forward_backward(q, k, v, d_out):
        out, pullback = jax.vjp(forward, q, k, v)
        return out, pullback(d_out)

    return forward if mode == "fwd" else forward_backward


def measure_cudnn(pattern: str, mode: str, shape, lengths, dtype_name: str) -> tuple[dict, None]:
    import jax.numpy as jnp

    return _timed(functools.partial(cudnn_function, pattern, mode), shape, lengths, jnp.dtype(dtype_name), mode)


def run_task(task: dict) -> dict:
    """A worker's job: one measurement, never raising (errors are part of the row)."""
    row = dict(task)
    started = time.time()
    try:
        if task["impl"] == "cudnn":
            ms, error = measure_cudnn(task["pattern"], task["mode"], task["shape"], task["lengths"], task["dtype"])
        elif task["impl"] in ("fused", "separate"):
            ms, error = measure_fusion(task["impl"] == "fused", task["mode"], task["shape"], task["lengths"],
                                       task["dtype"], task["block"])
        else:
            ms, error = measure_ours(task["pattern"], task["mode"], task["tiles"], task["launch"], task["shape"],
                                     task["lengths"], task["dtype"], task["block"], task["check"])
        row["ms"] = {str(t): v for t, v in ms.items()}
        if error is not None:
            row["max_rel_error"] = error
    except Exception as err:  # noqa: BLE001 - a failed candidate is a result
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        row["traceback"] = traceback.format_exc()[-2000:]
    row["seconds"] = round(time.time() - started, 1)
    return row


# ---- coordinator side ----------------------------------------------------------------------------


def flops(pattern: str, mode: str, length: int, shape) -> float:
    """Useful FLOPs: 2 matrix products of 2 * D per visible (query, key) pair and query head
    forward; the backward does 2.5 times the forward's (flash-attention convention)."""
    batch, heads_q, _, head_dim = shape
    visible = length * (length + 1) // 2 if pattern == "causal" else sum(min(t + 1, 512) for t in range(length))
    forward = 4.0 * head_dim * heads_q * batch * visible
    return forward * (1.0 if mode == "fwd" else 3.5)


def describe(row: dict) -> str:
    if row["impl"] == "cudnn":
        return "cuDNN"
    if row["impl"] in ("fused", "separate"):
        return f"{row['impl']}: " + " + ".join(f"{keys} gate {gate}" for _, keys, gate in FUSED_BRANCHES)
    parts = [f"{k.removeprefix('static_').replace('backward_', '')}={row['tiles'][k]}/{row['launch'][k]}" for k in row["tiles"]]
    return " ".join(parts)


class Report:
    """Rows as they come, printed and written to the JSON after each."""

    def __init__(self, path: str, settings: dict) -> None:
        self.path = path
        self.data = {"settings": settings, "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        shape = self.data["settings"]["shape"]
        if "error" in row:
            log(f"  {row['pattern']:<7} {row['mode']:<7} {describe(row):<70} ERROR {row['error'][:200]}")
        else:
            cells = []
            for t, ms in row["ms"].items():
                tflops = flops(row["pattern"], row["mode"], int(t), shape) / (ms * 1e-3) / 1e12
                reference = self.cudnn_ms(row["pattern"], row["mode"], int(t))
                ratio = f" {reference / ms:4.2f}x" if reference else ""
                cells.append(f"T={int(t) // 1024 if int(t) >= 1024 else t}{'k' if int(t) >= 1024 else ''} {ms:8.2f} ms "
                             f"{tflops:5.0f} TF/s{ratio}")
            checked = f" err {row['max_rel_error']:.1e}" if "max_rel_error" in row else ""
            log(f"  {row['pattern']:<7} {row['mode']:<7} {describe(row):<70} {' | '.join(cells)}{checked} ({row['seconds']} s)")
        self.write()

    def cudnn_ms(self, pattern: str, mode: str, length: int) -> float | None:
        for row in self.data["rows"]:
            if row["impl"] == "cudnn" and row["pattern"] == pattern and row["mode"] == mode and "ms" in row:
                return row["ms"].get(str(length))
        return ISSUE_CUDNN_MS.get((pattern, mode), {}).get(length)

    def best(self, pattern: str, mode: str, count: int) -> list[dict]:
        """The `count` fastest rows of ours at the longest length."""
        rows = [r for r in self.data["rows"] if r["impl"] == "ours" and r["pattern"] == pattern and r["mode"] == mode
                and "ms" in r and r.get("max_rel_error", 0.0) <= MAX_REL_ERROR]
        longest = str(max(self.data["settings"]["lengths"]))
        return sorted((r for r in rows if longest in r["ms"]), key=lambda r: r["ms"][longest])[:count]

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "triton", "jax-triton", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON to write")
    parser.add_argument("--budget-s", type=float, default=220.0, help="stop handing out candidates after this")
    parser.add_argument("--workers", type=int, default=8, help="processes compiling candidates in parallel")
    parser.add_argument("--lengths", default="32768,65536")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny float32 shapes and two candidates (checks the script on a CPU, in the interpreter)")
    args = parser.parse_args()
    started = time.time()
    deadline = started + args.budget_s

    shape = (1, 64, 4, 128)
    dtype, block = "bfloat16", 64
    lengths = [int(t) for t in args.lengths.split(",")]
    forward, backward, best_forward = FORWARD, BACKWARD, BEST_FORWARD
    if args.dry_run:
        shape, dtype, block, lengths = (1, 4, 1, 32), "float32", 16, [96]
        forward, backward, best_forward = [((32, 16, 1), (4, 2)), ((16, 32, 2), (4, 2))], BACKWARD[:1], 1
    settings = {"shape": shape, "dtype": dtype, "block": block, "lengths": lengths, "budget_s": args.budget_s}
    report = Report(args.out, settings)
    log(f"tune_triton_static: B,HQ,HKV,D={shape} {dtype} block {block} T={lengths}, {args.workers} workers, "
        f"budget {args.budget_s:.0f} s; versions {json.dumps(report.data['versions'])}")

    common = {"shape": shape, "lengths": lengths, "dtype": dtype, "block": block}
    context = multiprocessing.get_context("spawn")  # each worker its own CUDA context
    pool = context.Pool(args.workers, initializer=_start_worker, initargs=(context.Lock(), deadline))

    def run(tasks: list[dict]) -> None:
        """Run tasks in the pool, reporting each as it finishes, until the budget is spent."""
        pending = [pool.apply_async(run_task, (task,)) for task in tasks]
        while pending:
            if time.time() > deadline:
                log(f"budget spent: {len(pending)} candidates not measured")
                return
            for result in [r for r in pending if r.ready()]:
                report.add(result.get())
                pending.remove(result)
            time.sleep(0.1)

    log("\n== forward (and cuDNN) ==")
    tasks = [] if args.dry_run else [
        {"impl": "cudnn", "pattern": p, "mode": m, **common}
        for p, m in (("causal", "fwd"), ("causal", "fwdbwd"), ("window", "fwd"), ("window", "fwdbwd"))
    ]
    tasks += [{"impl": impl, "pattern": "fusion", "mode": mode, **common}
              for mode in ("fwd", "fwdbwd") for impl in ("fused", "separate")]
    for pattern in PATTERNS:
        for tile, launch in forward:
            tasks.append({"impl": "ours", "pattern": pattern, "mode": "fwd", "tiles": {"static_forward": tile},
                          "launch": {"static_forward": launch}, "check": not args.dry_run, **common})
    run(tasks)

    log("\n== forward + backward, the best forward settings ==")
    tasks = []
    for pattern in PATTERNS:
        for best in report.best(pattern, "fwd", best_forward):
            for (dq_tile, dq_launch), (dkdv_tile, dkdv_launch) in backward:
                tiles = {**best["tiles"], "static_backward_dq": dq_tile, "static_backward_dkdv": dkdv_tile}
                launch = {**best["launch"], "static_backward_dq": dq_launch, "static_backward_dkdv": dkdv_launch}
                tasks.append({"impl": "ours", "pattern": pattern, "mode": "fwdbwd", "tiles": tiles, "launch": launch,
                              "check": not args.dry_run, **common})
    run(tasks)
    pool.terminate()  # candidates left over when the budget ran out
    pool.join()

    log("\n== best settings (median ms at the longest length; ratio: cuDNN / ours) ==")
    best = {}
    for pattern in PATTERNS:
        for mode in ("fwd", "fwdbwd"):
            rows = report.best(pattern, mode, 1)
            if rows:
                best[f"{pattern} {mode}"] = {"tiles": rows[0]["tiles"], "launch": rows[0]["launch"], "ms": rows[0]["ms"]}
                log(f"  {pattern:<7} {mode:<7} {describe(rows[0])}  {rows[0]['ms']}")
    report.data["best"] = best
    for mode in ("fwd", "fwdbwd"):
        timed = {r["impl"]: r["ms"] for r in report.data["rows"] if r["pattern"] == "fusion" and r["mode"] == mode
                 and "ms" in r}
        if {"fused", "separate"} <= set(timed):
            ratios = {t: timed["separate"][t] / timed["fused"][t] for t in timed["fused"] if t in timed["separate"]}
            report.data[f"fusion {mode}"] = ratios
            log(f"  fusion  {mode:<7} separate launches / fused: " + ", ".join(f"T={t}: {r:.2f}x" for t, r in ratios.items()))
    report.data["seconds"] = round(time.time() - started, 1)
    report.write()
    log(f"\nwrote {args.out} ({report.data['seconds']} s)")


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    main()
