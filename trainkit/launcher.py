"""Process launching and environment detection.

Three ways a run gets its ranks:

1. torchrun (TorchElastic) or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT:
   trainkit reads the variables and launches nothing.
2. SLURM (``srun``): SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the first host of the node list.
3. ``--trainer.devices N`` on one machine: this process becomes rank 0 and starts N-1 copies of the
   same command with the variables set and a free port.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import subprocess
import sys
import threading
from typing import NoReturn

import torch

from trainkit_strategies import Environment

_children: list[subprocess.Popen] = []
_grace_s = 60.0
FAILED_GRACE_S = 5.0  # a peer of a failed run is stuck, or sees the failure within a second or two
_term_s = 10.0  # from SIGTERM to SIGKILL
_joined = threading.Event()  # set once this process has joined the process group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_env() -> dict[str, str] | None:
    if "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return None
    if os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST", "127.0.0.1")
    first = _first_host(nodes)
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    return {
        "RANK": os.environ["SLURM_PROCID"],
        "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": os.environ["SLURM_NTASKS"],
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", first),
        "MASTER_PORT": os.environ.get("MASTER_PORT", str(15000 + job % 20000)),
    }


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``gpu[03-05,07],cpu1``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first


def _command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]


def _threads_per_rank(devices: int) -> int:
    """CPU threads per local rank so N ranks do not oversubscribe the cores (torchrun uses 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // devices)


def _relaunchable() -> bool:
    """Whether this process's command can be run again: a script or ``python -m``, not ``python -c``, a
    REPL or a notebook kernel."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "ipykernel_launcher":
        return True
    return bool(getattr(main, "__file__", None)) and bool(sys.argv) and sys.argv[0] not in ("", "-c")


def _watch_startup() -> None:
    """Until this rank joins the process group, stop the run as soon as a launched rank exits: it died
    before the rendezvous (an import error, say), and rank 0 would otherwise wait ``timeout_s`` for it."""
    while not _joined.wait(0.2):
        for rank, child in enumerate(list(_children), start=1):
            code = child.poll()
            if code is not None:
                print(f"trainkit: error: rank {rank} exited with code {code} before joining the other ranks (its "
                      "error is printed above); stopping the run.", file=sys.stderr, flush=True)
                for other in _children:
                    if other.poll() is None:
                        other.terminate()
                os._exit(code or 1)


def joined() -> None:
    """Called once the process group is up: launched ranks are from now on watched by the collectives."""
    _joined.set()


def _launch(devices: int, timeout_s: float) -> None:
    if not _relaunchable():
        raise RuntimeError(
            f"devices={devices} re-runs this program once per extra rank, but it was started from python -c, an "
            "interactive session or a notebook, which cannot be re-run. Put the training code in a script (the "
            "Trainer under `if __name__ == \"__main__\":`) and run that, or start the ranks with torchrun."
        )
    port = str(free_port())
    threads = os.environ.get("OMP_NUM_THREADS") or str(_threads_per_rank(devices))
    torch.set_num_threads(int(threads))
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(devices),
            "LOCAL_WORLD_SIZE": str(devices), "OMP_NUM_THREADS": threads}
    print(f"Launching {devices} ranks on this machine ({threads} CPU thread(s) each); this process is rank 0.",
          flush=True)  # the seconds until they have all joined would otherwise be silent
    for rank in range(1, devices):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "TRAINKIT_LAUNCHED": "1"}
        _children.append(subprocess.Popen(_command(), env=env))
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(devices),
                       "LOCAL_WORLD_SIZE": str(devices), "RANK": "0", "LOCAL_RANK": "0", "TRAINKIT_LAUNCHED": "1"})
    global _grace_s
    _grace_s = timeout_s + 30.0
    atexit.register(wait_children)
    threading.Thread(target=_watch_startup, name="trainkit-launch-watch", daemon=True).start()


def failed() -> None:
    """This rank's run failed (a peer died, say): launched ranks still running 5 s after it finishes are stuck on
    the same failure, not slow (a rank waiting on this one fails as soon as its connections close), so they are
    stopped then, 5 s after SIGTERM at the latest, instead of after ``timeout_s + 30``."""
    global _grace_s, _term_s
    _grace_s = min(_grace_s, FAILED_GRACE_S)
    _term_s = min(_term_s, FAILED_GRACE_S)


def wait_children() -> int:
    """Wait for launched ranks; returns the first non-zero exit code (0 when all succeeded).

    A rank still running ``timeout_s + 30`` seconds after this one finished is stuck (its peers are
    gone): it is terminated rather than waited on forever. Ranks launched by a process that never joined
    them (it failed first) are terminated at once.
    """
    if not _joined.is_set():
        for child in _children:
            if child.poll() is None:
                child.terminate()
    code = 0
    while _children:
        child = _children.pop(0)
        try:
            rc = child.wait(timeout=_grace_s)
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                rc = child.wait(timeout=_term_s)
            except subprocess.TimeoutExpired:
                child.kill()
                rc = child.wait()
        code = code or rc
    return code


def connect(accelerator: str, devices: int, num_nodes: int, timeout_s: float, peer_timeout_s: float = 15.0
            ) -> Environment:
    """The Environment of this process, launching local ranks first when ``devices > 1`` asks for it."""
    slurm = _slurm_env()
    if slurm is not None and "WORLD_SIZE" not in os.environ:
        os.environ.update(slurm)
    launching = "WORLD_SIZE" not in os.environ and devices * num_nodes > 1
    local = devices if launching else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    Environment.check_gpu_count(local, accelerator)  # before any process is started or group is made
    if launching:
        if num_nodes > 1:
            raise RuntimeError(
                f"num_nodes={num_nodes} needs a multi-node launcher: start the run with torchrun "
                "(--nnodes, --nproc-per-node) or srun, which set RANK/WORLD_SIZE for trainkit to read."
            )
        _launch(devices, timeout_s)
    env = Environment.from_env(accelerator, timeout_s, peer_timeout_s)
    expected = devices * num_nodes
    if env.world_size > 1 and expected > 1 and env.world_size != expected:
        raise RuntimeError(
            f"The launcher started {env.world_size} processes but devices * num_nodes = {devices} * {num_nodes} "
            f"= {expected}. Make --trainer.devices/--trainer.num_nodes match the launcher (or leave devices=1)."
        )
    return env


def leave() -> NoReturn:
    """Ends the ``trainkit`` command once its run is over and the run's objects are gone: unreachable objects are
    collected (their files closed), idle thread pools (torch.compile's) told to stop, threads still working joined,
    the exit handlers run (the process group's teardown, the launched ranks waited on) and the streams flushed; then
    the process exits without the interpreter's teardown of every module, which takes half a second with torch
    loaded, on every rank, and rank 0 waits out each launched rank's."""
    gc.collect()
    threading._shutdown()  # what the interpreter does first (3.10+): tell idle thread pools to stop, join the rest
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
