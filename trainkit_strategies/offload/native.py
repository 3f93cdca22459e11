"""C kernels compiled on first use, as DeepSpeed builds its CPU Adam: one small C file, the machine's own compiler,
a cache keyed by everything the binary depends on, and ``ctypes`` to call it.

Why C and ctypes: the host step of ZeRO-Offload must stream memory on every core without holding the GIL (backward
keeps running Python hooks beside it). ``ctypes`` releases the GIL for the length of a call, OpenMP spreads the call
over the cores, and a file without torch's headers compiles in a fraction of a second. A ``torch.compile``d step
was measured slower here (its bf16 conversions cost more than the memory traffic at one thread) and its generated
binding holds the GIL while it runs.

Where no compiler works (none installed, ``$CC`` naming no program, or the build fails) or the cache directory
cannot be used (not writable, a name too long, a file that vanishes mid-build), ``load`` returns None and says so
once; callers fall back to torch's own kernels. ``TRAINKIT_NATIVE=0`` asks for that fallback on purpose (to compare
the two, or to rule the kernel out).

The cache may be shared (ranks of one job, users of one NFS home): a build is written to a private file and given a
name that no file has had (``_publish``), so a library that another process may have loaded is never written over.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import uuid
import warnings
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "csrc"
_FLAG_SETS = (  # tried in order: the best binary for this CPU first, then what any compiler accepts
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)
_COMMON = ["-shared", "-fPIC", "-std=c11", "-fno-math-errno", "-ffp-contract=off"]  # the source writes its FMAs
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_why_not: dict[str, str] = {}


def compiler() -> list[str] | None:
    """The command that compiles C here, as words: ``$CC`` split as a shell splits it (``ccache gcc``, a quoted path
    with spaces: the first word found on the PATH, the rest passed before trainkit's flags), else Python's own
    compiler or cc/gcc/clang on the PATH. None where there is none, or where ``$CC`` names no program: a compiler
    the user chose is never swapped for another without a word."""
    chosen = os.environ.get("CC", "").strip()
    if chosen:
        try:
            words = shlex.split(chosen)
        except ValueError:  # an unbalanced quote
            return None
        found = shutil.which(words[0]) if words else None
        return [found, *words[1:]] if found else None
    candidates = [(sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    found = next((path for name in candidates if name and (path := shutil.which(name))), None)
    return [found] if found else None


def cache_dir() -> Path:
    """Where built kernels are kept: ``$TRAINKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainkit`` (~/.cache/trainkit)."""
    root = os.environ.get("TRAINKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "trainkit")
    return Path(root) / "native"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (a binary built for one CPU may not run
    on another that shares the cache directory)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def why_not(name: str) -> str | None:
    """Why ``load(name)`` returned None (no compiler, a failed build, turned off), or None if it loaded."""
    return _why_not.get(name)


def load(name: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built for this machine and loaded, or None (with one warning saying why) where it cannot be."""
    with _lock:
        if name not in _loaded:
            library, reason = _build(name)
            _loaded[name] = library
            if reason is not None:
                _why_not[name] = reason
                if os.environ.get("TRAINKIT_NATIVE", "1") != "0":
                    warnings.warn(f"trainkit: {reason}", RuntimeWarning, stacklevel=3)
        return _loaded[name]


def _build(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("TRAINKIT_NATIVE", "1") == "0":
        return None, "native kernels are off (TRAINKIT_NATIVE=0)"
    if os.name != "posix":
        return None, f"native kernels are built on POSIX systems only; {name} uses torch's kernels here"
    cc = compiler()
    if cc is None and os.environ.get("CC", "").strip():
        return None, (f"CC={os.environ['CC']!r} names no program on the PATH: {name} falls back to torch's kernels; "
                      "set CC to a C compiler command (`gcc`, `ccache gcc`) or unset it")
    if cc is None:
        return None, (f"no C compiler found (install gcc or clang, or set CC): {name} falls back to torch's kernels, "
                      "which take about 1.4x the host memory traffic")
    source = SOURCES / f"{name}.c"
    text = source.read_bytes()
    version = _run([*cc, "--version"])[1]
    directory = cache_dir()
    errors = []
    try:
        for flags in _FLAG_SETS:
            key = hashlib.sha256(b"\0".join([text, shlex.join(cc).encode(), version.encode(),
                                             " ".join(flags + _COMMON).encode(), platform.machine().encode(),
                                             _cpu_signature().encode()])).hexdigest()[:16]
            library, error = _load_or_build(cc, flags, source, directory / f"{name}-{key}")
            if library is not None:
                return library, None
            errors.append(error)
    except OSError as err:  # the cache directory, not the compiler: no other flags would help
        cause = err.strerror or str(err)
        if err.filename and Path(err.filename) != directory:
            cause += f": {err.filename}"
        return None, (f"the kernel cache {directory} cannot be used ({cause}): {name} falls back to torch's "
                      "kernels; set TRAINKIT_CACHE_DIR to a writable directory (or TRAINKIT_NATIVE=0 to choose "
                      "torch's kernels without this warning)")
    last = errors[-1].strip().splitlines()[-1] if errors and errors[-1].strip() else "unknown error"
    return None, f"building {name}.c with {shlex.join(cc)} failed ({last}): it falls back to torch's kernels"


def _load_or_build(cc: list[str], flags: list[str], source: Path, stem: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library ``stem`` names (``<stem>.so``, else one rebuilt beside it), or a fresh build of ``source`` with
    ``flags``: the library, or None and why. Raises ``OSError`` where the cache directory fails."""
    errors = []
    for path in _published(stem):
        try:
            return ctypes.CDLL(str(path)), ""
        except OSError as err:  # corrupt, or not for this machine: left as it is (another process may hold it)
            errors.append(str(err))
    stem.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{stem.name}-", suffix=".tmp", dir=stem.parent)
    os.close(fd)
    try:
        error = _compile(cc, flags, source, partial)
        if error is not None:
            return None, error
        target = _publish(partial, stem)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as err:
        return None, str(err)


def _published(stem: Path) -> list[Path]:
    """The libraries built under ``stem``: its first name, then those rebuilt beside it."""
    try:
        names = os.listdir(stem.parent)
    except FileNotFoundError:
        return []
    first = f"{stem.name}.so"
    rebuilt = sorted(n for n in names if n.startswith(f"{stem.name}-") and n.endswith(".so"))
    return [stem.parent / n for n in ([first] if first in names else []) + rebuilt]


def _compile(cc: list[str], flags: list[str], source: Path, output: str) -> str | None:
    """Build ``source`` into ``output``. Returns the compiler's complaint, or None."""
    code, out = _run([*cc, *flags, *_COMMON, str(source), "-o", output, "-lm"])
    return None if code == 0 else out or f"{shlex.join(cc)} exited with {code}"


def _publish(partial: str, stem: Path) -> Path:
    """Give a finished build a name that no file has had, and return it. A library another process may have loaded
    is never written over (replacing a file that another NFS client has mapped faults its pages): ``os.link``
    fails rather than replace, and where ``<stem>.so`` is taken (another process published first, or the file
    there would not load) or the file system has no hard links, the build is renamed to a name of its own."""
    with open(partial, "rb") as f:
        os.fsync(f.fileno())  # whole on disk before any other process can find it by name
    os.chmod(partial, 0o755)  # as a compiler leaves its output (mkstemp made it private): other users load it too
    first = stem.parent / f"{stem.name}.so"
    try:
        os.link(partial, first)
        return first
    except OSError:
        own = stem.parent / f"{stem.name}-{uuid.uuid4().hex[:12]}.so"
        os.rename(partial, own)
        return own


def _run(args: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        return 1, str(err)
    return proc.returncode, proc.stdout + proc.stderr
