"""Every Triton kernel compiles for an H100/H200 (sm_90a) within its shared memory, checked on a
machine without a GPU (tests/triton_sm90.py compiles them with Triton's own compiler and ptxas).

The interpreter tests check what the kernels compute; this checks what only a GPU compile would
otherwise reveal: code the interpreter accepts but the compiler rejects (a non-constexpr bound of
tl.static_range, say) and tiles that ask more shared memory than the multiprocessor has (float32
with wide heads). Shapes are the benchmark's (GQA 16, D = 128, bfloat16) and the widest float32
heads; sequence lengths change the kernels only where long selections run their forward key block
by key block (BLOCK_OUTER_PAIRS: 128k tokens here) and decoding steps split their walks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

HERE = Path(__file__).resolve().parent
# Opt-in shared memory per block of an H100/H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SM90_SHARED_BYTES = 232448
SLOWEST_COMPILE_S = 120

BENCHMARK = {"batch": 1, "seq_len": 4096, "heads_q": 64, "heads_kv": 4, "head_dim": 128, "dtype": "bfloat16"}
LONG = 1 << 17
PER_BLOCK = (
    "pattern p\nblock 64\ncausal\nbranch cmp = compress(block=64, stride=64) gate g_cmp\n"
    "branch slc = topk(16, block=64, score=cmp, force=local(1)) per block(64) gate g_slc\n"
)
CASES = {
    # Full NSA (compression, top-k, selection, window) and explicit selection at the benchmark's shape,
    # short and long; NSA as on a Hopper GPU too (its top-k then ranks a given mass).
    "benchmark shape, bfloat16": [
        {"pattern": "nsa.nsa", **BENCHMARK}, {"pattern": "nsa.nsa", **BENCHMARK, "hopper": True},
        {"selection": True, **BENCHMARK},
        {"selection": True, **BENCHMARK, "seq_len": LONG},
    ],
    # Static patterns with fused and tabled launches; NSA in float32 (half the rows per tile) and
    # without GQA; the widest float32 heads of explicit selection and of a `per block(Q)` selection
    # (64 KB of group rows beside a 128 KB key block a step).
    "static patterns, float16 and float32": [
        {"pattern": "bigbird.nsa", **BENCHMARK, "head_dim": 64},
        {"pattern": "longformer.nsa", **BENCHMARK, "head_dim": 96, "dtype": "float16"},
        {"pattern": "nsa_meanpool.nsa", **BENCHMARK, "heads_q": 12, "head_dim": 100, "dtype": "float32"},
        {"pattern": "nsa.nsa", **BENCHMARK, "heads_q": 4, "head_dim": 64},  # no GQA: a tile of 64 tokens
        {"selection": True, **BENCHMARK, "heads_q": 16, "heads_kv": 1, "head_dim": 256, "dtype": "float32"},
        {"selection": True, **BENCHMARK, "seq_len": LONG, "heads_q": 16, "heads_kv": 1, "head_dim": 256,
         "dtype": "float32"},
        {"pattern": PER_BLOCK, **BENCHMARK, "heads_q": 16, "heads_kv": 1, "head_dim": 256, "dtype": "float32"},
    ],
    # Decoding steps of 8 sequences: tiles of one query row and a group's heads (padded to 16 rows for
    # GQA 4), walks split into shares; one sequence of 1M tokens splits its top-k into 64. Two
    # sequences, forward and backward: the compression walks each sequence's keys apart (while loops).
    "decoding steps": [
        {"pattern": "nsa.nsa", **BENCHMARK, "batch": 2, "seq_len": 1000},
        {"pattern": "nsa.nsa", **BENCHMARK, "batch": 8, "decode": True},
        {"pattern": "nsa.nsa", **BENCHMARK, "seq_len": 1 << 20, "decode": True},
        {"pattern": "nsa.nsa", **BENCHMARK, "batch": 8, "heads_q": 16, "dtype": "float16", "decode": True},
    ],
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    """Each group of cases compiled in a process of its own, the groups side by side."""
    env = child_env(JAX_PLATFORMS="cpu")  # traced, not run: on a GPU machine too, launches must not reach jax-triton
    env.pop("TRITON_INTERPRET", None)
    if env.get("TRITON_CACHE_DIR") == "":  # as a process that imported jax_triton itself has it (ejkernel,
        # say): Triton's compiler then refuses to compile ("Could not create or locate cache dir")
        env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton"))
    workers = {}
    for name, cases in CASES.items():
        env_case = {**env, "NSA_DSL_CACHE_DIR": str(tmp_path_factory.mktemp("sm90"))}
        command = [sys.executable, str(HERE / "triton_sm90.py"), json.dumps(cases)]
        workers[name] = subprocess.Popen(
            command, env=env_case, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for name, worker in workers.items():
        stdout, stderr = worker.communicate(timeout=900)
        assert worker.returncode == 0, f"{name}: worker failed\n{stderr[-3000:]}"
        results[name] = json.loads(stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("group", list(CASES))
def test_every_kernel_compiles_for_sm90_within_shared_memory(compiled, group):
    kernels = compiled[group]
    assert kernels, "no kernel was launched"
    errors = [f"{k['kernel']}: {k['error']}" for k in kernels if "error" in k]
    assert not errors, "\n".join(errors)
    too_big = [f"{k['kernel']}: {k['shared']} bytes" for k in kernels if k["shared"] > SM90_SHARED_BYTES]
    assert not too_big, f"more shared memory than an sm_90 block may have ({SM90_SHARED_BYTES} bytes): {too_big}"
    # A first call compiles its kernels: one that takes minutes (topk_merge unrolled over 64 shares did
    # on the H200) stalls it.
    slow = [f"{k['kernel']}: {k['seconds']} s" for k in kernels if k["seconds"] > SLOWEST_COMPILE_S]
    assert not slow, f"kernels that compile for over {SLOWEST_COMPILE_S} s: {slow}"
    names = {k["kernel"] for k in kernels}
    if group == "decoding steps":
        # 8 sequences' 32 programs split their selected blocks into shares, merged as the gate applies;
        # one sequence of 1M tokens splits its top-k into 64 shares, merged by topk_merge
        assert {"compression_forward", "topk_selection", "selection_forward", "gated_merge", "topk_merge"} <= names
    if group.startswith("benchmark"):
        assert {
            "compression_forward", "topk_selection", "selection_forward", "selection_forward_by_block",
            "selection_backward_dkdv",
            "selection_backward_dq", "selection_backward_dq_from_scores",
        } <= names
