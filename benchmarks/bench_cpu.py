"""Side-by-side CPU benchmark: nsa_dsl's XLA backend against ejkernel's XLA path.

Every measurement runs in a fresh subprocess, so its peak resident memory (`ru_maxrss`) belongs
to that one case alone, and a case that runs out of memory is reported instead of ending the run.
Both implementations see identical inputs: random normal q/k/v (and gates and cotangent), and
per-token block indices drawn the same way from the same seed.

Run it from the benchmark venv (see benchmarks/README.md):

    /work/benchvenv/bin/python benchmarks/bench_cpu.py --json bench.json

Cases:
  a  selection with explicit block indices, T=4,096 and 2,048 (forward, and forward+backward);
  b  the long sequence: T=65,536 with HQ=32, S=16, and both implementations at T=1,024, about
     the longest ejkernel's per-head, per-token gathers can run on a 24 GB machine;
  c  full NSA with g_cmp (compression + top-k + selection), T=8,192 and 1,536, forward and
     forward+backward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from importlib import metadata

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("nsa_dsl", "ejkernel")
EJKERNEL_ENTRY_POINT = "ejkernel.kernels._xla.native_sparse_attention.native_sparse_attention"
OUT_OF_MEMORY_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "std::bad_alloc")


@dataclass(frozen=True)
class Run:
    """One measurement: an implementation on one shape in one mode, run in its own process."""

    case: str
    impl: str
    path: str  # "selection" (explicit block_indices) or "full" (g_cmp: compression + top-k + selection)
    mode: str  # "fwd" or "fwdbwd"
    B: int
    T: int
    HQ: int
    HKV: int
    D: int
    S: int
    block: int
    repeats: int
    warmup: int
    seed: int
    save_outputs: bool  # keep the outputs so the two implementations can be compared afterwards
    time_budget_s: float  # stop timing once this many seconds have passed and 3 runs are done
    dtype: str = "float32"

    @property
    def shape_label(self) -> str:
        return (f"B={self.B} T={self.T} HQ={self.HQ} HKV={self.HKV} D={self.D} "
                f"{'block_counts' if self.path == 'full' else 'S'}={self.S} block={self.block} {self.dtype}")

    def input_mb(self) -> float:
        """Megabytes of the arrays handed to the attention (q, k, v, gates or indices, cotangent)."""
        words = self.B * self.T * (self.HQ + 2 * self.HKV) * self.D
        if self.path == "full":
            words += 2 * self.B * self.T * self.HQ
        else:
            words += self.B * self.T * self.HKV * (self.S + 1)  # int32 block indices and counts
        if self.mode == "fwdbwd":
            words += self.B * self.T * self.HQ * self.D
        return words * 4 / 2**20


@dataclass
class Outcome:
    run: Run
    status: str = "ok"  # ok | killed (for memory) | oom (allocation failed) | timeout | failed | unavailable
    detail: str = ""
    execution: str | None = None  # "jit" or "eager"
    compile_s: float | None = None
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    peak_rss_mb: float | None = None  # ru_maxrss after the timed runs; for a killed run, the last RSS seen
    setup_rss_mb: float | None = None  # RSS once the inputs exist, before compiling
    xla_temp_mb: float | None = None  # XLA's planned scratch buffers for the compiled function
    wall_s: float | None = None
    outputs_path: str | None = None

    def status_text(self) -> str:
        return {
            "ok": "ok" + (", eager (cannot be jitted)" if self.execution == "eager" else ""),
            "killed": f"killed (OOM): {self.detail}",
            "oom": f"out of memory: {self.detail}",
            "timeout": f"timed out: {self.detail}",
            "unavailable": f"not yet available: {self.detail}",
        }.get(self.status, f"failed: {self.detail}")


# ----------------------------------------------------------------------------------------------
# Case definitions
# ----------------------------------------------------------------------------------------------


def build_runs(cases: list[str], quick: bool, repeats: int | None, seed: int, time_budget_s: float) -> list[Run]:
    """The runs of the requested cases, in order; --quick shrinks every shape for a smoke run."""

    def runs_for(case, path, mode, impls, *, T, HQ, HKV, D, S, block, reps, save=True):
        return [
            Run(case=case, impl=impl, path=path, mode=mode, B=1, T=T, HQ=HQ, HKV=HKV, D=D, S=S, block=block,
                repeats=repeats or reps, warmup=1, seed=seed, save_outputs=save, time_budget_s=time_budget_s)
            for impl in impls
        ]

    runs: list[Run] = []
    if "a" in cases:
        # T=4,096 is the target shape; ejkernel needs more memory there than this machine has, so
        # the same heads at half the length give a measured side-by-side ratio as well.
        shape = dict(HQ=4, HKV=1, D=32, S=4) if quick else dict(HQ=16, HKV=1, D=64, S=4)
        for T in (256, 512) if quick else (2048, 4096):
            for mode in ("fwd", "fwdbwd"):
                runs += runs_for("a", "selection", mode, IMPLS, T=T, **shape, block=64, reps=10)
    if "b" in cases:
        small = dict(T=256, HQ=8, HKV=2, D=32, S=4) if quick else dict(T=1024, HQ=32, HKV=2, D=64, S=16)
        big = dict(T=4096, HQ=8, HKV=2, D=32, S=8) if quick else dict(T=65536, HQ=32, HKV=2, D=64, S=16)
        runs += runs_for("b", "selection", "fwd", IMPLS, **small, block=64, reps=5)
        # ejkernel at the long length only shows how it fails (a smoke run skips that); nsa_dsl's
        # output there has nothing to be compared with.
        runs += runs_for("b", "selection", "fwd", IMPLS[:1] if quick else IMPLS, **big, block=64, reps=3, save=False)
    if "c" in cases:
        # T=8,192 is the target; ejkernel's eager forward still fits at T=1,536 (24 blocks, so
        # top-16 is a real choice for a third of the tokens), for a measured side-by-side ratio.
        shape = dict(HQ=4, HKV=1, D=32, S=4) if quick else dict(HQ=16, HKV=1, D=64, S=16)
        for T in (512,) if quick else (1536, 8192):
            for mode in ("fwd", "fwdbwd"):
                runs += runs_for("c", "full", mode, IMPLS, T=T, **shape, block=64, reps=5)
    return runs


# ----------------------------------------------------------------------------------------------
# Worker: one run inside its own process
# ----------------------------------------------------------------------------------------------


def rss_mb(pid: int | str = "self") -> float | None:
    """Current resident set size of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def volunteer_for_oom_killer() -> None:
    """Make this process the kernel's first choice if memory runs out, so a case that blows up
    is what gets killed, not another process on the machine."""
    try:
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write("1000")
    except OSError:
        pass


def random_block_indices(rng, B: int, T: int, HKV: int, S: int, block: int):
    """For each (batch, token, kv head): S distinct block ids drawn uniformly from the causally
    valid blocks 0..t//block, sorted ascending; rows with fewer than S valid blocks take all of
    them and are padded with -1.

    Robert Floyd's sampling, vectorised over rows: O(rows * S^2) and no rows x blocks matrix,
    so it stays cheap at T = 65,536.
    """
    import numpy as np

    available = np.broadcast_to((np.arange(T) // block + 1)[None, :, None], (B, T, HKV)).reshape(-1)
    chosen = np.full((available.shape[0], S), -1, dtype=np.int64)
    short = available < S
    slots = np.arange(S)[None, :]
    chosen[short] = np.where(slots < available[short, None], slots, -1)
    long_rows = np.flatnonzero(~short)
    n = available[long_rows]
    picked = np.empty((long_rows.size, S), dtype=np.int64)
    for i in range(S):
        j = n - S + i
        r = rng.integers(0, j + 1)
        seen = (picked[:, :i] == r[:, None]).any(axis=1)
        picked[:, i] = np.where(seen, j, r)
    chosen[long_rows] = np.sort(picked, axis=1)
    return chosen.reshape(B, T, HKV, S).astype(np.int32)


def device_normal(rng, shape, chunk_tokens: int = 2048):
    """A float32 jax array of standard normal values from `rng`, filled along the token axis in
    chunks so the peak is the array plus one chunk (a whole-array numpy copy would double it)."""
    import jax
    import jax.numpy as jnp

    out = jnp.zeros(shape, jnp.float32)
    write = jax.jit(lambda dst, src, start: jax.lax.dynamic_update_slice_in_dim(dst, src, start, axis=1),
                    donate_argnums=0)
    for start in range(0, shape[1], chunk_tokens):
        size = min(chunk_tokens, shape[1] - start)
        out = write(out, rng.standard_normal((shape[0], size) + tuple(shape[2:]), dtype="float32"), start)
    return out.block_until_ready()


def make_inputs(run: Run) -> dict:
    """Inputs drawn in a fixed order from one seeded generator, so both implementations get the
    very same values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(run.seed)
    inputs = {
        "q": device_normal(rng, (run.B, run.T, run.HQ, run.D)),
        "k": device_normal(rng, (run.B, run.T, run.HKV, run.D)),
        "v": device_normal(rng, (run.B, run.T, run.HKV, run.D)),
    }
    if run.path == "full":
        inputs["g_cmp"] = jax.nn.sigmoid(device_normal(rng, (run.B, run.T, run.HQ)))
        inputs["g_slc"] = jax.nn.sigmoid(device_normal(rng, (run.B, run.T, run.HQ)))
    else:
        block_indices = random_block_indices(rng, run.B, run.T, run.HKV, run.S, run.block)
        inputs["block_indices"] = jnp.asarray(block_indices)
        # Per-token counts of the real entries rather than int S: ejkernel's backward pass does
        # not mask -1 entries that block_counts lets through (its forward does), so with S its
        # gradients would be wrong on the tokens of the first S-1 blocks.
        inputs["block_counts"] = jnp.asarray((block_indices >= 0).sum(axis=-1, dtype=np.int32))
    if run.mode == "fwdbwd":
        inputs["cotangent"] = device_normal(rng, (run.B, run.T, run.HQ, run.D))
    return inputs


class Unavailable(Exception):
    """nsa_dsl does not provide this path yet."""


def attention_fn(run: Run):
    """(attend, jittable): attend(q, k, v, g_cmp, g_slc, block_indices, block_counts) -> o for the
    run's implementation, and whether it can be traced by jax.jit (ejkernel's g_cmp path cannot)."""
    scale = 1.0 / math.sqrt(run.D)
    if run.impl == "nsa_dsl":
        try:
            import nsa_dsl

            attention = nsa_dsl.native_sparse_attention
            cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=run.block)
        except (ImportError, AttributeError) as exc:
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc

        def attend(q, k, v, g_cmp, g_slc, block_indices, block_counts):
            return attention(q, k, v, g_cmp, g_slc, block_indices, block_counts, None, softmax_scale=scale, cfg=cfg)

        return attend, True

    import jax

    # The registered XLA kernel itself, not the autotuning executor of ejkernel.modules.operations.
    from ejkernel.kernels._xla.native_sparse_attention import native_sparse_attention as ejkernel_nsa_xla

    # Importing ejkernel switches on JAX's persistent compilation cache; off, so compile times are real.
    jax.config.update("jax_enable_compilation_cache", False)

    def attend(q, k, v, g_cmp, g_slc, block_indices, block_counts):
        return ejkernel_nsa_xla(q, k, v, g_cmp, g_slc, block_indices, block_counts, block_size=run.block,
                                softmax_scale=scale)

    # Its top-k reads `array.device`, which tracers lack: the g_cmp path runs eagerly only.
    return attend, run.path != "full"


def measured_fn(run: Run, attend, inputs: dict):
    """The function to time, f(*args) -> pytree, and its arguments."""
    import jax
    import jax.numpy as jnp

    if run.path == "full":
        names = ["q", "k", "v", "g_cmp", "g_slc"]

        def forward(q, k, v, g_cmp, g_slc):
            return attend(q, k, v, g_cmp, g_slc, None, run.S)
    else:
        names = ["q", "k", "v", "block_indices", "block_counts"]

        def forward(q, k, v, block_indices, block_counts):
            return attend(q, k, v, None, None, block_indices, block_counts)

    args = [inputs[name] for name in names]
    if run.mode == "fwd":
        return forward, args
    differentiable = (0, 1, 2, 3, 4) if run.path == "full" else (0, 1, 2)  # q, k, v (and both gates)

    def forward_backward(*args_and_cotangent):
        # value_and_grad, not grad: with grad alone XLA would drop the forward pass, whose value
        # a linear loss does not need.
        *fwd_args, cotangent = args_and_cotangent
        return jax.value_and_grad(lambda *a: jnp.sum(forward(*a) * cotangent), argnums=differentiable)(*fwd_args)

    return forward_backward, args + [inputs["cotangent"]]


def worker(run: Run, result_path: str) -> None:
    """Measure one run. The result file is rewritten after each stage, so if the process is
    killed the parent still learns how far it got (compile time, XLA's planned buffer sizes)."""
    volunteer_for_oom_killer()
    result: dict = {"status": "running"}

    def write_result():
        with open(result_path + ".tmp", "w") as out:
            json.dump(result, out)
        os.replace(result_path + ".tmp", result_path)

    try:
        import jax
        import numpy as np

        jax.devices()
        attend, jittable = attention_fn(run)
        inputs = make_inputs(run)
        fn, args = measured_fn(run, attend, inputs)
        result["setup_rss_mb"] = rss_mb()

        start = time.perf_counter()
        if jittable:
            fn = jax.jit(fn).lower(*args).compile()
            result.update(compile_s=time.perf_counter() - start, execution="jit")
            memory = fn.memory_analysis()
            if memory is not None:
                result["xla_temp_mb"] = memory.temp_size_in_bytes / 2**20
        else:
            jax.block_until_ready(fn(*args))  # the first eager call compiles each op
            result.update(compile_s=time.perf_counter() - start, execution="eager")
        write_result()
        for _ in range(run.warmup):
            jax.block_until_ready(fn(*args))
        times = []
        budget_end = time.perf_counter() + run.time_budget_s
        while len(times) < run.repeats and (len(times) < 3 or time.perf_counter() < budget_end):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            times.append((time.perf_counter() - start) * 1e3)
        result.update(status="ok", times_ms=times, median_ms=statistics.median(times), peak_rss_mb=peak_rss_mb())
        if run.save_outputs:
            path = result_path + ".npz"
            np.savez(path, *[np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(out)])
            result["outputs_path"] = path
    except Unavailable as exc:
        result.update(status="unavailable", detail=str(exc))
    except Exception as exc:  # reported as this run's row; the benchmark goes on
        text = str(exc).strip()
        message = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        out_of_memory = isinstance(exc, MemoryError) or any(marker in text for marker in OUT_OF_MEMORY_MARKERS)
        allocation = re.search(r"allocating (\d+) bytes", text)
        if out_of_memory:
            status = "oom"
            if allocation:
                message = f"{type(exc).__name__}: could not allocate {int(allocation.group(1)) / 2**30:.1f} GiB"
        elif isinstance(exc, NotImplementedError):
            status = "unavailable"  # a path nsa_dsl does not have yet (g_cmp, while it is written)
        else:
            status = "failed"
        result.update(status=status, detail=message[:300], traceback=traceback.format_exc()[-4000:])
    finally:
        write_result()


def baseline_worker(what: str, result_path: str) -> None:
    """Peak RSS of a process that imports jax (and, for the per-implementation baselines, the
    implementation) and initialises the CPU backend: what every run pays before attention."""
    import jax  # noqa: F401 - importing it is what is measured
    import jax.numpy as jnp

    jnp.zeros(8).block_until_ready()
    version = None
    if what == "nsa_dsl":
        import nsa_dsl

        version = getattr(nsa_dsl, "__version__", None)
    elif what == "ejkernel":
        import ejkernel.kernels._xla.native_sparse_attention  # noqa: F401

        version = metadata.version("ejkernel")
    with open(result_path, "w") as out:
        json.dump({"peak_rss_mb": peak_rss_mb(), "version": version}, out)


# ----------------------------------------------------------------------------------------------
# Parent: spawn, watch, collect, report
# ----------------------------------------------------------------------------------------------


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def spawn(argv: list[str], mem_limit_mb: float, timeout_s: float) -> tuple[int, str, float, str]:
    """Run this script as a worker; SIGKILL it if its RSS passes mem_limit_mb or it outlives
    timeout_s. Returns (returncode, stderr tail, highest RSS seen, why it was killed or "")."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    highest, killed_for, start = 0.0, "", time.monotonic()
    while proc.poll() is None:
        rss = rss_mb(proc.pid) or 0.0
        highest = max(highest, rss)
        if rss > mem_limit_mb:
            killed_for = f"RSS passed the {mem_limit_mb:.0f} MB limit"
        elif time.monotonic() - start > timeout_s:
            killed_for = f"ran past {timeout_s:.0f} s"
        if killed_for:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.05)
    reader.join()
    return proc.returncode, "".join(stderr_chunks)[-2000:], highest, killed_for


def run_one(run: Run, workdir: str, mem_limit_mb: float, timeout_s: float) -> Outcome:
    result_path = os.path.join(workdir, f"{run.case}-{run.impl}-{run.path}-{run.mode}-T{run.T}.json")
    with open(result_path + ".run", "w") as spec:
        json.dump(asdict(run), spec)
    start = time.perf_counter()
    returncode, stderr, highest, killed_for = spawn(["--worker", result_path + ".run", result_path],
                                                    mem_limit_mb, timeout_s)
    outcome = Outcome(run=run, wall_s=time.perf_counter() - start)
    result: dict = {}
    if os.path.exists(result_path):
        with open(result_path) as result_file:
            result = json.load(result_file)
    for name in ("detail", "execution", "compile_s", "median_ms", "times_ms", "peak_rss_mb", "setup_rss_mb",
                 "xla_temp_mb", "outputs_path"):
        if result.get(name) is not None:
            setattr(outcome, name, result[name])
    if killed_for.startswith("RSS"):
        outcome.status, outcome.detail, outcome.peak_rss_mb = "killed", killed_for, highest
    elif killed_for:
        outcome.status, outcome.detail = "timeout", killed_for
    elif returncode == -signal.SIGKILL:
        outcome.status, outcome.peak_rss_mb = "killed", highest
        outcome.detail = f"SIGKILL from the kernel at about {highest:.0f} MB RSS"
    elif result.get("status") in (None, "running"):
        last_line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        out_of_memory = any(marker in stderr for marker in OUT_OF_MEMORY_MARKERS)
        outcome.status = "oom" if out_of_memory else "failed"
        outcome.detail = f"process died (exit code {returncode}): {last_line[:300]}"
    else:
        outcome.status = result["status"]
    return outcome


def baseline(what: str, workdir: str) -> dict:
    path = os.path.join(workdir, f"baseline-{what}.json")
    returncode, stderr, _, _ = spawn(["--baseline", what, path], float("inf"), 600)
    if returncode != 0 or not os.path.exists(path):
        last_line = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {returncode}"
        return {"peak_rss_mb": None, "error": last_line}
    with open(path) as result_file:
        return json.load(result_file)


def compare_outputs(ours: Outcome, theirs: Outcome) -> dict | None:
    """Largest absolute difference between the two implementations' outputs (or loss and
    gradients), next to the largest magnitude of ejkernel's."""
    if not (ours.outputs_path and theirs.outputs_path):
        return None
    import numpy as np

    if ours.run.mode == "fwd":
        names = ["o"]
    else:
        names = ["loss", "dq", "dk", "dv"] + (["dg_cmp", "dg_slc"] if ours.run.path == "full" else [])
    with np.load(ours.outputs_path) as a, np.load(theirs.outputs_path) as b:
        return {name: {"max_abs_diff": float(np.max(np.abs(a[f"arr_{i}"] - b[f"arr_{i}"]))),
                       "max_abs_ejkernel": float(np.max(np.abs(b[f"arr_{i}"])))}
                for i, name in enumerate(names)}


def memory_available_mb() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def machine_description() -> dict:
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    with open("/proc/meminfo") as meminfo:
        total_kb = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
    return {"cpu": model, "cores": os.cpu_count(), "memory_gb": round(total_kb / 2**20, 1),
            "os": platform.platform(), "python": platform.python_version()}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def clip(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def compare_pair(ours: Outcome, theirs: Outcome, baselines: dict) -> tuple[dict, str]:
    """Ratios ejkernel / nsa_dsl for one case. When ejkernel was killed for memory, its last
    RSS is a lower bound of its peak, and the memory ratio is printed as ">"."""
    run = ours.run
    entry: dict = {"case": run.case, "mode": run.mode, "T": run.T, "path": run.path}
    prefix = f"  {run.case} {run.mode:<6} T={run.T:<6}"
    if ours.status != "ok":
        return entry, f"{prefix} no ratio: nsa_dsl {clip(ours.status_text())}"
    if theirs.status == "ok":
        net_ours = ours.peak_rss_mb - baselines["nsa_dsl"]
        net_theirs = theirs.peak_rss_mb - baselines["ejkernel"]
        entry.update(time=theirs.median_ms / ours.median_ms, peak_rss=theirs.peak_rss_mb / ours.peak_rss_mb,
                     net_rss=net_theirs / net_ours, output_difference=compare_outputs(ours, theirs))
        text = (f"{prefix} time {entry['time']:.1f}x, peak RSS {entry['peak_rss']:.1f}x, "
                f"net RSS {entry['net_rss']:.1f}x")
        eager = [o.run.impl for o in (ours, theirs) if o.execution == "eager"]
        if eager:
            # An eager run times op-by-op dispatch as well: the time ratio is not jit against jit.
            entry["eager"] = eager
            text += f" ({' and '.join(eager)} eager: not jitted, op-by-op dispatch timed too)"
        if entry["output_difference"]:
            text += "; max |nsa_dsl - ejkernel| " + ", ".join(
                f"{name} {d['max_abs_diff']:.1e} (values up to {d['max_abs_ejkernel']:.2g})"
                for name, d in entry["output_difference"].items())
        return entry, text
    if theirs.status == "killed" and theirs.peak_rss_mb:
        entry.update(peak_rss_at_least=theirs.peak_rss_mb / ours.peak_rss_mb,
                     net_rss_at_least=(theirs.peak_rss_mb - baselines["ejkernel"]) / (ours.peak_rss_mb - baselines["nsa_dsl"]))
        return entry, (f"{prefix} peak RSS >{entry['peak_rss_at_least']:.0f}x, net RSS >{entry['net_rss_at_least']:.0f}x "
                       f"(ejkernel killed at {theirs.peak_rss_mb:.0f} MB); no time ratio")
    return entry, f"{prefix} no ratio: ejkernel {clip(theirs.status_text())}"


def report(outcomes: list[Outcome], baselines: dict, mem_limit_mb: float) -> tuple[str, list[dict]]:
    lines = [
        "Baseline peak RSS of a process that imports jax and initialises the CPU backend: "
        f"{fmt(baselines['jax'], '.0f')} MB; with nsa_dsl imported: {fmt(baselines['nsa_dsl'], '.0f')} MB; "
        f"with ejkernel imported: {fmt(baselines['ejkernel'], '.0f')} MB.",
        "net MB = peak RSS - that implementation's import baseline (inputs included); "
        "XLA temp MB = scratch buffers of the compiled function (memory_analysis).",
        f"A subprocess whose RSS passes {mem_limit_mb:.0f} MB is killed (--mem-limit-gb); '>N' = RSS when killed.",
        "",
    ]
    header = (f"{'case':<4} {'mode':<6} {'T':>6} {'impl':<8} {'compile s':>9} {'median ms':>10} {'n':>3} "
              f"{'peak RSS MB':>11} {'net MB':>7} {'XLA temp MB':>11}  status")
    lines += [header, "-" * len(header)]
    for o in outcomes:
        ok = o.status == "ok"
        peak = fmt(o.peak_rss_mb, ".0f") if ok else (f">{o.peak_rss_mb:.0f}" if o.status == "killed" and o.peak_rss_mb else "-")
        net = fmt(o.peak_rss_mb - baselines[o.run.impl], ".0f") if ok and baselines[o.run.impl] is not None else "-"
        status = clip(o.status_text())
        lines.append(f"{o.run.case:<4} {o.run.mode:<6} {o.run.T:>6} {o.run.impl:<8} {fmt(o.compile_s, '.1f'):>9} "
                     f"{fmt(o.median_ms, '.1f'):>10} {len(o.times_ms) or '-':>3} {peak:>11} {net:>7} "
                     f"{fmt(o.xla_temp_mb, '.0f'):>11}  {status}")

    lines += ["", "Ratios ejkernel / nsa_dsl (above 1: nsa_dsl faster / smaller):"]
    pairs: dict[tuple, dict[str, Outcome]] = {}
    for o in outcomes:
        pairs.setdefault((o.run.case, o.run.mode, o.run.T, o.run.path), {})[o.run.impl] = o
    ratios = []
    for by_impl in pairs.values():
        if set(by_impl) == set(IMPLS):
            entry, text = compare_pair(by_impl["nsa_dsl"], by_impl["ejkernel"], baselines)
            ratios.append(entry)
            lines.append(text)
    return "\n".join(lines), ratios


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--cases", default="a,b,c", help="comma-separated subset of a,b,c (default: all)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of nsa_dsl,ejkernel")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per measurement (default: 10 for a, 5 for c and b at T=1,024, 3 at T=65,536)")
    parser.add_argument("--time-budget", type=float, default=120.0,
                        help="stop timing a measurement after this many seconds once 3 runs are done (default 120)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--mem-limit-gb", type=float, default=None,
                        help="kill a subprocess whose RSS passes this (default: 90%% of MemAvailable at start)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a subprocess is killed (default 1800)")
    parser.add_argument("--worker", nargs=2, metavar=("RUN_JSON", "RESULT_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--baseline", nargs=2, metavar=("WHAT", "RESULT_JSON"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name`, None where it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        with open(args.worker[0]) as spec:
            worker(Run(**json.load(spec)), args.worker[1])
        return 0
    if args.baseline:
        baseline_worker(*args.baseline)
        return 0

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = sorted(set(cases) - {"a", "b", "c"}) + sorted(set(impls) - set(IMPLS))
    if unknown:
        print(f"unknown case or implementation: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print("--repeats must be at least 1", file=sys.stderr)
        return 2
    runs = [r for r in build_runs(cases, args.quick, args.repeats, args.seed, args.time_budget) if r.impl in impls]
    mem_limit_mb = args.mem_limit_gb * 1024 if args.mem_limit_gb else 0.9 * memory_available_mb()

    started = datetime.datetime.now().astimezone()
    versions = {name: installed_version(name) for name in ("jax", "jaxlib", "numpy", "ejkernel")}
    if "ejkernel" in impls and versions["ejkernel"] is None:
        print("ejkernel is not installed here: use the benchmark venv (benchmarks/README.md) or --impls nsa_dsl",
              file=sys.stderr)
        return 2
    command = " ".join([sys.executable] + sys.argv)
    machine = machine_description()
    print(f"nsa_dsl vs ejkernel's XLA path on CPU, {started:%Y-%m-%d %H:%M %Z}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB; python {machine['python']}")
    print("versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()))
    print(f"command: {command}")
    print(f"ejkernel: {EJKERNEL_ENTRY_POINT} (its registered XLA kernel), JAX persistent compilation cache off")
    print(f"inputs: random normal fp32 q/k/v from numpy seed {args.seed} (c: gates sigmoid(normal)); a, b: per-token "
          "block indices = S distinct causally valid block ids, sorted, -1 padded, block_counts = number of valid "
          "ids per token; softmax_scale 1/sqrt(D)")
    print("timing: AOT jit compile (c/ejkernel: first eager call), 1 warm-up, median of the timed runs with "
          "block_until_ready; fwdbwd = value_and_grad of sum(o * cotangent) w.r.t. q, k, v (c: and g_cmp, g_slc)")
    print()

    with tempfile.TemporaryDirectory(prefix="nsa_bench_") as workdir:
        found = {what: baseline(what, workdir) for what in ("jax", "nsa_dsl", "ejkernel")}
        baselines = {what: found[what].get("peak_rss_mb") for what in found}
        if baselines["nsa_dsl"] is None:  # nsa_dsl does not import; its rows say why
            baselines["nsa_dsl"] = baselines["jax"]
        outcomes = []
        described = set()
        for run in runs:
            if (run.case, run.mode, run.T) not in described:
                described.add((run.case, run.mode, run.T))
                print(f"[{run.case}] {run.path} {run.mode}: {run.shape_label}; up to {run.repeats} timed runs; "
                      f"inputs {run.input_mb():.0f} MB", flush=True)
            outcome = run_one(run, workdir, mem_limit_mb, args.timeout)
            print(f"    {run.impl:<8} {outcome.status_text()}; median {fmt(outcome.median_ms, '.1f')} ms, "
                  f"compile {fmt(outcome.compile_s, '.1f')} s, peak RSS {fmt(outcome.peak_rss_mb, '.0f')} MB, "
                  f"wall {outcome.wall_s:.0f} s", flush=True)
            outcomes.append(outcome)
        table, ratios = report(outcomes, baselines, mem_limit_mb)
        print()
        print(table)

        if args.json:
            document = {
                "date": started.isoformat(timespec="seconds"),
                "command": command,
                "machine": machine,
                "versions": {**versions, "nsa_dsl": found["nsa_dsl"].get("version")},
                "ejkernel_entry_point": EJKERNEL_ENTRY_POINT,
                "memory_limit_mb": mem_limit_mb,
                "baseline_rss_mb": baselines,
                "runs": [{**asdict(o.run), **{k: v for k, v in asdict(o).items() if k not in ("run", "outputs_path")},
                          "status_text": o.status_text()} for o in outcomes],
                "ratios": ratios,
            }
            with open(args.json, "w") as out:
                json.dump(document, out, indent=2)
            print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
