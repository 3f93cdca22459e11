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
import torch

from trainkit_strategies.offload import host_adam as host_adam_module
from trainkit_strategies.offload import native
from trainkit_strategies.offload.host_adam import HostAdam

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


# -- what HostAdam.step is handed ---------------------------------------------------------------------------------

@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The compiled kernel, and torch's kernels as where no compiler exists."""
    if request.param == "torch":
        monkeypatch.setattr(host_adam_module, "_kernel", lambda: None)
    elif not host_adam_module.uses_kernel():
        pytest.skip(f"the kernel is not built here: {native.why_not('host_adam')}")
    return request.param


def _adam(n: int = 4099) -> tuple[HostAdam, list[torch.Tensor], torch.Tensor]:
    master = torch.randn(n)
    pieces = [master[:1000], master[1000:]]
    opt = torch.optim.AdamW(pieces, lr=1e-2)
    adam = HostAdam(opt, [(master, 0, [(pieces[0], 0), (pieces[1], 1000)])])
    adam.begin(1.0, threads=1)
    return adam, pieces, master


def test_well_formed_buffers_step(path):
    adam, pieces, master = _adam()
    before = master.clone()
    grad, out = torch.randn(master.numel()).bfloat16(), torch.empty(master.numel(), dtype=torch.bfloat16)
    adam.step(pieces, [grad[:1000], grad[1000:]], [out[:1000], out[1000:]])
    assert not torch.equal(master, before) and torch.equal(out, master.bfloat16())


REFUSALS = {  # case: the error and the words that name the argument, what it is and what was expected
    "short gradient": (ValueError, r"grads hold 4000 elements; pieces hold 4099"),
    "short output": (ValueError, r"outs hold 4098 elements; pieces hold 4099"),
    "strided gradient": (ValueError, r"grads\[0\] .*stride \(2,\).* contiguous"),
    "gradients apart": (ValueError, r"grads\[1\] does not start where grads\[0\] ends"),
    "integer gradient": (TypeError, r"grads\[0\] .*torch.int32.* float32, bfloat16 or float16"),
    "integer output": (TypeError, r"outs\[0\] .*torch.int16.* float32, bfloat16 or float16"),
    "gradient off the host": (ValueError, r"grads\[0\] .*meta.* host \(CPU\) memory"),
    "not a piece": (ValueError, r"pieces\[0\] .*not a master piece"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_malformed_buffer_is_refused_by_name(path, case):
    """Each would reach the kernel as a raw pointer and a length: read past its end, read every other element as
    if adjacent, misread as floats, or dereferenced off the host (a crash)."""
    adam, pieces, master = _adam()
    n = master.numel()
    grads, outs = [torch.randn(n)], None
    if case == "short gradient":
        grads = [torch.randn(4000)]
    elif case == "short output":
        outs = [torch.empty(n - 1)]
    elif case == "strided gradient":
        grads = [torch.randn(2 * n)[::2]]
    elif case == "gradients apart":
        grads = [torch.randn(1000), torch.randn(n - 1000)]
    elif case == "integer gradient":
        grads = [torch.ones(n, dtype=torch.int32)]
    elif case == "integer output":
        outs = [torch.empty(n, dtype=torch.int16)]
    elif case == "gradient off the host":
        grads = [torch.empty(n, device="meta")]
    else:
        pieces = [torch.randn(n)]
    before = master.clone()
    error, words = REFUSALS[case]
    with pytest.raises(error, match=words):
        adam.step(pieces, grads, outs)
    assert torch.equal(master, before)  # refused before anything was written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a gradient in device memory")
def test_a_gradient_in_device_memory_is_refused(path):
    adam, pieces, master = _adam()
    with pytest.raises(ValueError, match=r"grads\[0\] .*cuda.* host \(CPU\) memory"):
        adam.step(pieces, [torch.randn(master.numel(), device="cuda")])
