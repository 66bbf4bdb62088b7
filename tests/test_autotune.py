"""Autotuning (nsa_dsl/autotune.py): it picks a candidate and persists it, a second call reads
the entry, an explicit cfg is never written over it, NSA_DSL_AUTOTUNE, wrong or failing
candidates are rejected (fail closed), damaged entries are ignored and rewritten, concurrent
writers leave a valid entry, candidates compile on worker threads (a failure there is
repeated before it rejects), tuning works while jax traces the caller, the progress bar.
On a CPU the XLA backend's candidates are tuned, with small shapes and few candidates."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import FORWARD_TOLERANCE, assert_close, child_env, gate, qkv, random_indices

import nsa_dsl
from nsa_dsl import autotune, kernel
from nsa_dsl.config import NativeSparseAttentionConfig as Config
from nsa_dsl.runtime import platform

BLOCK = 16


def call_arguments(rng, seq_len=40, heads_q=4, heads_kv=2, head_dim=16, width=3):
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    return (q, k, v, None, gate(rng, 1, seq_len, heads_q), random_indices(rng, 1, seq_len, heads_kv, width, BLOCK), width)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tuning of two XLA candidates, in a cache of this module's own."""
    if jax.default_backend() != "cpu":
        pytest.skip("tunes the CPU's XLA candidates (test_tuning_on_a_gpu_at_a_real_size tunes a GPU's)")
    with pytest.MonkeyPatch.context() as patch:  # undone even where the tuning fails
        patch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path_factory.mktemp("autotune_cache")))
        patch.delenv("NSA_DSL_AUTOTUNE", raising=False)
        autotune.forget()
        nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
        args = call_arguments(np.random.default_rng(7))
        inv = nsa.invocation(*args)
        candidates = nsa.candidate_cfgs(inv)[1:]  # not the heuristic: the choice must differ from it
        assert len(candidates) == 2
        cfg = nsa.autotune(inv, candidates=candidates, repeats=1, progress=False)
        yield SimpleNamespace(nsa=nsa, args=args, inv=inv, candidates=candidates, cfg=cfg,
                              path=autotune.entry_path(nsa, inv))
        autotune.forget()


@pytest.fixture
def no_tuning(monkeypatch):
    """Tuning would fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("tuned again")

    monkeypatch.setattr(autotune, "tune", refuse)


def test_picks_a_candidate_and_persists_it(tuned):
    assert tuned.cfg in tuned.candidates and tuned.cfg.block_size == BLOCK
    stored = json.loads(tuned.path.read_text())
    entry = stored["entry"]
    assert stored["sha256"] == autotune._checksum(entry) and entry["key"] == tuned.path.stem
    assert entry["cfg"] == dataclasses.asdict(tuned.cfg) and entry["rejected"] == []
    assert [m["cfg"] for m in entry["measured"]] == [dataclasses.asdict(c) for c in tuned.candidates]
    assert all(m["forward_ms"] > 0 and m["forward_backward_ms"] > 0 and m["error"] <= 1e-5 for m in entry["measured"])
    assert entry["forward_backward_ms"] == min(m["forward_backward_ms"] for m in entry["measured"])
    assert set(entry["versions"]) == {"nsa_dsl", "jax", "jaxlib", "triton"} and entry["device"] == "cpu:cpu"
    assert entry["invocation"]["arguments"]["query"] == {"shape": [1, 40, 4, 16], "dtype": "float32"}
    assert tuned.path.parent.parent == Path(os.environ["NSA_DSL_CACHE_DIR"]) / "autotune"


def test_the_key_covers_device_code_and_versions(tuned, monkeypatch):
    key = autotune.entry_key(tuned.nsa, tuned.inv)
    monkeypatch.setattr(autotune, "device_description", lambda: "gpu:NVIDIA H200")
    assert autotune.entry_key(tuned.nsa, tuned.inv) != key
    monkeypatch.undo()
    versions = autotune.versions()
    monkeypatch.setattr(autotune, "versions", lambda: {**versions, "jax": "0.0.1"})
    assert autotune.entry_key(tuned.nsa, tuned.inv) != key
    monkeypatch.undo()
    monkeypatch.setattr(tuned.nsa, "fingerprint", lambda inv: "other templates")
    assert autotune.entry_key(tuned.nsa, tuned.inv) != key


def test_a_second_call_reads_the_entry(tuned, no_tuning):
    autotune.forget()  # as a new process: nothing in memory
    assert tuned.nsa.choose_cfg(tuned.inv, "autotune") == tuned.cfg
    assert tuned.nsa.autotune(tuned.inv) == tuned.cfg
    assert nsa_dsl.NativeSparseAttention(block_size=BLOCK).choose_cfg(tuned.inv) == tuned.cfg  # the default too
    # Under jit the invocation holds tracers of the same shapes: the same entry.
    q, *rest = tuned.args
    traced = jax.jit(lambda q: tuned.nsa(q, *rest, cfg="autotune"))(q)
    assert_close(traced, tuned.nsa(*tuned.args, cfg=tuned.cfg), FORWARD_TOLERANCE, "tuned output")


def test_an_explicit_cfg_is_used_as_given_and_never_written_over_the_entry(tuned, no_tuning):
    before = tuned.path.read_bytes()
    explicit = Config(block_size=BLOCK, platform="xla", chunk_bytes=1 << 20)
    assert explicit not in tuned.candidates
    seen = []
    original_run = type(tuned.nsa).run

    def spy(self, *args, cfg, **kwargs):
        seen.append(cfg)
        return original_run(self, *args, cfg=cfg, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(tuned.nsa), "run", spy)
        tuned.nsa(*tuned.args, cfg=explicit)
        nsa_dsl.native_sparse_attention(*tuned.args[:7], cfg=explicit)
    assert seen == [explicit, explicit]
    autotune.forget()
    assert tuned.path.read_bytes() == before and tuned.nsa.choose_cfg(tuned.inv) == tuned.cfg


def test_nsa_dsl_autotune_0_1_and_unset(tuned, monkeypatch, rng):
    recorded = []

    def record(kernel, inv, **kwargs):
        recorded.append(inv.key)
        return kernel.heuristic_cfg(inv)

    monkeypatch.setattr(autotune, "tune", record)
    heuristic = tuned.nsa.heuristic_cfg(tuned.inv)
    assert heuristic != tuned.cfg
    new_shape = tuned.nsa.invocation(*call_arguments(rng, seq_len=24))

    monkeypatch.setenv("NSA_DSL_AUTOTUNE", "0")  # the heuristic, entries not read, no tuning asked for by a string
    assert tuned.nsa.choose_cfg(tuned.inv) == heuristic
    assert tuned.nsa.choose_cfg(tuned.inv, "autotune") == heuristic
    assert tuned.nsa.choose_cfg(new_shape, "autotune") == tuned.nsa.heuristic_cfg(new_shape) and recorded == []

    monkeypatch.delenv("NSA_DSL_AUTOTUNE")  # on a CPU: entries read, new shapes not tuned unless asked
    assert tuned.nsa.choose_cfg(tuned.inv) == tuned.cfg
    assert tuned.nsa.choose_cfg(new_shape) == tuned.nsa.heuristic_cfg(new_shape) and recorded == []
    tuned.nsa.choose_cfg(new_shape, "autotune")
    assert recorded == [new_shape.key]

    monkeypatch.setenv("NSA_DSL_AUTOTUNE", "1")  # every new shape
    tuned.nsa.choose_cfg(new_shape)
    assert recorded == [new_shape.key] * 2
    assert tuned.nsa.choose_cfg(tuned.inv) == tuned.cfg  # a stored one is not tuned again

    monkeypatch.setenv("NSA_DSL_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="NSA_DSL_AUTOTUNE must be 0"):
        tuned.nsa.choose_cfg(new_shape)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="decides as on a CPU first")
def test_by_default_a_new_shape_is_tuned_where_compiled_gpu_kernels_run(monkeypatch, rng):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    args = call_arguments(rng)
    assert not nsa.tunes_lazily(nsa.invocation(*args))  # XLA on this CPU
    assert not nsa.tunes_lazily(nsa.invocation(*args, None, None, "triton"))  # the interpreter
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # decided as on a GPU; nothing runs
    monkeypatch.setattr(platform, "missing_packages", lambda *_: [])  # ... with the gpu extra (jax-triton) installed
    assert nsa.platform_for(nsa.invocation(*args)) == "triton"
    assert nsa.tunes_lazily(nsa.invocation(*args)) and nsa.tunes_lazily(nsa.invocation(*args, None, None, "pallas"))
    assert not nsa.tunes_lazily(nsa.invocation(*args, None, None, "xla"))


class Faulty(nsa_dsl.NativeSparseAttention):
    """Candidates with a 1 MiB chunk give a wrong result, with a 2 MiB chunk fail to run."""

    version = "test-faulty"  # entries of their own

    def get_impl(self, cfg):
        impl = super().get_impl(cfg)

        def faulty(*args, **kwargs):
            if cfg.chunk_bytes == 2 << 20:
                raise RuntimeError("out of resources")
            out = impl(*args, **kwargs)
            return out * 1.01 if cfg.chunk_bytes == 1 << 20 else out

        return faulty


def test_wrong_or_failing_candidates_are_rejected_with_a_warning(tuned, capsys):
    nsa = Faulty(block_size=BLOCK)
    inv = nsa.invocation(*tuned.args)  # the shapes tuned.candidates were compiled for: disk cache hits
    wrong, failing = (Config(block_size=BLOCK, platform="xla", backend="cpu", chunk_bytes=mib << 20) for mib in (1, 2))
    good = tuned.candidates[0]
    with pytest.warns(nsa_dsl.AutotuneWarning) as caught:
        chosen = nsa.autotune(inv, candidates=[wrong, failing, good], repeats=1)
    assert chosen == good
    messages = [str(w.message) for w in caught if w.category is nsa_dsl.AutotuneWarning]
    assert len(messages) == 2
    assert "rejected xla chunk_bytes=1048576: its output differs from the reference" in messages[0]
    assert "rejected xla chunk_bytes=2097152: RuntimeError: out of resources" in messages[1]
    entry = json.loads(autotune.entry_path(nsa, inv).read_text())["entry"]
    assert [r["cfg"]["chunk_bytes"] for r in entry["rejected"]] == [1 << 20, 2 << 20]
    bar = capsys.readouterr().err
    assert "nsa_dsl autotune native_sparse_attention [" in bar and "] 3/3 best" in bar

    # Nothing passes: the reference configuration, not stored.
    with pytest.warns(nsa_dsl.AutotuneWarning) as caught:
        assert nsa.autotune(inv, candidates=[failing], force=True, progress=False) == nsa.reference_cfg(inv)
    assert "every candidate was rejected" in str(caught[-1].message)
    assert autotune.read_entry(autotune.entry_path(nsa, inv), Config)[0] == good  # the stored choice stays


@jax.custom_vjp
def _tripled_gradient(x):
    return x


_tripled_gradient.defvjp(lambda x: (x, None), lambda _, g: (3.0 * g,))


class WrongGradients(nsa_dsl.NativeSparseAttention):
    """Candidates with a 1 MiB chunk compute the right output and a query gradient three times
    too large: only their gradients can tell."""

    version = "test-wrong-gradients"

    def get_impl(self, cfg):
        impl = super().get_impl(cfg)
        if cfg.chunk_bytes != 1 << 20:
            return impl

        def wrong(plan, query, *args, **kwargs):
            return impl(plan, _tripled_gradient(query), *args, **kwargs)

        return wrong


def test_a_candidate_whose_gradients_differ_is_rejected(tuned):
    """The output check on a slice cannot see a wrong backward; the gradients on the whole tuning
    inputs are compared with the heuristic configuration's."""
    nsa = WrongGradients(block_size=BLOCK)
    inv = nsa.invocation(*tuned.args)
    wrong = Config(block_size=BLOCK, platform="xla", backend="cpu", chunk_bytes=1 << 20)
    good = tuned.candidates[0]
    with pytest.warns(nsa_dsl.AutotuneWarning) as caught:
        assert nsa.autotune(inv, candidates=[wrong, good], repeats=1, progress=False) == good
    messages = [str(w.message) for w in caught if w.category is nsa_dsl.AutotuneWarning]
    assert len(messages) == 1 and "rejected xla chunk_bytes=1048576: its gradients differ from the heuristic" in messages[0]


class MeetingPoint(nsa_dsl.NativeSparseAttention):
    """Tracing one of the `watched` configurations waits for another's tracing, on another thread:
    two can compile only at the same time. Tracing off the main thread fails once if `flaky`."""

    version = "test-meeting-point"

    def __init__(self, *args, watched=(), flaky=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.watched, self.flaky, self.threads = set(watched), flaky, set()
        self.barrier = threading.Barrier(2, timeout=60)

    def get_impl(self, cfg):
        impl = super().get_impl(cfg)

        def meeting(*args, **kwargs):
            if cfg in self.watched:
                self.threads.add(threading.current_thread().name)
                if self.flaky and threading.current_thread() is not threading.main_thread():
                    self.flaky = False
                    raise SystemError("AST constructor recursion depth mismatch")
                if not self.flaky:
                    self.barrier.wait()
            return impl(*args, **kwargs)

        return meeting


def test_candidates_compile_at_the_same_time_on_worker_threads(tuned, monkeypatch):
    monkeypatch.setenv("NSA_DSL_AUTOTUNE_WORKERS", "2")
    nsa = MeetingPoint(block_size=BLOCK, watched=tuned.candidates)
    inv = nsa.invocation(*tuned.args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nsa_dsl.AutotuneWarning)  # a broken barrier would reject both
        nsa.autotune(inv, candidates=tuned.candidates, repeats=1, progress=False)
    entry = json.loads(autotune.entry_path(nsa, inv).read_text())["entry"]
    assert len(entry["measured"]) == 2 and not entry["rejected"]
    assert len(nsa.threads) == 2 and all(name.startswith("nsa_dsl-autotune") for name in nsa.threads)


def test_a_compile_that_fails_on_a_worker_thread_is_repeated_before_it_rejects(tuned, monkeypatch):
    monkeypatch.setenv("NSA_DSL_AUTOTUNE_WORKERS", "1")
    nsa = MeetingPoint(block_size=BLOCK, watched=tuned.candidates, flaky=True)
    nsa.barrier = threading.Barrier(1)  # one worker: nobody to meet
    inv = nsa.invocation(*tuned.args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nsa_dsl.AutotuneWarning)
        chosen = nsa.autotune(inv, candidates=tuned.candidates[:1], force=True, repeats=1, progress=False)
    assert chosen == tuned.candidates[0] and "MainThread" in nsa.threads


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_wrong_worker_count_is_a_value_error(monkeypatch, value):
    monkeypatch.setenv("NSA_DSL_AUTOTUNE_WORKERS", value)
    with pytest.raises(ValueError, match="NSA_DSL_AUTOTUNE_WORKERS must be a whole number >= 1"):
        autotune.compile_workers()


def test_inputs_it_would_refuse_are_a_value_error_not_a_rejection(rng):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, g_cmp, g_slc, indices, width = call_arguments(rng)
    with pytest.raises(ValueError, match="query must be"):
        nsa.autotune(nsa.invocation(q[0], k, v, g_cmp, g_slc, indices, width), progress=False)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        nsa.autotune(nsa.invocation(q, k, v, g_cmp, g_slc, indices, width, None, np.array([0, 50])), progress=False)


@pytest.mark.parametrize("layout", ["per_token", "per_block", "packed", "packed_traced"])
def test_tuning_inputs_are_random_causal_and_distinct(rng, layout):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, _, g_slc, indices, _ = call_arguments(rng, seq_len=70, width=4)
    counts = np.full((1, 70, 2), 3, np.int32)
    cu = np.array([0, 30, 70])
    if layout == "per_block":
        indices, counts = indices[:, ::BLOCK].transpose(0, 2, 1, 3), counts[:, ::BLOCK].transpose(0, 2, 1)
    given_cu = {"packed": cu, "packed_traced": jax.ShapeDtypeStruct((3,), np.int32)}.get(layout)
    inv = nsa.invocation(q, k, v, None, g_slc, jax.ShapeDtypeStruct(indices.shape, np.int32), counts, None, given_cu)
    args = nsa.tuning_arguments(inv, np.random.default_rng(0))
    for name in ("query", "key", "value"):
        x = np.asarray(args[name])
        assert x.shape == inv.arguments[name].shape and 0.8 < x.std() < 1.2  # never zeros or ones
    assert 0 < np.asarray(args["g_slc"]).min() and np.asarray(args["g_slc"]).max() < 1
    chosen = np.asarray(args["block_indices"])
    assert chosen.shape == indices.shape and chosen.dtype == np.int32
    assert all(len(set(row)) == len(row) for row in chosen.reshape(-1, 4).tolist())  # distinct blocks
    assert 1 <= np.asarray(args["block_counts"]).min() and np.asarray(args["block_counts"]).max() <= 4
    cu_used = None if given_cu is None else np.asarray(args["cu_seqlens"])
    if layout == "packed":
        np.testing.assert_array_equal(cu_used, cu)  # the caller's sequences, when known
    if cu_used is not None:
        assert cu_used[0] == 0 and cu_used[-1] == 70 and (np.diff(cu_used) >= 0).all()
        starts = cu_used[np.searchsorted(cu_used, np.arange(70), "right") - 1]
        own = (np.arange(70) - starts) // BLOCK
    else:
        own = np.arange(70) // BLOCK
    if layout == "per_block":
        own = np.arange(chosen.shape[2])[None, None, :, None]
    else:
        own = own[None, :, None, None]
    assert chosen.min() >= 0 and (chosen <= own).mean() > 0.3  # causally valid mostly; the rest are ignored

    # The check runs the first tokens on XLA, which do not depend on later ones.
    sliced, take = nsa.check_slice(inv, args)
    assert sliced["platform"] == "xla" and sliced["query"].shape == (1, 70, 4, 16)  # 70 tokens: all of them
    assert take(np.zeros((1, 70, 4, 16))).shape == (1, 70, 4, 16)


def test_a_count_as_an_integer_scalar_array_is_tuned(rng):
    """block_counts as a 0-d integer array (one count for every token, as calls take it) is tuned
    like an int: the check slice cut it as a per-block array, an IndexError (on a GPU, at a new
    shape's first call, which tunes)."""
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, _, g_slc, indices, width = call_arguments(rng, seq_len=70)
    count = jax.numpy.int32(width - 1)
    inv = nsa.invocation(q, k, v, None, g_slc, indices, count)
    cfg = nsa.autotune(inv, candidates=nsa.candidate_cfgs(inv)[1:], force=True, repeats=1, progress=False)
    want = np.asarray(nsa(q, k, v, None, g_slc, indices, width - 1, cfg="heuristic"))
    np.testing.assert_array_equal(np.asarray(nsa(q, k, v, None, g_slc, indices, count, cfg=cfg)), want)


@pytest.mark.parametrize("case", ["batch of two", "top-k over packed sequences"])
def test_the_check_slice_is_the_first_tokens(rng, case, monkeypatch):
    """The first tokens of the first batch row see nothing later (causal within a sequence, the
    top-k over compressed scores included), so the reference need not run the whole call."""
    monkeypatch.setattr(kernel, "CHECK_TOKENS", 40)  # 4 blocks of 16 at least: 64 of the 80 tokens
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, _, g_slc, indices, width = call_arguments(rng, seq_len=80)
    if case == "batch of two":
        two = [np.concatenate([x, x]) for x in (q, k, v, g_slc, indices)]
        inv = nsa.invocation(*two[:3], None, *two[3:], width)
    else:
        inv = nsa.invocation(q, k, v, gate(rng, 1, 80, 4), g_slc, None, 2, None, np.array([0, 30, 80]))
    args = nsa.tuning_arguments(inv, np.random.default_rng(1))
    sliced, take = nsa.check_slice(inv, args)
    assert sliced["query"].shape == (1, 64, 4, 16)
    full = nsa.run(**args, cfg=nsa.reference_cfg(inv))
    assert_close(take(full), nsa.run(**sliced, cfg=nsa.reference_cfg(inv)), FORWARD_TOLERANCE, "first tokens")


@pytest.mark.parametrize("damage", ["truncated", "not json", "checksum", "edited cfg", "illegal cfg", "other key"])
def test_a_damaged_entry_is_ignored(tuned, tmp_path, damage):
    text = tuned.path.read_text()
    stored = json.loads(text)
    if damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "not json":
        text = "\x00\xff garbage"
    elif damage == "checksum":
        stored["sha256"] = "0" * 64
        text = json.dumps(stored)
    elif damage in ("edited cfg", "illegal cfg"):
        stored["entry"]["cfg"]["chunk_bytes"] = 1 << 20 if damage == "edited cfg" else -1
        if damage == "illegal cfg":
            stored["sha256"] = autotune._checksum(stored["entry"])
        text = json.dumps(stored)
    else:  # a valid entry under another key's name
        stored["entry"]["key"] = "f" * 64
        stored["sha256"] = autotune._checksum(stored["entry"])
        text = json.dumps(stored)
    damaged = tmp_path / tuned.path.name
    damaged.write_text(text)
    assert autotune.read_entry(damaged, Config) is None
    assert autotune.read_entry(tuned.path, Config)[0] == tuned.cfg


@pytest.mark.parametrize("edit", [{"block_size": 2 * BLOCK}, {"block_size": BLOCK // 2}, {"backend": "tpu"}])
def test_a_stored_entry_that_would_change_the_result_is_ignored(tuned, monkeypatch, no_tuning, edit):
    """An entry edited by hand (its checksum recomputed) or copied from elsewhere to another block
    size computed another pattern, silently (1.97 off the defaults' output in a user's review):
    tuning stores only configurations that reproduce the reference, so lookup ignores it, warning."""
    text = tuned.path.read_text()
    stored = json.loads(text)
    stored["entry"]["cfg"].update(edit)
    stored["sha256"] = autotune._checksum(stored["entry"])
    try:
        tuned.path.write_text(json.dumps(stored))
        autotune.forget()
        with pytest.warns(nsa_dsl.CacheWarning, match="ignored the tuned configuration at .* would change the result"):
            assert autotune.lookup(tuned.nsa, tuned.inv) is None
    finally:
        tuned.path.write_text(text)
        autotune.forget()
    assert autotune.lookup(tuned.nsa, tuned.inv) == tuned.cfg


class Fresh(nsa_dsl.NativeSparseAttention):
    """NativeSparseAttention with entries of its own (its candidate: one of tuned.candidates)."""

    version = "test-fresh"

    def candidate_cfgs_xla(self, inv):
        return [Config(block_size=BLOCK, platform="xla", backend="cpu", chunk_bytes=4 << 20)]


def test_a_damaged_entry_is_tuned_again_while_jax_traces_the_caller(tuned, monkeypatch):
    """cfg="autotune" inside jit with a damaged entry: it is ignored, the candidates are timed
    eagerly on random inputs of the traced shapes, the entry rewritten, and the traced call
    runs the choice."""
    nsa = Fresh(block_size=BLOCK)
    inv = nsa.invocation(*tuned.args)
    path = autotune.entry_path(nsa, inv)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"sha256": "0", "entry": {"key": "broken"')
    autotune.forget()
    assert autotune.lookup(nsa, inv) is None
    monkeypatch.setattr(autotune, "REPEATS", 1)
    q, *rest = tuned.args
    out = jax.jit(lambda q: nsa(q, *rest, cfg="autotune"))(q)
    chosen = nsa.candidate_cfgs_xla(inv)[0]
    assert autotune.read_entry(path, Config)[0] == chosen
    assert_close(out, nsa(*tuned.args, cfg=chosen), FORWARD_TOLERANCE, "output")


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from nsa_dsl import autotune, kernel
    path, name, ready, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    ready.touch()
    while not go.exists():
        time.sleep(0.005)
    for i in range(150):
        cfg = {"block_size": 16, "platform": "xla", "chunk_bytes": (1 + i) << 20, "num_warps": 4 if name == "a" else 8}
        autotune.write_entry(path, {"key": path.stem, "cfg": cfg, "writer": name, "padding": "x" * 20000})
""")


def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    path = tmp_path / "autotune" / "ab" / ("ab" + "0" * 62 + ".json")
    go = tmp_path / "go"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(tmp_path / f"ready_{name}"), str(go)],
                         env=child_env())
        for name in ("a", "b")
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready_{name}").exists() for name in ("a", "b")):
        assert time.monotonic() < deadline and all(w.poll() is None for w in writers), "writers did not start"
        time.sleep(0.01)
    go.touch()
    reads = 0
    while any(w.poll() is None for w in writers):
        found = autotune.read_entry(path, Config)
        if found is not None:  # never a partial entry: each read is a whole, valid one
            assert found[0].num_warps in (4, 8) and found[1]["writer"] in ("a", "b")
            reads += 1
    assert [w.wait() for w in writers] == [0, 0]
    cfg, entry = autotune.read_entry(path, Config)
    assert cfg.chunk_bytes == 150 << 20 and entry["writer"] in ("a", "b")
    assert reads > 0 and [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left


def test_progress_bar():
    lines = io.StringIO()
    bar = autotune.ProgressBar(3, "tune", stream=lines)
    bar.advance("best 1 ms")
    bar.advance()
    bar.close()
    assert lines.getvalue().splitlines() == [
        "tune [........................] 0/3", "tune [########................] 1/3 best 1 ms", "tune [################........] 2/3",
    ]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    bar = autotune.ProgressBar(2, "tune", stream=screen)
    bar.advance("a long note")
    bar.advance()
    bar.close()
    frames = screen.getvalue().split("\r")
    assert frames[-1].startswith("tune [########################] 2/2") and frames[-1].endswith("\n")
    assert len(frames[-1].rstrip("\n")) == len(frames[-2])  # the longer line before is overwritten


def test_the_time_limit_leaves_out_the_candidates_it_does_not_reach(tuned, monkeypatch, capsys, rng):
    """With no time left after the first candidate, the rest are not timed; the entry says how
    many. The first is the one kept even though another might be faster."""
    monkeypatch.setenv("NSA_DSL_AUTOTUNE_SECONDS", "0")
    inv = tuned.nsa.invocation(*call_arguments(rng, seq_len=23))
    first, second = tuned.candidates
    assert tuned.nsa.autotune(inv, candidates=[second, first], repeats=1) == second
    entry = json.loads(autotune.entry_path(tuned.nsa, inv).read_text())["entry"]
    assert [m["cfg"] for m in entry["measured"]] == [dataclasses.asdict(second)] and entry["untimed"] == 1
    assert "1 not timed: NSA_DSL_AUTOTUNE_SECONDS=0 spent" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_wrong_time_limit_is_a_value_error(monkeypatch, value):
    monkeypatch.setenv("NSA_DSL_AUTOTUNE_SECONDS", value)
    with pytest.raises(ValueError, match="NSA_DSL_AUTOTUNE_SECONDS must be a number of seconds >= 0"):
        autotune.time_limit()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_tuning_on_a_gpu_at_a_real_size(tmp_path, monkeypatch, rng):
    """B=1, T=8192, HQ=64, HKV=4, D=128, 16 blocks of 64 per token, bf16: Triton candidates; the
    choice is at least as fast as the heuristic (within noise) and read back by the next call."""
    import jax.numpy as jnp

    monkeypatch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NSA_DSL_AUTOTUNE", raising=False)  # the default: lazily (GPU runs often set it to 0)
    autotune.forget()
    nsa = nsa_dsl.NativeSparseAttention(block_size=64)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(rng, 1, 8192, 64, 4, 128))
    indices = random_indices(rng, 1, 8192, 4, 16, 64)
    inv = nsa.invocation(q, k, v, None, None, indices, 16)
    assert nsa.tunes_lazily(inv) and nsa.platform_for(inv) == "triton"
    start = time.perf_counter()
    chosen = nsa.choose_cfg(inv)  # lazily, the first time
    entry = json.loads(autotune.entry_path(nsa, inv).read_text())["entry"]
    print(f"\ntuned in {time.perf_counter() - start:.1f} s: {autotune.describe(chosen)}")
    for m in entry["measured"]:
        print(f"  {m['forward_ms']:8.3f} {m['forward_backward_ms']:8.3f} ms  {autotune.describe(Config(**m['cfg']))}")
    for r in entry["rejected"]:
        print(f"  rejected {autotune.describe(Config(**r['cfg']))}: {r['reason']}")
    heuristic = entry["measured"][0]
    assert heuristic["cfg"] == dataclasses.asdict(nsa.heuristic_cfg(inv))
    assert entry["forward_backward_ms"] <= heuristic["forward_backward_ms"]
    autotune.forget()
    assert nsa.choose_cfg(inv) == chosen


def test_a_tuning_that_cannot_be_stored_warns_and_is_kept(tmp_path):
    """A cache that cannot take a tuned entry costs later processes a tuning, not this call."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(nsa_dsl.CacheWarning, match="could not store a tuned configuration"):
        autotune.write_entry(blocker / "ab" / "entry.json", {"key": "entry", "cfg": {}})
