"""`nsa-compile`: modules written, summary figures, and errors located without a traceback."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

import nsa_dsl
from nsa_dsl import cli, codegen, dsl
from nsa_dsl.codegen import cache
from nsa_dsl.plan import lower
from nsa_dsl.runtime import check_supported

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.nsa"))

TWO_PATTERNS = """\
# two patterns for the CLI tests
pattern sliding
param window = 128
block 64
causal
branch main = window(window)

pattern strided
block 32
bidirectional
branch main = local(2) | stride(every=4) gate g_slc
"""


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def source_file(tmp_path: Path) -> Path:
    path = tmp_path / "two.nsa"
    path.write_text(TWO_PATTERNS)
    return path


def run_cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """nsa-compile in a fresh interpreter, as a user runs it."""
    command = [sys.executable, "-m", "nsa_dsl.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env(), cwd=cwd)


def test_writes_one_module_per_pattern_and_prints_the_summary(source_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert cli.main([str(source_file), "-o", str(out), "--seq-len", "1024"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["sliding_xla.py", "strided_xla.py"]
    for name in ("sliding", "strided"):
        # the module a call loads, and the entry it loads it from (nsa-compile rendered for no device,
        # so it reported an entry no call read)
        entry = nsa_dsl.compile(source_file, pattern=name).module_path("xla")
        assert (out / f"{name}_xla.py").read_text() == entry.read_text()
        assert f"(cached at {entry})" in printed
    # Figures derived by hand. sliding, T=1024, block 64: 16 query blocks; window(128) reaches
    # the two previous key blocks: rows see 1, 2, then 3 blocks (45 of the 136 causal tiles);
    # the tile just below the diagonal is full, the diagonal and the one two below are partial.
    assert "pattern sliding: block 64, causal, params window=128" in printed
    assert "branch main (no gate): static window(128)" in printed
    assert "2.8 key blocks per query row (max 3), density 33.09% of causal tiles, 33% of visited tiles full" in printed
    # strided, block 32, bidirectional: 32 x 32 tiles; every row sees the 8 multiples of 4 plus
    # those of {qb - 1, qb} that are not: 303 tiles, all full (no token window to mask).
    assert "branch main (gate g_slc): static local(2) | stride(every=4)" in printed
    assert "9.5 key blocks per query row (max 10), density 29.59% of all tiles, 100% of visited tiles full" in printed


def test_written_module_imports_and_holds_the_plan(source_file: Path, tmp_path: Path) -> None:
    assert cli.main([str(source_file), "-o", str(tmp_path), "--pattern", "sliding"]) == 0
    spec = importlib.util.spec_from_file_location("sliding_xla", tmp_path / "sliding_xla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PLAN == lower(dsl.load_pattern(source_file, name="sliding"))
    # The written module runs on its own: its sparse_attention validates and builds the tables.
    import numpy as np

    from nsa_dsl.runtime.check import reference_output

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 45, heads, 16), dtype=np.float32) for heads in (2, 1, 1))
    expected = reference_output(module.PLAN, q, k, v)
    out = np.asarray(module.sparse_attention(q, k, v))
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()


def test_written_nsa_module_decodes_with_its_compressed_cache(tmp_path: Path) -> None:
    """A written module of a pattern with a compress branch has `compress`: its cache, passed to
    sparse_attention as compressed=, gives a decoding step the rows of a whole-sequence call."""
    import numpy as np

    assert cli.main([str(ROOT / "examples" / "nsa.nsa"), "-o", str(tmp_path)]) == 0
    spec = importlib.util.spec_from_file_location("nsa_xla", tmp_path / "nsa_xla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 150, heads, 16), dtype=np.float32) for heads in (4, 2, 2))
    gates = {name: rng.uniform(size=(1, 150, 4)).astype(np.float32) for name in ("g_cmp", "g_slc", "g_swa")}
    whole = np.asarray(module.sparse_attention(q, k, v, **gates))
    step = module.sparse_attention(q[:, 149:], k, v, **{n: g[:, 149:] for n, g in gates.items()}, query_offset=149,
                                   compressed=module.compress(k, v))
    assert np.abs(np.asarray(step) - whole[:, 149:]).max() <= 1e-5 * np.abs(whole).max()
    # called as nsa_dsl.compile's pattern is, with the same result
    compiled = nsa_dsl.compile(ROOT / "examples" / "nsa.nsa")
    np.testing.assert_array_equal(whole, np.asarray(compiled(q, k, v, **gates, platform="xla")))
    with pytest.raises(ValueError, match="platform: pattern 'nsa' has no gate"):  # the module's platform is its own
        module.sparse_attention(q, k, v, **gates, platform="triton")


def test_written_module_takes_gates_named_as_its_own_globals(tmp_path: Path) -> None:
    """sparse_attention took each gate as a parameter of its name, which hid the module's PLAN and
    nsa_dsl.runtime's attend from its body: gates named PLAN or attend failed every call."""
    import numpy as np

    text = "pattern own\nblock 16\ncausal\ngate PLAN\ngate attend\n"
    text += "branch near = local(1) gate PLAN\nbranch far = window(40) gate attend\n"
    (tmp_path / "own.nsa").write_text(text)
    assert cli.main([str(tmp_path / "own.nsa"), "-o", str(tmp_path)]) == 0
    spec = importlib.util.spec_from_file_location("own_xla", tmp_path / "own_xla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 50, heads, 8), dtype=np.float32) for heads in (2, 1, 1))
    gates = {name: rng.uniform(size=(1, 50, 2)).astype(np.float32) for name in ("PLAN", "attend")}
    written = np.asarray(module.sparse_attention(q, k, v, **gates))
    np.testing.assert_array_equal(written, np.asarray(nsa_dsl.compile(text)(q, k, v, **gates, platform="xla")))
    swapped = np.asarray(module.sparse_attention(q, k, v, PLAN=gates["attend"], attend=gates["PLAN"]))
    assert np.abs(written - swapped).max() > 0.1  # each gate weighs its own branch


def test_define_overrides_a_param(source_file: Path, tmp_path: Path, capsys) -> None:
    assert (
        cli.main(
            [str(source_file), "-D", "window=256", "--pattern", "sliding", "-o", str(tmp_path), "--seq-len", "1024"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    # window(256) reaches four previous blocks: rows see 1, 2, 3, 4, then 5 (70 of 136 tiles);
    # up to three tiles per row below the diagonal are full (0+1+2+3*13 = 42).
    assert "params window=256" in printed
    flagged = tmp_path / "flagged.nsa"
    flagged.write_text("pattern flagged\nblock 16\nparam wide = false\nbranch w = window(8) | window(64) if wide\n")
    assert cli.main([str(flagged), "-D", "wide=true", "-o", str(tmp_path / "flagged")]) == 0
    assert "params wide=true" in capsys.readouterr().out  # the language's spelling, not Python's True
    assert "4.4 key blocks per query row (max 5), density 51.47% of causal tiles, 60% of visited tiles full" in printed
    assert [p.name for p in tmp_path.glob("*_xla.py")] == ["sliding_xla.py"]
    assert "window = 256" in (tmp_path / "sliding_xla.py").read_text()


def test_show_plan_prints_the_lowered_branches(source_file: Path, tmp_path: Path, capsys) -> None:
    assert cli.main([str(source_file), "--pattern", "strided", "--show-plan", "-o", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert (
        "    atom0 = local(2)\n    atom1 = stride(every=4)\n    token mask on partial tiles: atom0 | atom1\n" in printed
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pattern", "strided_"], "NsaSemanticError: no pattern named 'strided_'\n  hint: did you mean 'strided'?"),
        (
            ["-D", "windw=64"],
            "NsaSemanticError: override 'windw' names no param of any pattern\n  hint: did you mean 'window'?",
        ),
        (["-D", "window=wide"], ":3:7: NsaSemanticError: override window='wide' does not fit"),
    ],
)
def test_bad_arguments_about_the_file_exit_1(source_file: Path, tmp_path: Path, capsys, args, message) -> None:
    assert cli.main([str(source_file), "-o", str(tmp_path / "out"), *args]) == 1
    captured = capsys.readouterr()
    assert f"{source_file}" in captured.err and message in captured.err
    assert captured.out == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["-D", "window"],
        ["-D", "=3"],
        ["-D", "1x=3"],
        ["--seq-len", "0"],
        ["--seq-len", str(1 << 40)],
        ["--platform", "cuda"],
        ["--platform", ","],
    ],
)
def test_usage_errors_exit_2(source_file: Path, args: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(source_file), *args])
    assert exit_info.value.code == 2
    assert "usage: nsa-compile" in capsys.readouterr().err


def test_platform_without_templates_is_a_usage_error(source_file: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    platform = importlib.import_module("nsa_dsl.runtime.platform")
    monkeypatch.setattr(platform, "templates_dir", lambda: tmp_path / "no_templates")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(source_file), "--platform", "xla", "-o", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "platform 'xla' has no code generator yet" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unwritable_output_exits_1(source_file: Path, capsys) -> None:
    assert cli.main([str(source_file), "-o", str(source_file)]) == 1
    assert capsys.readouterr().err == f"nsa-compile: File exists: {source_file}\n"


def test_a_module_path_taken_by_a_folder_is_named_in_the_message(source_file: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "sliding_xla.py").mkdir()
    assert cli.main([str(source_file), "--pattern", "sliding", "-o", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"nsa-compile: Is a directory: {tmp_path / 'sliding_xla.py'}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "sliding_xla.py", "two.nsa"]


BAD_SOURCES = {
    "syntax": ("pattern p\nblock 64\ncausal\nbranch main = window(128 | local(2)\n", "4:36: NsaSyntaxError"),
    "unknown name": (
        "pattern p\nparam window = 128\nblock 64\nbranch main = window(windw)\n",
        "4:22: NsaSemanticError: unknown name 'windw'",
    ),
    "block size": ("pattern p\nblock 48\ncausal\nbranch main = local(2)\n", "2:7: NsaSemanticError"),
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_bad_source_exits_1_with_located_error(case: str, tmp_path: Path, capsys) -> None:
    text, located = BAD_SOURCES[case]
    path = tmp_path / "bad.nsa"
    path.write_text(text)
    assert cli.main([str(path), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:{located}") and "^" in err


def test_subprocess_bad_source_prints_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.nsa"
    path.write_text(BAD_SOURCES["syntax"][0])
    result = run_cli(path, "-o", tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr.startswith(f"{path}:4:36: NsaSyntaxError") and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_subprocess_missing_file_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "missing.nsa"
    result = run_cli(missing)
    assert result.returncode == 1
    assert str(missing) in result.stderr and "No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_subprocess_bad_define_exits_2(source_file: Path) -> None:
    result = run_cli(source_file, "-D", "window")
    assert result.returncode == 2
    assert "expected name=value, got 'window'" in result.stderr and "Traceback" not in result.stderr


def test_subprocess_compiles_an_example_from_another_directory(tmp_path: Path) -> None:
    result = run_cli(ROOT / "examples" / "longformer.nsa", "-o", "out", "-D", "window=1024", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "pattern longformer: block 64, causal, params window=1024" in result.stdout
    assert (tmp_path / "out" / "longformer_xla.py").is_file()


def test_examples_are_present() -> None:
    names = {path.stem for path in EXAMPLES}
    assert {"sliding_window", "strided", "longformer", "bigbird", "nsa", "documents"} <= names


def xla_supports(plan) -> bool:
    try:
        check_supported(plan, "xla")
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_every_example_compiles_where_the_backend_supports_it(example: Path, tmp_path: Path, capsys) -> None:
    plans = [lower(pattern) for pattern in dsl.load(example)]
    supported = [plan.name for plan in plans if xla_supports(plan)]
    expected_exit = 0 if len(supported) == len(plans) else 1
    assert cli.main([str(example), "-o", str(tmp_path), "--seq-len", "2048", "--show-plan"]) == expected_exit
    captured = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.glob("*.py")) == sorted(f"{name}_xla.py" for name in supported)
    for plan in plans:
        assert f"pattern {plan.name}:" in captured.out
        if plan.name not in supported:
            assert "nsa-compile: not generated: " in captured.err and repr(plan.name) in captured.err


def test_check_runs_the_kernels_against_the_reference(source_file: Path, tmp_path: Path, capsys) -> None:
    assert cli.main([str(source_file), "--check", "--seq-len", "200", "-o", str(tmp_path)]) == 0
    checks = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  check xla: ")]
    assert len(checks) == 2
    assert all(line.startswith("  check xla: ok: max relative error") and "at T=200" in line for line in checks)


def test_a_module_that_would_shadow_an_installed_one_is_not_written(tmp_path: Path, monkeypatch, capsys) -> None:
    """A pattern `jax` compiled for Triton would write jax_triton.py, which imported from its folder
    hides the jax_triton package the Triton kernels launch through: refused, with the pattern to
    rename; a module already written there by nsa-compile is its own and is written again."""
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / "shadowed_xla.py").write_text("")
    monkeypatch.syspath_prepend(str(installed))
    source = tmp_path / "p.nsa"
    source.write_text("pattern shadowed\nblock 16\nbranch m = window(8)\n\npattern fine\nblock 16\nbranch m = window(8)\n")
    out = tmp_path / "out"
    assert cli.main([str(source), "-o", str(out), "--platform", "xla"]) == 1
    err = capsys.readouterr().err
    assert "shadowed_xla" in err and str(installed / "shadowed_xla.py") in err and "rename pattern 'shadowed'" in err
    assert sorted(p.name for p in out.iterdir()) == ["fine_xla.py"]
    monkeypatch.syspath_prepend(str(out))
    assert cli.main([str(source), "-o", str(out), "--platform", "xla", "--pattern", "fine"]) == 0


def test_a_module_named_as_a_dependency_is_not_written_where_that_is_not_installed(tmp_path: Path, monkeypatch,
                                                                                    capsys) -> None:
    """jax_triton.py is refused where jax_triton is not installed too: installed later (the gpu extra),
    the module would hide it from scripts run in its folder."""
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # importlib.util.find_spec: not installed
    source = tmp_path / "jax.nsa"
    source.write_text("pattern jax\nblock 16\nbranch m = window(8)\n")
    assert cli.main([str(source), "-o", str(tmp_path / "out"), "--platform", "triton"]) == 1
    assert "not generated: " in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []


def test_a_reader_that_stops_reading_stops_the_output_not_the_writing(tmp_path: Path) -> None:
    """`nsa-compile ... | head -1`: the summary's next line met a closed pipe and ended the command
    (exit 1, "Broken pipe") before it wrote the modules."""
    command = [sys.executable, "-m", "nsa_dsl.cli", "examples/longformer.nsa", "-o", str(tmp_path / "out")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=child_env(PYTHONUNBUFFERED="1"), cwd=ROOT)
    process.stdout.close()  # before the first line: as `head -0` would, so every line meets a closed pipe
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err.decode()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["longformer_xla.py"]


def test_check_of_a_topk_count_beyond_the_blocks_allocates_no_column_per_count(tmp_path: Path, capsys) -> None:
    """topk(2147483647, ...) is valid (every block, as any count past the blocks there are): --check's
    reference padded its selections to `count` columns, 3 TiB at T=100, a MemoryError traceback."""
    source = tmp_path / "every.nsa"
    source.write_text("pattern every\nblock 16\nbranch cmp = compress(32, 16)\nbranch slc = topk(2147483647, score=cmp)\n")
    assert cli.main([str(source), "--check", "--seq-len", "100", "-o", str(tmp_path / "out")]) == 0
    assert "  check xla: ok: max relative error" in capsys.readouterr().out


def test_check_on_a_platform_that_cannot_run_here_is_reported_not_raised(source_file: Path, tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    """The module is written (rendering needs no triton), and --check says why it cannot run it: it
    raised ModuleNotFoundError out of nsa-compile, a traceback."""
    monkeypatch.setitem(sys.modules, "triton", None)  # importlib.util.find_spec: not installed
    assert cli.main([str(source_file), "--pattern", "sliding", "--platform", "triton", "--check", "-o", str(tmp_path)]) == 1
    assert "  check triton: not checked: platform='triton' is not available: its modules import triton" in capsys.readouterr().out
    assert (tmp_path / "sliding_triton.py").is_file()


def test_a_cache_that_cannot_take_the_entry_is_not_named_as_its_place(source_file: Path, tmp_path: Path, monkeypatch,
                                                                      capsys) -> None:
    """NSA_DSL_CACHE_DIR a file (or read-only): the module is written all the same, with the cache's
    warning, and the summary no longer says it is cached at a path that holds nothing."""
    root = tmp_path / "cache_file"
    root.write_text("not a directory")
    monkeypatch.setenv("NSA_DSL_CACHE_DIR", str(root))
    with pytest.warns(cache.CacheWarning, match="could not write"):
        assert cli.main([str(source_file), "--pattern", "sliding", "-o", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert f"  xla: wrote {tmp_path / 'out' / 'sliding_xla.py'} (not cached: {root} cannot take it)" in printed
    assert "cached at" not in printed


def test_a_damaged_entry_the_cache_cannot_replace_is_not_named_as_its_place(source_file: Path, tmp_path: Path,
                                                                              monkeypatch, capsys) -> None:
    """A truncated or garbage entry in a cache that cannot take its replacement (read-only): the module
    runs from memory and is written to -o, with the cache's warning; the summary said "cached at" the
    damaged file, which holds no module."""
    out = tmp_path / "out"
    assert cli.main([str(source_file), "--pattern", "sliding", "-o", str(out)]) == 0
    entry = nsa_dsl.compile(source_file, pattern="sliding").module_path("xla")
    entry.write_text("garbage")

    def read_only(path, data, mode=None):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(cache, "write_atomically", read_only)
    capsys.readouterr()
    with pytest.warns(cache.CacheWarning, match="could not write"):
        assert cli.main([str(source_file), "--pattern", "sliding", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"  xla: wrote {out / 'sliding_xla.py'} (not cached: {codegen.cache_root()} cannot take it)" in printed
    assert "cached at" not in printed
    assert (out / "sliding_xla.py").read_text().startswith('"""Sparse attention for pattern `sliding`')


def test_pallas_modules_are_rendered_for_the_device_asked_for(source_file: Path, tmp_path: Path) -> None:
    """Pallas renders Mosaic TPU kernels for a TPU and Triton-lowered ones for a GPU: nsa-compile
    rendered for no device, so on a TPU host it wrote the GPU module."""
    for device in ("gpu", "tpu"):
        out = tmp_path / device
        assert cli.main([str(source_file), "--pattern", "sliding", "--platform", "pallas", "--device", device, "-o", str(out)]) == 0
        config = nsa_dsl.NativeSparseAttentionConfig(backend=device)
        expected = nsa_dsl.compile(source_file, pattern="sliding", config=config).module_path("pallas")
        assert (out / "sliding_pallas.py").read_text() == expected.read_text()
        assert ("pltpu." in expected.read_text()) == (device == "tpu")


def test_block_tables_too_large_for_memory_are_a_message_not_a_traceback(source_file: Path, tmp_path: Path,
                                                                         monkeypatch, capsys) -> None:
    """The summary builds each static branch's table at --seq-len, which any length up to 2**29 may ask
    for: a bidirectional stride(every=1) at block 16 and 4M tokens wants some 400 GB, a MemoryError
    traceback out of nsa-compile."""
    def out_of_memory(*args):
        raise MemoryError

    monkeypatch.setattr(cli, "build_block_table", out_of_memory)
    assert cli.main([str(source_file), "--seq-len", "4194304", "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        "nsa-compile: not enough memory for the block tables' statistics at --seq-len 4194304: give a shorter one\n"
    )


def test_a_write_that_fails_midway_leaves_the_earlier_module_whole(source_file: Path, tmp_path: Path) -> None:
    """A full disk (here a file size limit) failed the write after truncating the module an earlier
    run wrote: its importers then found a fragment. The module is replaced only once written whole."""
    out = tmp_path / "out"
    assert run_cli(source_file, "--pattern", "sliding", "-o", out).returncode == 0
    module = out / "sliding_xla.py"
    written = module.read_bytes()
    module.write_bytes(written.replace(b"Do not edit", b"Do not edit (earlier)"))
    earlier = module.read_bytes()

    # In the child, not through preexec_fn: forking this process, which runs JAX's threads, may deadlock.
    disk_full = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(written) // 2}, resource.RLIM_INFINITY))\n"
        "from nsa_dsl.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    failed = subprocess.run(
        [sys.executable, "-c", disk_full, str(source_file), "--pattern", "sliding", "-o", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(), check=False,
    )
    assert failed.returncode == 1 and failed.stderr.endswith(f"nsa-compile: File too large: {module}\n")
    assert module.read_bytes() == earlier
    assert sorted(p.name for p in out.iterdir()) == ["sliding_xla.py"]  # no temporary file left behind


def test_a_module_behind_a_symbolic_link_is_written_where_the_link_points(source_file: Path, tmp_path: Path) -> None:
    package = tmp_path / "package"
    package.mkdir()
    (package / "sliding_xla.py").write_text("# an earlier version\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "sliding_xla.py").symlink_to(package / "sliding_xla.py")
    assert cli.main([str(source_file), "--pattern", "sliding", "-o", str(out)]) == 0
    assert (out / "sliding_xla.py").is_symlink()
    assert "def sparse_attention(" in (package / "sliding_xla.py").read_text()
