"""topk_merge, which merges a split top-k's shares (a decoding step's few programs each rank a share
of the blocks), run in Triton's interpreter against numpy: the best blocks of all shares, ties to
the lower id, forced blocks first, shares with empty slots or none."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from nsa_reference import small_example

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch, triton_glue


@pytest.fixture(scope="module")
def module():
    """The generated Triton module of the NSA example (compression, top-k, selection, window)."""
    source, _ = small_example("nsa")
    return codegen.load_module("triton", nsa_dsl.compile(source).plan, dispatch.for_device(None))


def ranking_keys(module, scores, ids):
    """The top-k's running best keys for (score, block id) entries, highest first per row, as the
    kernel encodes them (module BLOCK_BITS, KEY_BIAS; id -1: an empty slot): float64 bits."""
    block_bits, bias, mask = (getattr(module, n).value for n in ("BLOCK_BITS", "KEY_BIAS", "BLOCK_MASK"))
    bits = (scores.astype(np.float32).view(np.int32).astype(np.int64) << block_bits) + bias + (mask - ids)
    keys = np.where(ids >= 0, bits.view(np.float64), -1.0 - np.arange(ids.shape[-1]))
    return -np.sort(-keys, axis=-1)


@pytest.mark.parametrize("splits, count, count_pad", [(2, 5, 8), (4, 16, 16), (7, 3, 4), (64, 16, 16)])
def test_topk_merge_keeps_the_best_blocks_of_every_share(rng, module, splits, count, count_pad):
    rows = 19  # (query group, KV head) rows: programs of several, the last part-full
    blocks = splits * count_pad
    # Shares pick distinct blocks; scores repeat (ties go to the lower id), some are forced (+inf),
    # and shares hold fewer than count_pad blocks (empty slots); row 0 holds none in any share.
    ids = np.stack([rng.permutation(blocks).reshape(splits, count_pad) for _ in range(rows)], 1)
    scores = rng.choice(np.array([0.0, 0.25, 0.5, 1.5, 3.0, np.inf], np.float32), ids.shape)
    ids = np.where(rng.random(ids.shape) < 0.25, -1, ids)
    ids[:, 0] = -1
    keys = ranking_keys(module, scores, ids)  # [splits, rows, count_pad]

    chosen = module.merge_topk_shares(jnp.asarray(keys.view(np.int32)), (rows, count))

    for row in range(rows):
        entries = sorted((-s, i) for s, i in zip(scores[:, row].ravel(), ids[:, row].ravel()) if i >= 0)
        expected = [i for _, i in entries[:count]]
        expected += [-1] * (count - len(expected))
        assert list(np.asarray(chosen)[row]) == expected, f"row {row}"


def test_a_launch_patches_the_interpreters_language_once(rng, module, monkeypatch):
    """Triton's interpreter patched triton.language again on every call of a nested @triton.jit
    function (merge_best's, Triton's bitonic merge's: hundreds a launch, ~1 ms each); triton_glue has
    a launch patch each language module once, and restore them at its end."""
    if triton_glue.on_gpu():
        pytest.skip("compiled kernels: no interpreter")
    import triton.language as tl
    from triton.runtime import interpreter

    patched, patch_builtin = [], interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *rest: patched.append(pkg) or patch_builtin(pkg, *rest))
    ids = np.stack([rng.permutation(64).reshape(4, 16) for _ in range(19)], 1)
    scores = rng.random(ids.shape).astype(np.float32)
    arange = tl.arange
    chosen = np.asarray(module.merge_topk_shares(jnp.asarray(ranking_keys(module, scores, ids).view(np.int32)), (19, 16)))
    assert (chosen >= 0).all()
    # At most once for each set of language modules a function sees (tl, tl.core, both): 4 + 3 + 6
    # modules and classes, where every nested call patched them again.
    assert 0 < len(patched) <= 13, " ".join(getattr(p, "__name__", "?") for p in patched)
    assert tl.arange is arange  # restored
