"""The native host-Adam build and the kernel's front door: a cache directory that cannot be used (not a directory,
a name too long, read-only, a file that vanishes) falls back to torch's kernels with one warning; a finished build
never takes the name of a library another process may have loaded; ``CC`` with arguments is the command used; and
``HostAdam.step`` refuses a short, strided, foreign-dtype or off-host buffer by name instead of handing its pointer
to the kernel (which would read past its end, misread it, or crash)."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest

from trainkit_strategies import host_adam as host_adam_module
from trainkit_strategies import native

COMPILER = native.compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler on this machine: nothing is built")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has loaded nothing yet, with its cache in ``tmp_path / "cache"`` and no ``CC`` of its own."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("TRAINKIT_NATIVE", raising=False)
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "native"


def _load_twice() -> tuple[object, list[str]]:
    """``load("host_adam")`` twice in a fresh process, and every warning it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = native.load("host_adam")
        assert native.load("host_adam") is library
    return library, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a second process would start: nothing loaded."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})


def _built_name(monkeypatch: pytest.MonkeyPatch, elsewhere: Path) -> str:
    """The name this machine's build of host_adam gets (learnt by building it once in ``elsewhere``)."""
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(elsewhere))
    library = native.load("host_adam")
    assert library is not None, native.why_not("host_adam")
    _forget(monkeypatch)
    return Path(library._name).name


@needs_compiler
@pytest.mark.parametrize("kind", [
    "under a file",
    "name too long",
    pytest.param("read-only", marks=pytest.mark.skipif(
        hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only directory")),
])
def test_an_unusable_cache_directory_falls_back_with_one_warning(fresh, monkeypatch, tmp_path, kind):
    cause = {"under a file": "Not a directory", "name too long": "File name too long",
             "read-only": "Permission denied"}[kind]
    if kind == "under a file":
        (tmp_path / "a-file").write_text("")
        root = tmp_path / "a-file" / "cache"
    elif kind == "name too long":
        root = tmp_path / ("x" * 300)  # one name of 300 bytes: more than any Linux or macOS file system takes
    else:
        root = tmp_path / "read-only"
        root.mkdir(0o500)
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(root))
    library, said = _load_twice()
    assert library is None and not host_adam_module.uses_kernel()
    assert len(said) == 1, said
    assert cause in said[0] and "set TRAINKIT_CACHE_DIR to a writable directory" in said[0], said[0]
    assert "torch's kernels" in said[0]


@needs_compiler
def test_a_library_that_vanishes_before_it_is_loaded_falls_back_with_one_warning(fresh, monkeypatch):
    """The built file is deleted (a cache cleaner, another process) between the compiler's exit and the load."""
    real_run = native._run

    def run_then_delete(args: list[str]) -> tuple[int, str]:
        result = real_run(args)
        if "-o" in args:
            os.unlink(args[args.index("-o") + 1])
        return result

    monkeypatch.setattr(native, "_run", run_then_delete)
    library, said = _load_twice()
    assert library is None
    assert len(said) == 1 and "No such file or directory" in said[0], said
    assert "set TRAINKIT_CACHE_DIR to a writable directory" in said[0]


@needs_compiler
def test_a_library_another_process_published_is_never_written_over(fresh, monkeypatch, tmp_path):
    """Two processes build the same kernel at once and the other publishes first, maybe loading it: its file keeps
    its inode and bytes (renaming over a library another NFS client has mapped crashes that client)."""
    name = _built_name(monkeypatch, tmp_path / "elsewhere")
    theirs = fresh / name
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path / "cache"))
    real_run = native._run
    published: list[int] = []

    def run_while_another_publishes(args: list[str]) -> tuple[int, str]:
        result = real_run(args)
        if "-o" in args and not published:
            shutil.copy(tmp_path / "elsewhere" / "native" / name, theirs)
            published.append(theirs.stat().st_ino)
        return result

    monkeypatch.setattr(native, "_run", run_while_another_publishes)
    assert native.load("host_adam") is not None, native.why_not("host_adam")
    assert published and theirs.stat().st_ino == published[0]
    assert theirs.read_bytes() == (tmp_path / "elsewhere" / "native" / name).read_bytes()
    _forget(monkeypatch)
    monkeypatch.setattr(native, "_run", real_run)
    assert native.load("host_adam") is not None
    assert theirs.stat().st_ino == published[0]


@needs_compiler
def test_a_library_that_fails_to_load_is_rebuilt_under_a_new_name(fresh, monkeypatch, tmp_path):
    """A corrupt file under the final name is left as it is (another process may hold it) and the same build (the
    best flags, not a lesser set) is published beside it; the next process loads that one without compiling."""
    name = _built_name(monkeypatch, tmp_path / "elsewhere")
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path / "cache"))
    fresh.mkdir(parents=True)
    corrupt = fresh / name
    corrupt.write_bytes(b"\x7fELF truncated")
    library = native.load("host_adam")
    assert library is not None, native.why_not("host_adam")
    rebuilt = Path(library._name)
    assert rebuilt.parent == fresh and rebuilt.name.startswith(corrupt.stem + "-"), rebuilt.name
    assert corrupt.read_bytes() == b"\x7fELF truncated"
    _forget(monkeypatch)
    monkeypatch.setattr(native, "_compile", lambda *args: pytest.fail("compiled again"))
    assert Path(native.load("host_adam")._name) == rebuilt


def _wrapper(folder: Path, real: str) -> Path:
    """A compiler that logs its arguments, then runs ``real`` without its first argument (the marker)."""
    folder.mkdir(parents=True)
    script = folder / "wrap.sh"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{folder / "calls.log"}"\nshift\nexec "{real}" "$@"\n')
    script.chmod(0o755)
    return script


@needs_compiler
def test_a_cc_with_arguments_is_the_command_used(fresh, monkeypatch, tmp_path):
    """``CC="<wrapper> --extra-marker"`` (as ``ccache gcc``), the wrapper in a folder whose name has a space and
    quoted as a shell would: the wrapper runs with the marker first, and a build with another CC is not reused."""
    real = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if real is None:
        pytest.skip("no cc, gcc or clang on the PATH to wrap")
    plain = native.load("host_adam")
    assert plain is not None, native.why_not("host_adam")
    _forget(monkeypatch)
    script = _wrapper(tmp_path / "my cc", real)
    monkeypatch.setenv("CC", f'"{script}" --extra-marker')
    library, said = _load_twice()
    assert library is not None and not said, said
    calls = (tmp_path / "my cc" / "calls.log").read_text().splitlines()
    assert calls and all(call.startswith("--extra-marker ") for call in calls), calls
    assert any(" -o " in call for call in calls), calls  # it compiled: the plain build's key is not this one's
    assert Path(library._name) != Path(plain._name)


@needs_compiler
def test_a_cc_that_names_no_program_is_said_not_replaced(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here --flag")
    library, said = _load_twice()
    assert library is None
    assert len(said) == 1 and "CC='no-such-compiler-here --flag'" in said[0], said
