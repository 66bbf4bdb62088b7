"""The kernels that merge a split launch's shares (a decoding step's few programs each walk a share
of their keys), run in Triton's interpreter against numpy: merge_shares (the softmax over all keys
from the shares' outputs and log-sum-exps, shares that saw no key among them) and topk_merge (the
best blocks of a split top-k's shares, ties to the lower id, forced blocks first, empty slots)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from nsa_reference import small_example

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch


@pytest.fixture(scope="module")
def module():
    """The generated Triton module of the NSA example (compression, top-k, selection, window)."""
    source, _ = small_example("nsa")
    return codegen.load_module("triton", nsa_dsl.compile(source).plan, dispatch.for_device(None))


@pytest.mark.parametrize(
    "splits, head_dim, dtype",
    [(1, 32, np.float32), (3, 60, np.float32), (5, 16, np.float16), (37, 32, np.float32), (64, 128, np.float32)],
)
def test_merge_shares_is_the_softmax_over_every_share(rng, module, splits, head_dim, dtype):
    rows = (7, 3)  # 21 (query row, head) rows: programs of several, the last part-full
    values = rng.standard_normal((splits, *rows, head_dim))
    lse = rng.standard_normal((splits, *rows)) * 4
    lse[:, 0, 0] = -np.inf  # a row no share saw a key for
    lse[rng.random((splits, *rows)) < 0.3] = -np.inf  # shares that saw no key
    lse[0, 1, :] = -np.inf

    out, total = module.merge_splits(jnp.asarray(values, jnp.float32), jnp.asarray(lse, jnp.float32), dtype)

    with np.errstate(divide="ignore", invalid="ignore"):
        expected_lse = np.log2(np.sum(np.exp2(lse), axis=0))
        weights = np.where(np.isfinite(lse), np.exp2(lse - expected_lse), 0.0)
    expected = np.sum(values * weights[..., None], axis=0)
    assert out.dtype == dtype and out.shape == (*rows, head_dim)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-3 if dtype == np.float16 else 1e-5,
                               atol=1e-3 if dtype == np.float16 else 1e-6)
    np.testing.assert_allclose(np.asarray(total), expected_lse, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out)[0, 0] == 0) and np.isneginf(np.asarray(total)[0, 0])


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
    # and shares hold fewer than count_pad blocks (empty slots), some none at all.
    ids = np.stack([rng.permutation(blocks)[: splits * count_pad].reshape(splits, count_pad) for _ in range(rows)], 1)
    scores = rng.choice(np.array([0.0, 0.25, 0.5, 1.5, 3.0, np.inf], np.float32), ids.shape)
    ids = np.where(rng.random(ids.shape) < 0.25, -1, ids)
    ids[:, 0] = -1
    keys = ranking_keys(module, scores, ids)  # [splits, rows, count_pad]

    chosen = module.merge_topk_shares(jnp.asarray(keys.view(np.int32)), (rows, count), count_pad)

    for row in range(rows):
        entries = sorted((-s, i) for s, i in zip(scores[:, row].ravel(), ids[:, row].ravel()) if i >= 0)
        expected = [i for _, i in entries[:count]]
        expected += [-1] * (count - len(expected))
        assert list(np.asarray(chosen)[row]) == expected, f"row {row}"
