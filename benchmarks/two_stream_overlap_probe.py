"""Does an L2-bound gather kernel overlap with a tensor-bound one on two CUDA streams? FLA's selection
(B1 HQ64 HKV4 D128 bf16, 16 random causal blocks of 64 per token, T = 64k) and FlexAttention's
sliding window 512 (torch.compile), each alone, then launched together on two streams (in both
orders), then one after the other on one stream. PyTorch only (no JAX): what XLA cannot express on
jaxlib 0.11 (its stream annotations fail, NOTES "Session 22 contracts"), measured where it can be.

    python3 benchmarks/two_stream_overlap_probe.py      # on the GPU machine, fla-core installed

Prints the median ms of 5 timed runs (after 2 warm-ups) for each.
"""

from __future__ import annotations

import statistics

import torch
from fla.ops.nsa import parallel_nsa
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

T, HQ, HKV, D, SELECTED, BLOCK, WINDOW = 65536, 64, 4, 128, 16, 64, 512


def inputs():
    torch.manual_seed(0)
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    blocks = T // BLOCK
    token_block = torch.arange(T, device="cuda") // BLOCK
    scores = torch.rand(1, T, HKV, blocks, device="cuda")
    scores = scores.masked_fill(torch.arange(blocks, device="cuda") > token_block[None, :, None, None], -1.0)
    counts = torch.clamp(token_block + 1, max=SELECTED)[None, :, None].expand(1, T, HKV).contiguous()
    indices = scores.topk(SELECTED, dim=-1).indices
    indices = torch.where(torch.arange(SELECTED, device="cuda") < counts[..., None], indices, -1).sort(-1).values
    return q, k, v, indices, counts


def median_ms(fn, runs=7, warmup=2):
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[warmup:])


def main() -> None:
    q, k, v, indices, counts = inputs()

    def selection():
        parallel_nsa(q, k, v, block_indices=indices, block_counts=counts, block_size=BLOCK, scale=D**-0.5)

    group = HQ // HKV
    q_bhtd, k_bhtd, v_bhtd = (x.transpose(1, 2).contiguous() for x in (
        q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < WINDOW), None, None, T, T, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)

    def window():
        flex(q_bhtd, k_bhtd, v_bhtd, block_mask=mask)

    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def together(first, second):
        def run():
            current = torch.cuda.current_stream()
            for stream, fn in zip(streams, (first, second)):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    fn()
            for stream in streams:
                current.wait_stream(stream)
        return run

    selection(), window()
    torch.cuda.synchronize()
    alone = median_ms(selection), median_ms(window)
    print(f"selection alone {alone[0]:.2f} ms, window alone {alone[1]:.2f} ms, sum {sum(alone):.2f}")
    print(f"two streams, selection first: {median_ms(together(selection, window)):.2f} ms")
    print(f"two streams, window first:    {median_ms(together(window, selection)):.2f} ms")
    print(f"one stream, sequential:        {median_ms(lambda: (selection(), window())):.2f} ms")


if __name__ == "__main__":
    main()
