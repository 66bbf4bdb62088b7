"""Probe (PyTorch + Triton, GPU): does a sliding window's forward overlap the selection's gated merge
when both run in one kernel?

The NSA forward's window (tensor-bound) and the merge of the selection's parts (HBM-bound) are
independent; separately they cost ~2.6 ms (the Mosaic GPU window) + ~4.7 ms at 64k. Here, on
random inputs of the NSA setting, one Triton kernel computes a tile's window attention and then
merges that tile's selection shares, the compression's term and the gates into the output; it is
timed against the same window kernel alone plus a separate merge kernel. Checked against a
float32 PyTorch reference at a short length first.

    python3 benchmarks/window_merge_probe.py --seq-len 65536 --out DIR
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os

import torch
import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)
MIN_SCORE = tl.constexpr(-1.0e30)


@triton.jit
def window_steps(
    q_tile, k, v, rows, dims, head_kv, seq_len, qk_scale, top, norm, acc, start, stop,
    HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, KEYS: tl.constexpr, MASKED: tl.constexpr,
):
    """The online softmax over key blocks [start, stop) (KEYS keys a step); MASKED: some rows do not
    see some of their keys."""
    for block_start in range(start, stop, KEYS):
        keys = block_start + tl.arange(0, KEYS)
        kv_at = keys.to(tl.int64)[:, None] * (HEADS_KV * HEAD_DIM) + head_kv * HEAD_DIM + dims[None, :]
        k_tile = tl.load(k + kv_at, mask=(keys < seq_len)[:, None], other=0.0)
        scores = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale
        if MASKED:
            seen = (keys[None, :] <= rows[:, None]) & (keys[None, :] > rows[:, None] - WINDOW)
            scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        rescale = tl.math.exp2(top - new_top)
        p = tl.math.exp2(scores - new_top[:, None])
        norm = norm * rescale + tl.sum(p, 1)
        v_tile = tl.load(v + kv_at, mask=(keys < seq_len)[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v_tile.dtype), v_tile)
        top = new_top
    return top, norm, acc


@triton.jit
def gated_shares(shares, share_lse, term, term_gate, share_gate, row_at, at, used, seq_len, HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, SHARE_STEP: tl.constexpr):
    """term_gate * term + share_gate * the shares merged by their lse (base 2), for rows of one head:
    row_at their places in [T, HEADS] arrays, `at` in [T, HEADS, HEAD_DIM] ones."""
    total = tl.load(term_gate + row_at, mask=used, other=0.0).to(tl.float32)[:, None] * tl.load(
        term + at, mask=used[:, None], other=0.0).to(tl.float32)
    splits = tl.arange(0, SPLITS)
    all_lse = tl.load(share_lse + splits[None, :] * (seq_len * HEADS) + row_at[:, None], mask=used[:, None],
                      other=float("-inf"))
    lse_top = tl.max(all_lse, 1)
    lse_top = tl.where(lse_top > float("-inf"), lse_top, 0.0)
    lse_norm = tl.sum(tl.math.exp2(all_lse - lse_top[:, None]), 1)
    weight = tl.load(share_gate + row_at, mask=used, other=0.0).to(tl.float32) / tl.where(lse_norm > 0, lse_norm, 1.0)
    # SHARE_STEP shares' loads in flight at a time (all SPLITS at once spill).
    for first in range(0, SPLITS, SHARE_STEP):
        for offset in tl.static_range(SHARE_STEP):
            split = first + offset
            share_lse_row = tl.load(share_lse + split * seq_len * HEADS + row_at, mask=used, other=float("-inf"))
            share = tl.load(shares + split * seq_len.to(tl.int64) * (HEADS * HEAD_DIM) + at, mask=used[:, None],
                            other=0.0)
            total += (weight * tl.math.exp2(share_lse_row - lse_top))[:, None] * share.to(tl.float32)
    return total


@triton.jit
def window_merge(
    q, k, v, shares, share_lse, term, term_gate, share_gate, window_gate, out, scale, seq_len,
    HEADS: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr,
    ROWS: tl.constexpr, KEYS: tl.constexpr, SPLITS: tl.constexpr, MERGE: tl.constexpr, MERGE_FIRST: tl.constexpr,
    SHARE_STEP: tl.constexpr, ALTERNATE: tl.constexpr,
):
    """out = window_gate * window(q, k, v) + term_gate * term + share_gate * merge(shares) for ROWS
    query rows of one head (program_id(0) the head, so a tile's heads run together and share K/V
    in L2). MERGE False: out = window(q, k, v) alone; MERGE_FIRST: the shares before the window.
    """
    head = tl.program_id(0)
    tile = tl.program_id(1)
    head_kv = head // (HEADS // HEADS_KV)
    rows = tile * ROWS + tl.arange(0, ROWS)
    used = rows < seq_len
    dims = tl.arange(0, HEAD_DIM)
    at = rows.to(tl.int64)[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + dims[None, :]
    row_at = rows * HEADS + head
    # MERGE_FIRST: every program merges first; ALTERNATE: the odd heads' programs do, so that
    # programs on one multiprocessor are in different phases.
    if ALTERNATE:
        merge_first = head % 2 == 1
    else:
        merge_first = tl.full([], MERGE_FIRST, tl.int1)
    if MERGE:
        total = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        if merge_first:
            total = gated_shares(shares, share_lse, term, term_gate, share_gate, row_at, at, used, seq_len, HEADS,
                                 HEAD_DIM, SPLITS, SHARE_STEP)
    q_tile = tl.load(q + at, mask=used[:, None], other=0.0)
    qk_scale = scale * LOG2_E
    top = tl.full([ROWS], MIN_SCORE, tl.float32)
    norm = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    first_row = tile * ROWS
    lo = tl.maximum(first_row - WINDOW + 1, 0) // KEYS * KEYS
    # Blocks that every row of the tile sees whole: [full_lo, full_hi).
    full_hi = first_row // KEYS * KEYS
    full_lo = tl.minimum(tl.maximum((first_row + ROWS - WINDOW + KEYS - 1) // KEYS * KEYS, lo), full_hi)
    hi = tl.minimum(first_row + ROWS, seq_len)
    top, norm, acc = window_steps(q_tile, k, v, rows, dims, head_kv, seq_len, qk_scale, top, norm, acc, lo, full_lo,
                                  HEADS_KV, HEAD_DIM, WINDOW, KEYS, True)
    top, norm, acc = window_steps(q_tile, k, v, rows, dims, head_kv, seq_len, qk_scale, top, norm, acc, full_lo,
                                  full_hi, HEADS_KV, HEAD_DIM, WINDOW, KEYS, False)
    top, norm, acc = window_steps(q_tile, k, v, rows, dims, head_kv, seq_len, qk_scale, top, norm, acc, full_hi, hi,
                                  HEADS_KV, HEAD_DIM, WINDOW, KEYS, True)
    window_out = acc / tl.where(norm > 0, norm, 1.0)[:, None]
    if MERGE:
        if not merge_first:
            total = gated_shares(shares, share_lse, term, term_gate, share_gate, row_at, at, used, seq_len, HEADS,
                                 HEAD_DIM, SPLITS, SHARE_STEP)
        total += window_out * tl.load(window_gate + row_at, mask=used, other=0.0).to(tl.float32)[:, None]
        tl.store(out + at, total.to(out.dtype.element_ty), mask=used[:, None])
    else:
        tl.store(out + at, window_out.to(out.dtype.element_ty), mask=used[:, None])


@triton.jit
def merge_only(
    shares, share_lse, term_0, gate_0, term_1, gate_1, share_gate, out, rows_total,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr,
):
    """The separate merge (as the product's gated_merge): out = share_gate * merge(shares) + the two
    gated terms, ROWS (row, head) rows a program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    used = rows < rows_total
    dims = tl.arange(0, HEAD_DIM)
    at = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    top = tl.full([ROWS], MIN_SCORE, tl.float32)
    norm = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for split in tl.static_range(SPLITS):
        share_lse_row = tl.load(share_lse + split * rows_total + rows, mask=used, other=float("-inf"))
        new_top = tl.maximum(top, share_lse_row)
        rescale = tl.math.exp2(top - new_top)
        part = tl.math.exp2(share_lse_row - new_top)
        norm = norm * rescale + part
        share = tl.load(shares + split * rows_total.to(tl.int64) * HEAD_DIM + at, mask=used[:, None], other=0.0)
        acc = acc * rescale[:, None] + part[:, None] * share.to(tl.float32)
        top = new_top
    total = acc / tl.where(norm > 0, norm, 1.0)[:, None] * tl.load(share_gate + rows, mask=used, other=0.0).to(
        tl.float32)[:, None]
    total += tl.load(gate_0 + rows, mask=used, other=0.0).to(tl.float32)[:, None] * tl.load(
        term_0 + at, mask=used[:, None], other=0.0).to(tl.float32)
    total += tl.load(gate_1 + rows, mask=used, other=0.0).to(tl.float32)[:, None] * tl.load(
        term_1 + at, mask=used[:, None], other=0.0).to(tl.float32)
    tl.store(out + at, total.to(out.dtype.element_ty), mask=used[:, None])


def make_inputs(seq_len, heads, heads_kv, head_dim, splits, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    def gate(*shape):
        return torch.rand(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    inputs = dict(
        q=normal(seq_len, heads, head_dim),
        k=normal(seq_len, heads_kv, head_dim),
        v=normal(seq_len, heads_kv, head_dim),
        shares=normal(splits, seq_len, heads, head_dim),
        share_lse=torch.randn(splits, seq_len, heads, generator=gen, device="cuda") * 4,
        term=normal(seq_len, heads, head_dim), term_gate=gate(seq_len, heads), share_gate=gate(seq_len, heads),
        window_gate=gate(seq_len, heads),
    )
    # Shares that saw no key (lse -inf), as a selection's empty entries give.
    inputs["share_lse"][:, ::7, 3] = float("-inf")
    return inputs


def reference(inputs, window, scale):
    q, k, v = (inputs[name].float() for name in "qkv")
    seq_len, heads, _ = q.shape
    group = heads // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, kk) * scale
    rows = torch.arange(seq_len, device="cuda")
    seen = (rows[None, :] <= rows[:, None]) & (rows[None, :] > rows[:, None] - window)
    scores = scores.masked_fill(~seen, float("-inf"))
    window_out = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), vv)
    lse = inputs["share_lse"]
    weights = torch.softmax(lse * math.log(2), 0).nan_to_num(0.0)  # base-2 lse
    merged = (weights[..., None] * inputs["shares"].float()).sum(0)
    gates = {name: inputs[name].float()[..., None] for name in ("window_gate", "term_gate", "share_gate")}
    terms = gates["term_gate"] * inputs["term"].float() + gates["share_gate"] * merged
    return gates["window_gate"] * window_out + terms


def run_fused(inputs, window, scale, rows, keys, warps, stages, merge=True, merge_first=False, share_step=1,
              alternate=False):
    q = inputs["q"]
    seq_len, heads, head_dim = q.shape
    out = torch.empty_like(q)
    grid = (heads, triton.cdiv(seq_len, rows))
    window_merge[grid](
        q, inputs["k"], inputs["v"], inputs["shares"], inputs["share_lse"], inputs["term"], inputs["term_gate"],
        inputs["share_gate"], inputs["window_gate"], out, scale, seq_len,
        HEADS=heads, HEADS_KV=inputs["k"].shape[1], HEAD_DIM=head_dim, WINDOW=window, ROWS=rows, KEYS=keys,
        SPLITS=inputs["shares"].shape[0], MERGE=merge, MERGE_FIRST=merge_first, SHARE_STEP=share_step,
        ALTERNATE=alternate,
        num_warps=warps, num_stages=stages,
    )
    return out


def run_separate(inputs, window, scale, rows, keys, warps, stages, merge_rows=16, merge_warps=4):
    window_out = run_fused(inputs, window, scale, rows, keys, warps, stages, merge=False)
    q = inputs["q"]
    seq_len, heads, head_dim = q.shape
    out = torch.empty_like(q)
    rows_total = seq_len * heads
    merge_only[(triton.cdiv(rows_total, merge_rows),)](
        inputs["shares"], inputs["share_lse"], inputs["term"], inputs["term_gate"], window_out, inputs["window_gate"],
        inputs["share_gate"], out, rows_total, HEAD_DIM=head_dim, ROWS=merge_rows, SPLITS=inputs["shares"].shape[0],
        num_warps=merge_warps, num_stages=1,
    )
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--check-len", type=int, default=1000)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    heads, heads_kv, head_dim, splits, window = 64, 4, 128, 16, 512
    scale = head_dim ** -0.5
    os.makedirs(args.out, exist_ok=True)
    results = dict(settings=dict(seq_len=args.seq_len, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                                 splits=splits, window=window, dtype="bfloat16", device=torch.cuda.get_device_name()))

    small = make_inputs(args.check_len, heads, heads_kv, head_dim, splits, torch.bfloat16)
    expected = reference(small, window, scale)
    merge_first = functools.partial(run_fused, merge_first=True)
    alternate = functools.partial(run_fused, alternate=True)
    variants = (("fused", run_fused), ("merge_first", merge_first), ("alternate", alternate),
                ("separate", run_separate))
    for (name, fn), tiles in itertools.product(variants, ((64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2))):
        error = (fn(small, window, scale, *tiles).float() - expected).abs().max().item()
        results[f"check_{name}_{tiles}"] = error
        print(f"check {name} {tiles}: max error {error:.3e}", flush=True)

    inputs = make_inputs(args.seq_len, heads, heads_kv, head_dim, splits, torch.bfloat16)
    timings = []
    for tiles in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2)):
        entry = dict(zip(("rows", "keys", "warps", "stages"), tiles))
        try:
            variants = [("window", lambda: run_fused(inputs, window, scale, *tiles, merge=False)),
                        ("separate", lambda: run_separate(inputs, window, scale, *tiles))]
            for share_step, alternate in itertools.product((1, 2), (False, True)):
                variants.append((f"fused_step{share_step}{'_alternate' if alternate else ''}",
                                 functools.partial(run_fused, inputs, window, scale, *tiles, share_step=share_step,
                                                   alternate=alternate)))
            for name, fn in variants:
                entry[name] = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
        except Exception as error:  # a tile that does not fit: recorded, not fatal
            entry["error"] = f"{type(error).__name__}: {error}"[:200]
        timings.append(entry)
        print(json.dumps(entry), flush=True)
    for merge_rows, merge_warps in ((16, 4),):
        window_out = run_fused(inputs, window, scale, 64, 64, 4, 2, merge=False)
        rows_total = args.seq_len * heads
        out = torch.empty_like(inputs["q"])

        def merge():
            merge_only[(triton.cdiv(rows_total, merge_rows),)](
                inputs["shares"], inputs["share_lse"], inputs["term"], inputs["term_gate"], window_out,
                inputs["window_gate"], inputs["share_gate"], out, rows_total, HEAD_DIM=head_dim, ROWS=merge_rows,
                SPLITS=splits, num_warps=merge_warps, num_stages=1,
            )

        entry = dict(merge_rows=merge_rows, merge_warps=merge_warps,
                     merge=triton.testing.do_bench(merge, warmup=10, rep=60, return_mode="median"))
        timings.append(entry)
        print(json.dumps(entry), flush=True)
    results["timings"] = timings
    with open(os.path.join(args.out, "window_merge_probe.json"), "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
