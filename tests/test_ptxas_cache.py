"""The caching ptxas wrapper (nsa_dsl/runtime/ptxas_cache.py and bin/ptxas).

A stand-in ptxas (a shell script that logs each run and writes a binary derived from its input
and options) shows which calls reach the real compiler; the ptxas in the triton wheel, on a
hand-written PTX kernel, shows the wrapper passes real compilations through byte for byte."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nsa_dsl.runtime import ptxas_cache

STAND_IN = r"""#!/bin/sh
# A stand-in ptxas: logs its run; fails on PTX containing "error"; else writes a binary that
# depends on the input and the options.
echo run >> "$(dirname "$0")/runs"
[ "$1" = --version ] && { echo "stand-in ptxas 1.0"; exit 0; }
input=$1; output=$3; shift 3
grep -q error "$input" && { echo "ptxas fatal: syntax error in $input" >&2; exit 255; }
echo "ptxas info: used $(wc -c < "$input") bytes of registers" >&2
{ echo "binary for $*"; cat "$input"; } > "$output"
"""


def stand_in_ptxas(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "ptxas").write_text(STAND_IN)
    (directory / "ptxas").chmod(0o755)
    return directory


def install_before(path_entry: str, tmp_path: Path, monkeypatch) -> Path | None:
    """ptxas_cache.install() in a process whose PATH starts with `path_entry` and whose cache is tmp_path/cache."""
    monkeypatch.setenv("PATH", f"{path_entry}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("NSA_DSL_PTXAS_CACHE", ptxas_cache.REAL_VARIABLE, ptxas_cache.STORE_VARIABLE):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever install sets
    ptxas_cache.install.cache_clear()
    installed = ptxas_cache.install()
    ptxas_cache.install.cache_clear()
    return installed


@pytest.fixture
def wrapper(tmp_path, monkeypatch):
    """Installs the wrapper in front of the stand-in; returns (wrapper path, stand-in directory)."""
    real_dir = stand_in_ptxas(tmp_path / "cuda" / "bin")
    installed = install_before(str(real_dir), tmp_path, monkeypatch)
    assert installed is not None
    return installed, real_dir


def store() -> Path:
    return Path(os.environ[ptxas_cache.STORE_VARIABLE])


def runs(real_dir: Path) -> int:
    log = real_dir / "runs"
    return len(log.read_text().splitlines()) if log.exists() else 0


def compile_ptx(tool, source: Path, output: Path, *options: str) -> subprocess.CompletedProcess:
    # The argument order XLA and jaxlib use.
    command = [str(tool), str(source), "-o", str(output), *(options or ("-arch=sm_90a", "--warn-on-spills"))]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def ptx_file(directory: Path, rng, text: str | None = None) -> Path:
    path = directory / f"kernel_{int(rng.integers(1 << 40))}.ptx"
    path.write_text(text or f".version 8.4\n// kernel {int(rng.integers(1 << 40))}\n")
    return path


def test_install_puts_the_wrapper_first_on_path(wrapper):
    installed, real_dir = wrapper
    entries = os.environ["PATH"].split(os.pathsep)
    assert entries[0] == str(installed.parent) and entries[1] == str(real_dir)
    assert subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout == "stand-in ptxas 1.0\n"


def test_a_repeated_compilation_is_served_from_disk(wrapper, tmp_path, rng):
    installed, real_dir = wrapper
    source = ptx_file(tmp_path, rng)
    first = compile_ptx(installed, source, tmp_path / "first.cubin")
    second = compile_ptx(installed, source, tmp_path / "second.cubin")
    direct = compile_ptx(real_dir / "ptxas", source, tmp_path / "direct.cubin")
    assert first.returncode == second.returncode == 0
    assert runs(real_dir) == 2  # the wrapper's first call and the direct one
    assert (tmp_path / "second.cubin").read_bytes() == (tmp_path / "first.cubin").read_bytes()
    assert (tmp_path / "second.cubin").read_bytes() == (tmp_path / "direct.cubin").read_bytes()
    # stderr carries ptxas's messages (XLA reads spill warnings there) on a hit too
    assert first.stderr == second.stderr == direct.stderr and "ptxas info" in second.stderr


def test_the_key_covers_the_ptx_and_the_options(wrapper, tmp_path, rng):
    installed, real_dir = wrapper
    source = ptx_file(tmp_path, rng)
    compile_ptx(installed, source, tmp_path / "a.cubin")
    compile_ptx(installed, source, tmp_path / "b.cubin", "-arch=sm_80", "--warn-on-spills")
    other = ptx_file(tmp_path, rng)
    compile_ptx(installed, other, tmp_path / "c.cubin")
    assert runs(real_dir) == 3
    assert b"-arch=sm_80" in (tmp_path / "b.cubin").read_bytes()
    assert (tmp_path / "c.cubin").read_bytes().endswith(other.read_bytes())


@pytest.mark.parametrize("damage", ["binary edited", "binary truncated", "log removed", "checksums edited"])
def test_a_damaged_entry_is_compiled_again(wrapper, tmp_path, rng, damage):
    installed, real_dir = wrapper
    source = ptx_file(tmp_path, rng)
    compile_ptx(installed, source, tmp_path / "first.cubin")
    (binary,) = store().glob("*.cubin")
    if damage == "binary edited":
        data = bytearray(binary.read_bytes())
        data[len(data) // 2] ^= 1
        binary.write_bytes(bytes(data))
    elif damage == "binary truncated":
        binary.write_bytes(binary.read_bytes()[:5])
    elif damage == "log removed":
        binary.with_suffix(".log").unlink()
    else:
        binary.with_suffix(".sha256").write_text("0" * 64)
    again = compile_ptx(installed, source, tmp_path / "again.cubin")
    assert again.returncode == 0 and runs(real_dir) == 2
    assert (tmp_path / "again.cubin").read_bytes() == (tmp_path / "first.cubin").read_bytes()
    # rewritten: the next call is a hit again
    compile_ptx(installed, source, tmp_path / "third.cubin")
    assert runs(real_dir) == 2 and (tmp_path / "third.cubin").read_bytes() == (tmp_path / "first.cubin").read_bytes()


def test_a_failed_compilation_is_reported_and_not_stored(wrapper, tmp_path, rng):
    installed, real_dir = wrapper
    source = ptx_file(tmp_path, rng, text=".version 8.4\nthis is an error\n")
    for _ in range(2):
        failed = compile_ptx(installed, source, tmp_path / "out.cubin")
        assert failed.returncode == 255 and "syntax error" in failed.stderr
    assert runs(real_dir) == 2
    assert not list(store().iterdir())  # no entry, no partial files


@pytest.mark.parametrize(
    "arguments",
    [["--version"], ["a.ptx", "b.ptx", "-o", "out.cubin"], ["-arch", "sm_90a", "a.ptx", "-o", "out.cubin"], ["a.ptx"]],
    ids=["version", "two inputs", "option with a separate value", "no output"],
)
def test_calls_it_cannot_key_go_straight_through(wrapper, tmp_path, arguments):
    installed, real_dir = wrapper
    (tmp_path / "a.ptx").write_text(".version 8.4\n")
    (tmp_path / "b.ptx").write_text(".version 8.4\n")
    subprocess.run([str(installed), *arguments], cwd=tmp_path, capture_output=True, timeout=60)
    subprocess.run([str(installed), *arguments], cwd=tmp_path, capture_output=True, timeout=60)
    assert runs(real_dir) == 2
    assert not store().exists()


def test_an_unwritable_store_still_compiles(wrapper, tmp_path, rng):
    installed, real_dir = wrapper
    store().parent.mkdir(parents=True)
    store().write_text("a file where the store's directory should be")
    source = ptx_file(tmp_path, rng)
    for name in ("a", "b"):
        done = compile_ptx(installed, source, tmp_path / f"{name}.cubin")
        assert done.returncode == 0 and (tmp_path / f"{name}.cubin").read_bytes().endswith(source.read_bytes())
        assert done.stderr.startswith("ptxas info")  # the wrapper adds no messages of its own
    assert runs(real_dir) == 2


def test_racing_compilations_leave_one_valid_entry(wrapper, tmp_path, rng):
    installed, real_dir = wrapper
    source = ptx_file(tmp_path, rng)
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda n: compile_ptx(installed, source, tmp_path / f"{n}.cubin"), range(16)))
    expected = compile_ptx(real_dir / "ptxas", source, tmp_path / "direct.cubin")
    assert all(d.returncode == 0 for d in done) and expected.returncode == 0
    assert all((tmp_path / f"{n}.cubin").read_bytes() == (tmp_path / "direct.cubin").read_bytes() for n in range(16))
    assert len(list(store().glob("*.sha256"))) == 1 and not list(store().glob(".*"))  # no partial files left
    before = runs(real_dir)
    compile_ptx(installed, source, tmp_path / "after.cubin")
    assert runs(real_dir) == before


def test_a_ptxas_found_through_a_relative_path_entry_is_named_absolutely(tmp_path, monkeypatch):
    stand_in_ptxas(tmp_path / "cuda" / "bin")
    monkeypatch.chdir(tmp_path)
    assert install_before("cuda/bin", tmp_path, monkeypatch) is not None
    assert os.environ[ptxas_cache.REAL_VARIABLE] == str(tmp_path / "cuda" / "bin" / "ptxas")


@pytest.mark.parametrize("reason", ["switched off", "no ptxas on PATH"])
def test_without_a_wrapper_to_install_path_is_untouched(wrapper, tmp_path, monkeypatch, reason):
    _, real_dir = wrapper
    if reason == "switched off":
        monkeypatch.setenv("NSA_DSL_PTXAS_CACHE", "0")
        monkeypatch.setenv("PATH", f"{real_dir}{os.pathsep}{os.environ['PATH']}")
    else:  # sha256sum alone
        tools = tmp_path / "tools"
        tools.mkdir()
        (tools / "sha256sum").symlink_to(shutil.which("sha256sum"))
        monkeypatch.setenv("PATH", str(tools))
    path = os.environ["PATH"]
    assert ptxas_cache.install() is None and os.environ["PATH"] == path
    ptxas_cache.install.cache_clear()


def test_a_process_with_another_cache_directory_puts_its_own_wrapper_first(wrapper, tmp_path, monkeypatch):
    # A child process inherits PATH with its parent's wrapper; with a cache directory of its own it
    # must neither use the parent's store nor wrap the parent's wrapper.
    parent_wrapper, real_dir = wrapper
    parent_store = store()
    monkeypatch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path / "child-cache"))
    child_wrapper = ptxas_cache.install()
    ptxas_cache.install.cache_clear()
    entries = os.environ["PATH"].split(os.pathsep)
    assert entries[0] == str(child_wrapper.parent) and entries.count(str(parent_wrapper.parent)) == 1
    assert os.environ[ptxas_cache.REAL_VARIABLE] == str(real_dir / "ptxas")
    assert store().is_relative_to(tmp_path / "child-cache") and not parent_store.is_relative_to(tmp_path / "child-cache")


def test_deleting_the_cache_directory_under_a_process_keeps_its_ptxas(wrapper, tmp_path, rng):
    """XLA keeps the ptxas it found for the whole process: a wrapper stored in the cache directory
    went with it, and every later GPU compilation failed ("Failed to launch ptxas")."""
    installed, real_dir = wrapper
    source = ptx_file(tmp_path, rng)
    compile_ptx(installed, source, tmp_path / "first.cubin")
    shutil.rmtree(tmp_path / "cache")
    again = compile_ptx(installed, source, tmp_path / "again.cubin")
    assert again.returncode == 0 and runs(real_dir) == 2
    assert (tmp_path / "again.cubin").read_bytes() == (tmp_path / "first.cubin").read_bytes()
    compile_ptx(installed, source, tmp_path / "third.cubin")  # the store was made again
    assert runs(real_dir) == 2


def test_a_child_given_path_alone_reaches_the_real_ptxas(wrapper, tmp_path, rng):
    installed, real_dir = wrapper
    env = {"PATH": os.environ["PATH"]}  # a launcher that passes PATH on, not nsa_dsl's variables
    version = subprocess.run(["ptxas", "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert version.stdout == "stand-in ptxas 1.0\n" and runs(real_dir) == 1
    source = ptx_file(tmp_path, rng)
    for name in ("a", "b"):
        done = subprocess.run([str(installed), str(source), "-o", str(tmp_path / f"{name}.cubin"), "-arch=sm_90a"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and (tmp_path / f"{name}.cubin").read_bytes().endswith(source.read_bytes())
    assert runs(real_dir) == 3  # no store without the variables: each call compiles


REAL_PTX = """\
.version 8.0
.target sm_90a
.address_size 64
.visible .entry add_one(.param .u64 data)
{
  .reg .b64 %rd<3>;
  .reg .b32 %r<3>;
  ld.param.u64 %rd1, [data];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  mul.wide.u32 %rd1, %r1, 4;
  add.s64 %rd2, %rd2, %rd1;
  ld.global.u32 %r2, [%rd2];
  add.s32 %r2, %r2, 1;
  st.global.u32 [%rd2], %r2;
  ret;
}
"""


def test_the_real_ptxas_gives_the_same_binary_through_the_wrapper(tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    real = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not os.access(real, os.X_OK):
        pytest.skip("this triton wheel carries no ptxas")
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ptxas").symlink_to(real)
    installed = install_before(str(bin_dir), tmp_path, monkeypatch)
    source = tmp_path / "add_one.ptx"
    source.write_text(REAL_PTX)
    direct = compile_ptx(real, source, tmp_path / "direct.cubin")
    assert direct.returncode == 0, direct.stderr
    for name in ("miss", "hit"):
        done = compile_ptx(installed, source, tmp_path / f"{name}.cubin")
        assert done.returncode == 0 and done.stderr == direct.stderr
        assert (tmp_path / f"{name}.cubin").read_bytes() == (tmp_path / "direct.cubin").read_bytes()
    assert (tmp_path / "direct.cubin").read_bytes()[:4] == b"\x7fELF"
    bad = tmp_path / "bad.ptx"
    bad.write_text(REAL_PTX.replace("add.s32", "add.bogus"))
    failed = compile_ptx(installed, bad, tmp_path / "bad.cubin")
    assert failed.returncode != 0 and "bogus" in failed.stderr
