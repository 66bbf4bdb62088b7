"""Autotuning: time a kernel's candidate configurations on random inputs of the real shapes and
keep the fastest, persisted on disk.

Each candidate runs forward and forward+backward (`jax.value_and_grad` of the output's inner
product with a random cotangent) on the same random inputs (never zeros: a kernel may skip
work on them). Before it is timed, its output on a small slice of those inputs is compared with
the kernel's reference configuration (the XLA backend), and its gradients on the whole inputs
with the heuristic configuration's; a candidate that differs, or fails to compile or run, is
dropped with an AutotuneWarning and never chosen. The fastest
forward+backward wins (ties: the faster forward).

The choice is an entry `<cache root>/autotune/<key[:2]>/<key>.json` whose key covers the
device kind, the kernel and its version, the invocation's abstract arguments, the code that
runs (the kernel's fingerprint: plan and templates) and the versions of nsa_dsl, jax, jaxlib
and triton. Entries are written as the generated-module cache writes (a temporary file moved
into place with os.replace), so concurrent writers leave one valid entry and readers never see
a partial one; an entry carries the sha256 of its own content, and one that is damaged or does
not parse is ignored (and written anew by the next tuning).

Compiling dominates on a GPU (Triton compiles each candidate's forward and backward kernels,
XLA the programs around them), so tuning runs in two phases: the candidates' programs are
lowered and compiled ahead of time on `NSA_DSL_AUTOTUNE_WORKERS` threads (default: the CPU
count, at most 8; Triton's compiler, ptxas and XLA's compiler release the interpreter lock),
then timed one after another once every compile has ended, so that no worker delays a timed
call. `NSA_DSL_AUTOTUNE_SECONDS` (default 120) bounds the first phase: compiles are started in
the kernel's order, its heuristic configuration first, and those that would start after the
time is up are left out (the entry counts them).

`NSA_DSL_AUTOTUNE` sets when tuning happens for calls that do not pass a configuration:
"0" never (the heuristic configuration, tuned entries are not read), "1" on the first call of
every new shape, unset: tuned entries are used where they exist and a new shape is tuned on
its first call only where it runs compiled GPU/TPU kernels (see Kernel.tunes_lazily).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ._version import __version__
from .codegen import cache_root
from .codegen.cache import CacheWarning, library_version, write_atomically

if TYPE_CHECKING:
    from .kernel import Invocation, Kernel

# Timed calls per measurement, after one untimed call that compiles and warms up; the median counts.
REPEATS = 5
DEFAULT_SECONDS = 120.0
DEFAULT_WORKERS = 8
_LIBRARIES = ("jax", "jaxlib", "triton")


class AutotuneWarning(UserWarning):
    """A candidate configuration was rejected (wrong result, or it failed to compile or run)."""


def policy() -> str:
    """"off", "on" or "lazy" (the default) from NSA_DSL_AUTOTUNE ("0", "1" or unset)."""
    value = os.environ.get("NSA_DSL_AUTOTUNE", "").strip().lower()
    if value == "":
        return "lazy"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise ValueError(f"NSA_DSL_AUTOTUNE must be 0 (never tune), 1 (tune every new shape) or unset, got {value!r}")


def time_limit() -> float:
    """Seconds of tuning per shape, from NSA_DSL_AUTOTUNE_SECONDS (default DEFAULT_SECONDS)."""
    value = os.environ.get("NSA_DSL_AUTOTUNE_SECONDS", "").strip()
    if not value:
        return DEFAULT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"NSA_DSL_AUTOTUNE_SECONDS must be a number of seconds >= 0, got {value!r}")
    return seconds


class ProgressBar:
    """A one-line progress bar on stderr: redrawn in place on a terminal, a line per step otherwise."""

    WIDTH = 24

    def __init__(self, total: int, label: str, stream=None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.stream = stream if stream is not None else sys.stderr
        self.in_place = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = 0
        self._draw("")

    def advance(self, note: str = "") -> None:
        self.done += 1
        self._draw(note)

    def close(self, note: str = "") -> None:
        if note:
            self.stream.write(("\n" if self.in_place else "") + f"{self.label}: {note}")
        if self.in_place or note:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, note: str) -> None:
        filled = self.WIDTH * self.done // max(self.total, 1)
        text = f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total}"
        text += f" {note}" if note else ""
        if self.in_place:
            self.stream.write("\r" + text.ljust(self._drawn))
            self._drawn = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def describe(cfg: object) -> str:
    """The settings of a configuration that are set, e.g. "triton block_k=64 num_warps=4"."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    platform = fields.pop("platform", None)
    settings = " ".join(f"{name}={value}" for name, value in fields.items()
                        if value is not None and name not in ("backend", "block_size"))
    return f"{platform or 'auto'} {settings}".strip()


# ---- the persistent choice ---------------------------------------------------------------------


def device_description() -> str:
    """The device the timings hold for, e.g. "gpu:NVIDIA H200" or "cpu:cpu"."""
    return f"{jax.default_backend()}:{jax.devices()[0].device_kind}"


@functools.cache
def versions() -> dict[str, str]:
    """The versions of nsa_dsl and of the libraries its kernels run on (read once: every call
    without a configuration looks its entry up)."""
    return {"nsa_dsl": __version__, **{name: library_version(name) for name in _LIBRARIES}}


def entry_key(kernel: Kernel, inv: Invocation) -> str:
    parts = {
        "op": f"{kernel.op_id}@{kernel.version}",
        "invocation": inv.signature,
        "device": device_description(),
        "code": kernel.fingerprint(inv),
        **versions(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def entry_path(kernel: Kernel, inv: Invocation) -> Path:
    """Where the tuned configuration of (kernel, invocation) on this device is kept."""
    key = entry_key(kernel, inv)
    return cache_root() / "autotune" / key[:2] / f"{key}.json"


def _checksum(entry: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def read_entry(path: Path, config_type: type) -> tuple[Any, dict] | None:
    """(configuration, entry) stored at `path`, or None if it is missing, damaged or not one."""
    try:
        stored = json.loads(path.read_text())
        entry = stored["entry"]
        if stored["sha256"] != _checksum(entry) or entry["key"] != path.stem:
            return None
        return config_type(**entry["cfg"]), entry
    except (OSError, ValueError, TypeError, KeyError):  # unreadable, bad JSON or UTF-8, wrong structure or values
        return None


def write_entry(path: Path, entry: Mapping[str, Any]) -> None:
    """Store a tuning's entry; where the cache cannot take it, warn (the process keeps its choice,
    a later process tunes again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"sha256": _checksum(entry), "entry": entry}, indent=1).encode())
    except OSError as err:
        warnings.warn(f"nsa_dsl could not store a tuned configuration at {path} ({err})", CacheWarning, stacklevel=3)


# Choices already read or made in this process, by entry path (None: no entry on disk).
_known: dict[Path, Any] = {}
_known_lock = threading.Lock()


def lookup(kernel: Kernel, inv: Invocation) -> Any | None:
    """The tuned configuration of (kernel, invocation) on this device, or None."""
    path = entry_path(kernel, inv)
    with _known_lock:
        if path not in _known:
            found = read_entry(path, kernel.config_type)
            if found is not None and not kernel.admits(inv, found[0]):
                warnings.warn(f"nsa_dsl ignored the tuned configuration at {path}: {found[0]} would change the "
                              "result, which tuning never does (an entry edited or copied from elsewhere)",
                              CacheWarning, stacklevel=4)
                found = None
            _known[path] = found[0] if found is not None else None
        return _known[path]


def forget() -> None:
    """Drop what this process remembers of tuned entries: the next lookup reads the disk again."""
    with _known_lock:
        _known.clear()


# ---- timing ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurement:
    cfg: Any
    forward_s: float
    forward_backward_s: float
    error: float  # relative to the reference on the check slice

    def record(self) -> dict:
        return {
            "cfg": dataclasses.asdict(self.cfg),
            "forward_ms": self.forward_s * 1e3,
            "forward_backward_ms": self.forward_backward_s * 1e3,
            "error": self.error,
        }


class _Mismatch(Exception):
    pass


def _is_array(value: object) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def _median_time(fn: Callable, args: tuple, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiles and warms up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected| over the leaves (inf if not finite), computed where
    the arrays are (gradients of the tuning inputs are as large as the inputs), in float32 or wider."""
    worst = 0.0
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        a, e = jnp.asarray(a), jnp.asarray(e)
        if a.shape != e.shape:
            return float("inf")
        wide = jnp.promote_types(jnp.promote_types(a.dtype, e.dtype), jnp.float32)
        a, e = a.astype(wide), e.astype(wide)
        if not bool(jnp.isfinite(a).all()):
            return float("inf")
        worst = max(worst, float(jnp.abs(a - e).max(initial=0.0)) / max(float(jnp.abs(e).max(initial=0.0)), 1e-30))
    return worst


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A candidate's forward and forward+backward, compiled ahead of time for the tuning inputs."""
    cfg: Any
    forward: Callable  # (arrays) -> out
    step: Callable  # (differentiable, constant) -> (loss, gradients)
    step_args: tuple


def _compile(kernel: Kernel, cfg, arguments: Mapping[str, Any], cotangent_seed: int) -> _Compiled:
    """Lower and compile cfg's programs; runs nothing on the device (safe in a worker thread)."""
    arrays = {name: value for name, value in arguments.items() if _is_array(value)}
    statics = {name: value for name, value in arguments.items() if not _is_array(value)}
    floating = {name for name, value in arrays.items() if jnp.issubdtype(value.dtype, jnp.floating)}

    def forward(arrays):
        return kernel.run(**statics, **arrays, cfg=cfg)

    lowered = jax.jit(forward).lower(arrays)
    rng = np.random.default_rng(cotangent_seed)  # the same cotangent for every candidate
    cotangent = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), lowered.out_info)

    def loss(differentiable, constant):
        outputs = jax.tree_util.tree_leaves(forward({**constant, **differentiable}))
        return sum(jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32))
                   for o, c in zip(outputs, jax.tree_util.tree_leaves(cotangent)))

    step_args = ({name: arrays[name] for name in floating},
                 {name: value for name, value in arrays.items() if name not in floating})
    step = jax.jit(jax.value_and_grad(loss)).lower(*step_args).compile()
    return _Compiled(cfg, lowered.compile(), step, step_args)


def _measure(compiled: _Compiled, arrays: Mapping[str, Any], check: Callable, check_gradients: Callable,
             repeats: int) -> Measurement:
    out = jax.block_until_ready(compiled.forward(arrays))
    error = check(out)
    check_gradients(jax.block_until_ready(compiled.step(*compiled.step_args))[1])
    forward_s = _median_time(compiled.forward, (arrays,), repeats)
    forward_backward_s = _median_time(compiled.step, compiled.step_args, repeats)
    return Measurement(compiled.cfg, forward_s, forward_backward_s, error)


def compile_workers() -> int:
    """Candidates compiled at once, from NSA_DSL_AUTOTUNE_WORKERS (default: the CPU count, at most 8)."""
    value = os.environ.get("NSA_DSL_AUTOTUNE_WORKERS", "").strip()
    if not value:
        return max(1, min(os.cpu_count() or 1, DEFAULT_WORKERS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"NSA_DSL_AUTOTUNE_WORKERS must be a whole number >= 1, got {value!r}")
    return int(value)


def _compile_all(kernel: Kernel, candidates: list, arguments: Mapping[str, Any], seed: int, deadline: float,
                 label: str | None) -> list[Future]:
    """Compile the candidates on compile_workers() threads, in order; a candidate whose compile
    would start after `deadline` is left out (its future holds None), except the first. Returns
    once every compile has ended: nothing is timed while the workers hold the interpreter lock."""

    def job(index: int, cfg) -> _Compiled | None:
        if index > 0 and time.perf_counter() >= deadline:
            return None
        return _compile(kernel, cfg, arguments, seed)

    bar = ProgressBar(len(candidates), f"{label} compiling") if label else None
    with ThreadPoolExecutor(max_workers=compile_workers(), thread_name_prefix="nsa_dsl-autotune") as pool:
        futures = [pool.submit(job, index, cfg) for index, cfg in enumerate(candidates)]
        for _ in as_completed(futures):
            if bar is not None:
                bar.advance()
    if bar is not None:
        bar.close()
    return futures


def tune(kernel: Kernel, inv: Invocation, *, candidates: Iterable | None = None, repeats: int | None = None,
         progress: bool = True, seed: int = 0):
    """Time `candidates` (default: kernel.candidate_cfgs(inv)) on random inputs of the
    invocation's shapes, `repeats` (default REPEATS) timed calls each, persist the fastest
    correct one and return it. Runs eagerly even when called while jax traces the caller (the
    invocation's arguments may be tracers)."""
    with jax.ensure_compile_time_eval():
        return _tune(kernel, inv, candidates, REPEATS if repeats is None else repeats, progress, seed)


def _tune(kernel: Kernel, inv: Invocation, candidates, repeats: int, progress: bool, seed: int):
    kernel.check_invocation(inv)
    candidates = list(kernel.candidate_cfgs(inv) if candidates is None else candidates)
    if not candidates:
        raise ValueError(f"autotune: {kernel.op_id} has no candidate configurations for this invocation")
    arguments = kernel.tuning_arguments(inv, np.random.default_rng(seed))
    sliced, take = kernel.check_slice(inv, arguments)
    reference = kernel.reference_cfg(inv)
    expected = jax.device_get(kernel.run(**sliced, cfg=reference))

    def check(out) -> float:
        error = relative_error(take(out), expected)
        tolerance = max(kernel.tolerance(leaf.dtype) for leaf in jax.tree_util.tree_leaves(out))
        if not error <= tolerance:
            raise _Mismatch(f"its output differs from the reference ({describe(reference)}): "
                            f"relative error {error:.2e} > {tolerance:.0e}")
        return error

    measured: list[Measurement] = []
    rejected: list[dict] = []
    limit, start = time_limit(), time.perf_counter()
    label = f"nsa_dsl autotune {kernel.op_id}" if progress else None
    futures = _compile_all(kernel, candidates, arguments, seed + 1, start + limit, label)
    compile_s = time.perf_counter() - start
    arrays = {name: value for name, value in arguments.items() if _is_array(value)}
    check_gradients = _gradient_check(kernel, inv, candidates, futures, arguments, seed + 1)
    untimed = sum(1 for future in futures if future.exception() is None and future.result() is None)
    bar = ProgressBar(len(candidates) - untimed, label) if progress else None
    for cfg, future in zip(candidates, futures, strict=True):
        try:
            # A compile that failed on a worker thread is repeated here: only a failure that
            # recurs rejects the candidate (Python 3.11's ast.parse, which Triton calls, is not
            # thread-safe).
            compiled = future.result() if future.exception() is None else _compile(kernel, cfg, arguments, seed + 1)
            if compiled is None:
                continue
            measured.append(_measure(compiled, arrays, check, check_gradients, repeats))
        except Exception as err:  # noqa: BLE001 -- any failure rejects the candidate: fail closed
            reason = str(err) if isinstance(err, _Mismatch) else f"{type(err).__name__}: {err}"
            rejected.append({"cfg": dataclasses.asdict(cfg), "reason": reason})
            warnings.warn(f"autotune {kernel.op_id}: rejected {describe(cfg)}: {reason}", AutotuneWarning, stacklevel=3)
        if bar is not None:
            best = min(measured, key=_rank, default=None)
            bar.advance(f"best {best.forward_backward_s * 1e3:.3f} ms ({describe(best.cfg)})" if best else "")
    if bar is not None:
        bar.close(f"{untimed} not timed: NSA_DSL_AUTOTUNE_SECONDS={limit:g} spent" if untimed else "")
    if not measured:
        warnings.warn(
            f"autotune {kernel.op_id}: every candidate was rejected; using {describe(reference)}, not persisted",
            AutotuneWarning, stacklevel=3,
        )
        return reference
    best = min(measured, key=_rank)
    path = entry_path(kernel, inv)
    write_entry(path, {
        "key": path.stem,
        "op": f"{kernel.op_id}@{kernel.version}",
        "device": device_description(),
        "invocation": inv.signature,
        "cfg": dataclasses.asdict(best.cfg),
        "forward_ms": best.forward_s * 1e3,
        "forward_backward_ms": best.forward_backward_s * 1e3,
        "measured": [m.record() for m in measured],
        "rejected": rejected,
        "untimed": untimed,
        "compile_workers": compile_workers(),
        "compile_s": compile_s,
        "timing_s": time.perf_counter() - start - compile_s,
        "versions": versions(),
    })
    with _known_lock:
        _known[path] = best.cfg
    return best.cfg


def _gradient_check(kernel: Kernel, inv: Invocation, candidates: list, futures: list[Future],
                    arguments: Mapping[str, Any], cotangent_seed: int) -> Callable:
    """check_gradients(gradients): _Mismatch unless a candidate's forward+backward gradients on the
    tuning inputs are those of the kernel's heuristic configuration (correct by its contract, and
    what the tests check against float64 references). The output check's slice cannot judge
    gradients: later queries add to the slice's keys' gradients. If the heuristic configuration
    fails here, every candidate is rejected: nothing says their gradients are right."""
    heuristic = kernel.heuristic_cfg(inv)
    try:
        compiled = next((future.result() for cfg, future in zip(candidates, futures, strict=True)
                         if cfg == heuristic and future.exception() is None and future.result() is not None), None)
        compiled = compiled or _compile(kernel, heuristic, arguments, cotangent_seed)
        expected, failure = compiled.step(*compiled.step_args)[1], None
    except Exception as err:  # noqa: BLE001 -- fail closed, as a failing candidate does
        expected, failure = None, f"{type(err).__name__}: {err}"

    def check_gradients(gradients) -> None:
        if failure is not None:
            raise _Mismatch(f"no gradients to compare with: the heuristic configuration ({describe(heuristic)}) "
                            f"failed: {failure}")
        error = relative_error(gradients, expected)
        tolerance = max(kernel.tolerance(leaf.dtype) for leaf in jax.tree_util.tree_leaves(gradients))
        if not error <= tolerance:
            raise _Mismatch(f"its gradients differ from the heuristic configuration's ({describe(heuristic)}): "
                            f"relative error {error:.2e} > {tolerance:.0e}")

    return check_gradients


def _rank(m: Measurement) -> tuple[float, float]:
    return m.forward_backward_s, m.forward_s
