"""How bench_gpu.py times a call, shared by its JAX process and its PyTorch worker so that every
row of a table is measured the same way.

A measurement is: the first call (compilation, autotuning and the run: reported apart), one
warm-up call, then batches of back-to-back calls each ended by a device synchronisation; the
per-call time of a batch is its wall-clock time over its number of calls, and the result is the
median over batches. Batches hold enough calls to last about `min_batch_ms`, and at least
MIN_CALLS_PER_BATCH, so host dispatch overlaps device work as it does in a training step (a call
is queued while the one before it runs), and short kernels are not dominated by the launch of a
single call. No L2 flush between calls (neither framework's peers get one here).

Each batch leaves the device idle while its first call is dispatched and while its end is
synchronised, ~0.75 ms in all for the 64k NSA forward on an H200 (session 68: 0.2 ms a call less
at 15 calls a batch than at 3). Rows whose batches last alike carry alike shares of it:
MIN_BATCH_MS (300) gives that 20 ms call 15 a batch and cuDNN's 117 ms one 3, ~0.2-0.25% each,
where 20 ms batches (the default until session 79) gave the short call 1.25% and the long one 0.2%.
Measured apart on an H100 (batch_length_ab.py, session 81), the long batches made the NSA forward
1.3% slower, not faster: the card reaches its power cap within a ~300 ms batch (SM clock ~1800
against ~1900 MHz), where cuDNN's three 117 ms calls take it either way. Long batches time the
sustained rate of a training step, alike for every row; short ones flatter short calls.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

# Calls a batch at least: with one call a batch (any call past min_batch_ms, e.g. a forward at 64k
# tokens) a batch would time that call's host dispatch and the synchronisation's round trip as well
# as its device work, which a training step's queue of calls hides.
MIN_CALLS_PER_BATCH = 3
# A batch's length, about (the module's docstring says why).
MIN_BATCH_MS = 300.0
# Seconds of batches after which timing stops once three are done: ~5 batches of MIN_BATCH_MS.
TIME_CAP_S = 1.5


def measure(call: Callable[[], object], sync: Callable[[object], None], *, batches: int = 10,
            min_batch_ms: float = MIN_BATCH_MS, time_cap_s: float = TIME_CAP_S) -> dict:
    """Time `call()`; `sync(result)` blocks until the device has finished it.

    Stops after `batches` batches, or after `time_cap_s` seconds of batches once three are
    done. Returns ms (the median per-call time), first_call_s, calls_per_batch and samples_ms.
    """
    start = time.perf_counter()
    sync(call())
    first_call_s = time.perf_counter() - start
    start = time.perf_counter()
    sync(call())
    one_ms = (time.perf_counter() - start) * 1e3
    calls_per_batch = max(MIN_CALLS_PER_BATCH, min(64, math.ceil(min_batch_ms / max(one_ms, 1e-3))))
    samples = []
    timing_start = time.perf_counter()
    while len(samples) < batches:
        start = time.perf_counter()
        result = None
        for _ in range(calls_per_batch):
            result = call()
        sync(result)
        samples.append((time.perf_counter() - start) * 1e3 / calls_per_batch)
        if len(samples) >= 3 and time.perf_counter() - timing_start > time_cap_s:
            break
    return {"ms": statistics.median(samples), "first_call_s": first_call_s, "calls_per_batch": calls_per_batch,
            "samples_ms": [round(s, 4) for s in samples]}


def error_text(err: BaseException) -> str:
    """One line naming the exception: what a table cell and a JSON field can hold."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
