"""The disk cache of Triton kernels compiled through jax-triton (nsa_dsl/runtime/triton_cache.py).

On a CPU jax-triton cannot be imported, so the entries' reading and writing is checked directly;
on a GPU, processes of their own check that a second process compiles nothing and that damaged
entries are compiled again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from nsa_dsl import CacheWarning
from nsa_dsl.runtime import triton_cache, triton_glue


def compilation(rng) -> tuple[str, SimpleNamespace]:
    """What jax-triton's compile_ttir_inplace hands back (with the TTIR text it was given)."""
    tag = int(rng.integers(1 << 30))
    ptx = f"//\n.version 8.4\n.target sm_90a\n.visible .entry kernel_{tag}() {{ ret; }}\n"
    return f"module {{ tt.func @kernel_{tag}() }}", SimpleNamespace(
        name=f"kernel_{tag}", shared_mem_bytes=tag % 4096, binary=ptx
    )


def test_an_entry_reads_back_as_written(tmp_path, rng):
    path = tmp_path / "ab" / "entry.json"
    ttir, result = compilation(rng)
    attrs = {(0,): [["tt.divisibility", 16]], (3,): []}
    triton_cache._write_entry(path, (ttir, result), attrs)
    entry = triton_cache._read_entry(path)
    assert entry == {
        "name": result.name,
        "shared_mem_bytes": result.shared_mem_bytes,
        "binary": result.binary,
        "ttir": ttir,
        "attrs": [[0, [["tt.divisibility", 16]]], [3, []]],
    }


@pytest.mark.parametrize(
    "damage", ["truncated", "payload edited", "checksum edited", "not json", "wrong layout", "payload not text", "empty"]
)
def test_a_damaged_entry_is_refused(tmp_path, rng, damage):
    path = tmp_path / "entry.json"
    triton_cache._write_entry(path, compilation(rng), {(0,): []})
    text = path.read_text()
    stored = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "payload edited":
        stored["payload"] = stored["payload"].replace('"shared_mem_bytes": ', '"shared_mem_bytes": 1')
        path.write_text(json.dumps(stored))
    elif damage == "checksum edited":
        stored["sha256"] = "0" * 64
        path.write_text(json.dumps(stored))
    elif damage == "not json":
        path.write_bytes(b"\xff\xfe garbage")
    elif damage == "wrong layout":
        path.write_text(json.dumps([stored]))
    elif damage == "payload not text":  # valid JSON all the same: payload.encode() was an AttributeError out of the call
        stored["payload"] = json.loads(stored["payload"])
        path.write_text(json.dumps(stored))
    else:
        path.write_text("")
    assert triton_cache._read_entry(path) is None


def test_a_missing_entry_is_none(tmp_path):
    assert triton_cache._read_entry(tmp_path / "nothing.json") is None


def test_writers_racing_on_one_entry_leave_it_valid(tmp_path, rng):
    """Processes compiling the same kernel at once write the same bytes; readers meanwhile see
    either no entry or a whole one."""
    path = tmp_path / "entry.json"
    ttir, result = compilation(rng)
    seen = []

    def write():
        for _ in range(20):
            triton_cache._write_entry(path, (ttir, result), {(0,): []})

    def read():
        for _ in range(200):
            seen.append(triton_cache._read_entry(path))

    threads = [threading.Thread(target=write) for _ in range(4)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(entry is None or entry["binary"] == result.binary for entry in seen)
    assert triton_cache._read_entry(path)["name"] == result.name
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]  # no temporary files left behind


def test_an_unwritable_cache_warns_and_loses_nothing(tmp_path, rng):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(CacheWarning, match="could not cache a compiled Triton kernel"):
        triton_cache._write_entry(blocker / "ab" / "entry.json", compilation(rng), {})


CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax_triton import triton_lib
    import nsa_dsl
    compiled = []
    compile_ttir = triton_lib.compile_ttir_inplace
    def counting(*args, **kwargs):
        compiled.append(1)
        return compile_ttir(*args, **kwargs)
    triton_lib.compile_ttir_inplace = counting  # nsa_dsl's cache wraps this one when it installs
    attention = nsa_dsl.compile("pattern p\\nblock 64\\ncausal\\nbranch w = window(200)\\n")
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 300, 4, 64)), jnp.float16) for _ in range(3))
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, platform="triton").astype(jnp.float32) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    print(json.dumps({"compiled": len(compiled), "grads": [np.asarray(g, np.float32).ravel()[:64].tolist() for g in grads]}))
""")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: jax-triton compiles for real")
def test_a_second_process_compiles_no_kernel_again(tmp_path):
    env = {**os.environ, "NSA_DSL_CACHE_DIR": str(tmp_path), "NSA_DSL_JAX_CACHE": "0"}

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = run()
    entries = sorted(Path(tmp_path, "triton-kernels").rglob("*.json"))
    assert cold["compiled"] >= 2 and len(entries) == cold["compiled"]  # forward and backward kernels
    binaries = sorted(Path(tmp_path, "ptxas").rglob("*.sha256"))  # what ptxas made of them (ptxas_cache)
    assert len(binaries) >= cold["compiled"]
    warm = run()
    assert warm["compiled"] == 0 and warm["grads"] == cold["grads"]
    assert sorted(Path(tmp_path, "ptxas").rglob("*.sha256")) == binaries  # no new ptxas run was stored
    entries[0].write_text(entries[0].read_text()[:100])  # a damaged entry is compiled again, and rewritten
    repaired = run()
    assert repaired["compiled"] == 1 and repaired["grads"] == cold["grads"]
    assert triton_cache._read_entry(entries[0]) is not None


@pytest.mark.parametrize("before", [None, "/somewhere/triton-cache"], ids=["unset", "set"])
def test_importing_jax_triton_leaves_tritons_cache_dir_as_it_was(tmp_path, monkeypatch, before):
    """jax-triton 0.3.1's import sets TRITON_CACHE_DIR to "" for good (a stand-in module does the
    same here): Triton's own compiler then failed in the process, and in every child process, after
    nsa_dsl's first GPU launch ("Could not create or locate cache dir": tests/test_triton_sm90.py's
    workers on the H100, bench_gpu's PyTorch worker on the H200)."""
    (tmp_path / "jax_triton.py").write_text('import os\nos.environ["TRITON_CACHE_DIR"] = ""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # whatever was there comes back afterwards
    del sys.modules["jax_triton"]
    if before is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", before)
    triton_glue.import_jax_triton.cache_clear()
    try:
        module = triton_glue.import_jax_triton()
    finally:
        triton_glue.import_jax_triton.cache_clear()
    assert module.__file__ == str(tmp_path / "jax_triton.py")
    assert os.environ.get("TRITON_CACHE_DIR") == before
