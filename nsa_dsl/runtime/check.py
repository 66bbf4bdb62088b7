"""`nsa-compile --check`: a generated kernel against a dense float64 reference on random data.

The reference (`reference_output`) is written from the language's semantics, not from kernel
code: the pattern oracle's token mask (static branches), the explicit selection rule (select
branches), mean-pooled compressed keys (compress branches) and the top-k rule over their
probabilities (topk branches); dense softmax attention in numpy float64, branches summed with
their gates.
It is quadratic in T: for checks and examples at small lengths. The test suite keeps its own,
separate reference (tests/reference.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..plan import oracle
from ..plan import plan as p
from .dispatch import attend, check_supported
from .platform import resolve_platform

# The dense reference is quadratic: longer requests are checked at this length.
MAX_CHECK_LEN = 1024
_BATCH, _HEADS_Q, _HEADS_KV, _HEAD_DIM = 1, 4, 2, 64
# The time a call reported: the mean of the calls after the first, at most TIMED_CALLS, no more once TIMING_S passed.
TIMED_CALLS, TIMING_S = 3, 1.0


@dataclass(frozen=True)
class CheckReport:
    ok: bool
    seq_len: int
    max_error: float | None = None  # max |kernel - reference| / max |reference|
    seconds_per_call: float | None = None
    reason: str = ""

    def __str__(self) -> str:
        if self.max_error is None:
            return f"not checked: {self.reason}"
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{verdict}: max relative error {self.max_error:.2e} against the float64 reference at T={self.seq_len} "
            f"(B={_BATCH}, HQ={_HEADS_Q}, HKV={_HEADS_KV}, D={_HEAD_DIM}, float32), "
            f"{self.seconds_per_call * 1e3:.1f} ms per call"
        )


def selection_mask(indices: np.ndarray, counts: np.ndarray, block: int) -> np.ndarray:
    """[B, HKV, T, T]: query t sees key s <= t iff s's block is among its first counts entries."""
    batch, seq_len, heads_kv, width = indices.shape
    num_blocks = -(-seq_len // block)
    t = np.arange(seq_len)
    used = (np.arange(width) < counts[..., None]) & (indices >= 0) & (indices <= (t // block)[None, :, None, None])
    chosen = np.zeros((batch, seq_len, heads_kv, num_blocks + 1), dtype=bool)
    np.put_along_axis(chosen, np.where(used, indices, num_blocks), True, axis=-1)
    mask = chosen[..., t // block] & (t[None, :] <= t[:, None])[None, :, None, :]  # [B, T(query), HKV, T(key)]
    return mask.transpose(0, 2, 1, 3)


def dense_attention(q, k, v, mask, scale) -> np.ndarray:
    """Softmax attention over an explicit mask [B, HKV or 1, T, T], in float64; rows that see
    nothing give zeros."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    mask = np.repeat(mask, group, axis=1) if mask.shape[1] > 1 else mask
    logits = np.einsum("bthd,bshd->bhts", q, np.repeat(k, group, axis=2)) * scale
    logits = np.where(mask, logits, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True, initial=-np.inf)  # no keys: a sequence shorter than a compressed block
    weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", weights / np.where(total > 0, total, 1.0), np.repeat(v, group, axis=2))


def reference_output(plan: p.Plan, q, k, v, *, gates=None, softmax_scale=None, block_indices=None, block_counts=None) -> np.ndarray:
    """The plan's attention in float64 on one sequence per batch row (small T: it is dense).
    Gates as for the kernels: a passed gate weighs its branch, an absent one its default, and a
    branch with neither is skipped."""
    gates = gates or {}
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    seq_len = q.shape[1]
    out = np.zeros(q.shape)
    for branch in plan.branches:
        if branch.gate is None:
            weight = 1.0
        elif branch.gate.name in gates:
            weight = np.asarray(gates[branch.gate.name], dtype=np.float64)[..., None]
        elif branch.gate.default is not None:
            weight = branch.gate.default
        else:
            continue
        if isinstance(branch, p.StaticBranch):
            mask = oracle.token_mask(branch.static, plan.block_size, plan.causal, seq_len)[None, None]
        elif isinstance(branch, p.SelectBranch):
            counts = np.broadcast_to(np.asarray(block_counts), np.shape(block_indices)[:3])
            mask = selection_mask(np.asarray(block_indices), counts, branch.block)
        elif isinstance(branch, p.CompressBranch):
            k_cmp, v_cmp, visible = compressed(branch, k, v)
            out += weight * dense_attention(q, k_cmp, v_cmp, visible, scale)
            continue
        else:
            chosen = top_blocks(branch, plan.branch(branch.score), q, k, scale)
            mask = selection_mask(chosen, np.full(chosen.shape[:3], branch.count), branch.block)
        out += weight * dense_attention(q, k, v, mask, scale)
    return out


def compressed(branch: p.CompressBranch, k, v):
    """Mean-pooled keys and values [B, C, HKV, D] and which queries see them [1, 1, T, C]."""
    seq_len = k.shape[1]
    count = (seq_len - branch.block) // branch.stride + 1 if seq_len >= branch.block else 0
    starts = np.arange(count) * branch.stride
    # [C, block]: the key rows each compressed key pools (none where the block is past the sequence)
    windows = starts[:, None] + np.arange(min(branch.block, seq_len))
    k_cmp, v_cmp = (np.asarray(x, np.float64)[:, windows].mean(axis=2) for x in (k, v))
    visible = starts[None, :] + branch.block - 1 <= np.arange(seq_len)[:, None]
    return k_cmp, v_cmp, visible[None, None]


def top_blocks(branch: p.TopKBranch, score: p.CompressBranch, q, k, scale) -> np.ndarray:
    """[B, T, HKV, min(count, blocks)] blocks a top-k branch selects, -1 unused: importance of selection
    block j = compression probabilities of the compressed blocks overlapping it, weighted by
    the stride units they share, summed over the KV group's heads (and the queries of a
    `per block` group); forced blocks first, then the best valid ones, lower ids on ties."""
    k_cmp, _, visible = compressed(score, k, k)
    batch, seq_len, heads_q, _ = q.shape
    heads_kv = k.shape[2]
    group = heads_q // heads_kv
    logits = np.einsum("bthd,bchd->bhtc", np.asarray(q, np.float64), np.repeat(k_cmp, group, axis=2)) * scale
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True, initial=-np.inf)
    probs = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
    probs /= np.maximum(probs.sum(axis=-1, keepdims=True), 1e-300)
    num_sel = -(-seq_len // branch.block)
    first = np.arange(k_cmp.shape[1])[:, None] * score.stride
    shared = np.minimum(first + score.block, (np.arange(num_sel)[None, :] + 1) * branch.block) - np.maximum(
        first, np.arange(num_sel)[None, :] * branch.block)
    importance = probs @ (np.maximum(shared, 0) / score.stride)  # [B, HQ, T, num_sel]
    importance = importance.reshape(batch, heads_kv, group, seq_len, num_sel).sum(axis=2)
    groups = np.arange(seq_len) // branch.query_block
    importance = np.stack([importance[:, :, groups == g].sum(axis=2) for g in groups], axis=2)
    last = np.minimum((groups + 1) * branch.query_block, seq_len) - 1  # each query's group's last query
    valid = np.arange(num_sel)[None, :] <= (last // branch.block)[:, None]  # [T, num_sel]
    forced = np.zeros_like(valid)
    if branch.force is not None:
        keys = oracle.token_mask(branch.force, branch.block, True, seq_len)  # block-level: any key of a block
        forced = keys[last][:, np.minimum(np.arange(num_sel) * branch.block, seq_len - 1)] & valid
    ranked = np.where(valid, np.where(forced, np.inf, importance), -np.inf)  # [B, HKV, T, num_sel]
    order = np.argsort(-ranked, axis=-1, kind="stable")[..., : branch.count]  # stable: lower ids on ties
    # No padding to `count` columns: a count past the blocks (topk(2**31 - 1) takes every block) would
    # ask for that many, and selection_mask reads as many as there are.
    chosen = np.where(np.take_along_axis(ranked, order, axis=-1) > -np.inf, order, -1)
    return chosen.transpose(0, 2, 1, 3)


def check_pattern(plan: p.Plan, seq_len: int, *, platform: str = "xla", tolerance: float = 1e-4, seed: int = 0) -> CheckReport:
    try:
        check_supported(plan, platform)
        resolve_platform(platform)  # e.g. triton not installed, or a platform this device has not
    except (NotImplementedError, ValueError) as err:
        return CheckReport(False, seq_len, reason=str(err))
    learned = [b.name for b in plan.branches if isinstance(b, p.CompressBranch) and b.pool == "learned"]
    if learned:
        return CheckReport(False, seq_len, reason=f"branches {learned} pool with a function only the caller has")
    seq_len = min(seq_len, MAX_CHECK_LEN)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((_BATCH, seq_len, _HEADS_Q, _HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((_BATCH, seq_len, _HEADS_KV, _HEAD_DIM)).astype(np.float32) for _ in range(2))
    gates = {gate.name: rng.uniform(0.5, 1.5, (_BATCH, seq_len, _HEADS_Q)).astype(np.float32) for gate in plan.gates}
    selection = {}
    for branch in plan.branches:
        if isinstance(branch, p.SelectBranch):
            num_blocks = -(-seq_len // branch.block)
            selection = {
                "block_indices": rng.integers(-1, num_blocks, (_BATCH, seq_len, _HEADS_KV, 4)).astype(np.int32),
                "block_counts": rng.integers(0, 5, (_BATCH, seq_len, _HEADS_KV)).astype(np.int32),
            }

    run = lambda: attend(plan, q, k, v, gates=gates, platform=platform, **selection)  # noqa: E731
    out = np.asarray(run().block_until_ready())
    # An interpreted kernel (Triton's or Pallas' on a CPU) takes seconds a call: one times it well enough.
    start, calls = time.perf_counter(), 0
    while calls < TIMED_CALLS and (calls == 0 or time.perf_counter() - start < TIMING_S):
        run().block_until_ready()
        calls += 1
    seconds = (time.perf_counter() - start) / calls

    expected = reference_output(plan, q, k, v, gates=gates, **selection)
    error = float(np.abs(out - expected).max() / max(np.abs(expected).max(), 1e-30))
    return CheckReport(error <= tolerance, seq_len, error, seconds)
