"""C kernels compiled on first use, as DeepSpeed builds its CPU Adam: one small C file, the machine's own compiler,
a cache keyed by everything the binary depends on, and ``ctypes`` to call it.

Why C and ctypes: the host step of ZeRO-Offload must stream memory on every core without holding the GIL (backward
keeps running Python hooks beside it). ``ctypes`` releases the GIL for the length of a call, OpenMP spreads the call
over the cores, and a file without torch's headers compiles in a fraction of a second. A ``torch.compile``d step
was measured slower here (its bf16 conversions cost more than the memory traffic at one thread) and its generated
binding holds the GIL while it runs.

Where no compiler works (none installed, or the build fails), ``load`` returns None and says so once; callers fall
back to torch's own kernels. ``TRAINKIT_NATIVE=0`` asks for that fallback on purpose (to compare the two, or to rule
the kernel out).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
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


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, Python's own, or cc/gcc/clang on the PATH."""
    candidates = [os.environ.get("CC", ""), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    return next((found for name in candidates if name and (found := shutil.which(name))), None)


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
    if cc is None:
        return None, (f"no C compiler found (install gcc or clang, or set CC): {name} falls back to torch's kernels, "
                      "which take about 1.4x the host memory traffic")
    source = (SOURCES / f"{name}.c").read_bytes()
    version = _run([cc, "--version"])[1]
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags + _COMMON).encode(),
                                         platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
        target = cache_dir() / f"{name}-{key}.so"
        if not target.exists():
            error = _compile(cc, flags, SOURCES / f"{name}.c", target)
            if error is not None:
                errors.append(error)
                continue
        try:
            return ctypes.CDLL(str(target)), None
        except OSError as err:
            errors.append(str(err))
    last = errors[-1].strip().splitlines()[-1] if errors and errors[-1].strip() else "unknown error"
    return None, f"building {name}.c with {cc} failed ({last}): it falls back to torch's kernels"


def _compile(cc: str, flags: list[str], source: Path, target: Path) -> str | None:
    """Build ``source`` into ``target`` atomically (ranks building at once each write their own file, and the
    last rename wins with an identical binary). Returns the compiler's complaint, or None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as err:
        return f"cannot write to {target.parent}: {err} (set TRAINKIT_CACHE_DIR)"
    code, out = _run([cc, *flags, *_COMMON, str(source), "-o", partial, "-lm"])
    if code != 0:
        os.unlink(partial)
        return out or f"{cc} exited with {code}"
    os.replace(partial, target)
    return None


def _run(args: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        return 1, str(err)
    return proc.returncode, proc.stdout + proc.stderr
