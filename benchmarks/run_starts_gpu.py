"""Where each run of equal values starts in a sorted array, six ways, timed back to back on one
device: the pair lists' segments at bench_gpu's 64k setting (4 KV heads x 1025 lists x 16 row
segments over 4.2M sorted pairs; layout.selection_by_key_block). Session 54's ncu timeline found
XLA running the binary search as 9 kernels (0.041 ms): it fuses two or three of the 22 halvings a
kernel. Each way's result is checked against np.searchsorted; the kernel count is the compiled
HLO's entry instructions that launch work (a proxy: ncu's timeline is the measure).

    python3 benchmarks/run_starts_gpu.py            # on the H200 (the Triton way needs jax_triton)
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PAIRS, LISTS, SEGMENTS = 65536 * 16 * 4, 4 * 1025, 16
COUNT = LISTS * SEGMENTS


def binary(values):
    """layout.search_sorted's way: jnp.searchsorted unrolled."""
    return jnp.searchsorted(values, jnp.arange(COUNT + 1, dtype=jnp.int32), side="left", method="scan_unrolled")


def branchless(values):
    """A binary search with one carry (the count below), in case XLA fuses more of its chain."""
    found = jnp.zeros((COUNT + 1,), jnp.int32)
    bounds = jnp.arange(COUNT + 1, dtype=jnp.int32)
    for step in reversed(range(PAIRS.bit_length())):
        probe = found + (1 << step)
        value = jnp.take(values, jnp.minimum(probe, PAIRS) - 1, mode="clip")
        found = jnp.where((probe <= PAIRS) & (value < bounds), probe, found)
    return found


def scatter_cummin(values):
    """benchmarks/results/pair_lists_run_starts_2026-12-04s54.patch's layout.run_starts: each run's
    first position scattered to its value, a reverse running minimum for values with no run."""
    first = jnp.concatenate([jnp.ones((1,), bool), values[1:] != values[:-1]])
    at = jnp.where(first, values, COUNT + 1)
    starts = jnp.full((COUNT + 1,), PAIRS, jnp.int32).at[at].set(
        jnp.arange(PAIRS, dtype=jnp.int32), mode="drop", unique_indices=True)
    return lax.cummin(starts, axis=0, reverse=True)


def scatter_starts_and_ends(values):
    """Each run's first and one-past-last positions (0, 0 for values with no run): what a kernel
    reading two arrays instead of one would take; no running minimum."""
    change, edge = values[1:] != values[:-1], jnp.ones((1,), bool)
    first, last = jnp.concatenate([edge, change]), jnp.concatenate([change, edge])
    positions = jnp.arange(PAIRS, dtype=jnp.int32)
    starts, ends = (jnp.zeros((COUNT + 1,), jnp.int32).at[jnp.where(edge, values, COUNT + 1)].set(
        at, mode="drop", unique_indices=True) for edge, at in ((first, positions), (last, positions + 1)))
    return starts, ends


def counts_cumsum(values):
    """Each value's count (an integer scatter-add: exact in any order, so deterministic though XLA
    adds with atomics on a GPU), then their running sum (a forward cumsum: one chlo.scan on a GPU).
    Order-free: the unsorted values give the same starts, so it need not wait for the sort."""
    counts = jnp.zeros((COUNT,), jnp.int32).at[values].add(1, mode="drop")
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


def triton_search(values):
    """One Triton kernel: each lane a bound's branchless binary search."""
    import jax_triton
    import triton
    import triton.language as tl

    @triton.jit
    def count_below(values, found, COUNT: tl.constexpr, TOTAL: tl.constexpr, STEPS: tl.constexpr,
                    BLOCK: tl.constexpr):
        bounds = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        below = tl.zeros([BLOCK], tl.int32)
        for i in tl.static_range(STEPS):
            probe = below + (1 << (STEPS - 1 - i))
            value = tl.load(values + probe - 1, mask=probe <= TOTAL, other=2147483647)
            below = tl.where(value < bounds, probe, below)
        tl.store(found + bounds, below, mask=bounds <= COUNT)

    return jax_triton.triton_call(
        values, kernel=count_below, out_shape=jax.ShapeDtypeStruct((COUNT + 1,), jnp.int32),
        grid=(-(-(COUNT + 1) // 256),), COUNT=COUNT, TOTAL=PAIRS, STEPS=PAIRS.bit_length(), BLOCK=256)


def main():
    values = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, COUNT, PAIRS)).astype(np.int32))
    want = np.searchsorted(np.asarray(values), np.arange(COUNT + 1), side="left")
    has_run = np.diff(np.append(want, PAIRS)) > 0
    ways = [binary, branchless, scatter_cummin, scatter_starts_and_ends, counts_cumsum]
    if jax.default_backend() == "gpu":
        ways.append(triton_search)
    print(f"{PAIRS} sorted values in [0, {COUNT}), {jax.devices()[0].device_kind}; ms a call, 200 back to back")
    for way in ways:
        call = jax.jit(way)
        out = jax.block_until_ready(call(values))
        if way is scatter_starts_and_ends:
            starts, ends = (np.asarray(x) for x in out)
            correct = (np.array_equal(starts[has_run], want[has_run])
                       and np.array_equal(ends[:-1][has_run[:-1]], want[1:][has_run[:-1]]))
        else:
            correct = np.array_equal(np.asarray(out), want)
        entry = call.lower(values).compile().as_text().split("\nENTRY", 1)[1]
        kernels = sum(entry.count(f" {op}(") for op in ("fusion", "scatter", "custom-call", "reduce-window", "gather"))
        start = time.perf_counter()
        for _ in range(200):
            out = call(values)
        jax.block_until_ready(out)
        print(f"{way.__name__:24s} {1e3 * (time.perf_counter() - start) / 200:8.4f} ms  ~{kernels} kernels  "
              f"correct: {correct}", flush=True)


if __name__ == "__main__":
    main()
