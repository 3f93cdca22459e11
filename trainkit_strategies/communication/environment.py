"""Where a rank runs: its device, its place among the ranks, where host memory is, and how long to wait for peers;
and where the ranks meet (the rendezvous store), on which network interface.

A run whose ranks all live on one machine (MASTER_ADDR is a loopback address, as when trainkit launches them with
``--trainer.devices N``) listens on the loopback interface only: rank 0's store, gloo's connections and NCCL's
bootstrap. A multi-node run listens where its launcher says, as torch does (docs/distributed.md).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Environment:
    """Where this process sits: its device and its place among the ranks.

    Attributes:
        device: the device this rank computes on.
        rank: global rank. local_rank: rank on this node. world_size: number of ranks.
        local_world_size: ranks on this node (0: unknown; a layout then assumes one node).
        master_addr, master_port: rendezvous address of rank 0 (unused when ``world_size == 1``).
        timeout_s: how long a collective may wait for a peer before it fails.
        peer_timeout_s: how long a peer may stop answering the heartbeat (``liveness.py``) before the run fails, so
            a peer that died is noticed within seconds also on NCCL (which otherwise waits ``timeout_s``); 0 turns
            the heartbeat off.
        host: where host memory lives (offloaded optimizer state, pinned staging): the CPU, or the meta device
            when a strategy is only being measured (``trainkit estimate``).
        separate_host: whether host memory is apart from the device's, so that offloaded buffers cross a bus
            (device scratch, pinned copies); default: the device is not the CPU. ``trainkit estimate`` sets it
            to plan a GPU run on the meta device.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 1800.0
    peer_timeout_s: float = 15.0
    host: torch.device = field(default_factory=lambda: torch.device("cpu"))
    separate_host: bool | None = None

    @property
    def host_is_separate(self) -> bool:
        """Host memory is not the device's: offloaded state crosses a bus (see ``separate_host``)."""
        return self.separate_host if self.separate_host is not None else self.device.type != "cpu"

    @staticmethod
    def accelerator_type(accelerator: str) -> str:
        """"cpu" or "cuda": what ``accelerator`` ("auto" included) means on this machine."""
        if accelerator == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if accelerator not in ("cpu", "cuda"):
            raise ValueError(f"Unknown accelerator {accelerator!r}; choose 'cpu', 'cuda' or 'auto'.")
        if accelerator == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("accelerator='cuda' was requested but CUDA is not available; use 'cpu'.")
        return accelerator

    @staticmethod
    def check_gpu_count(ranks_on_node: int, accelerator: str) -> None:
        """Fail, naming both numbers and the fix, when more ranks would run on this machine than it has GPUs:
        NCCL needs one GPU per rank (two ranks on one GPU end in "Duplicate GPU detected")."""
        if Environment.accelerator_type(accelerator) != "cuda":
            return
        visible = torch.cuda.device_count()
        if ranks_on_node > visible:
            raise RuntimeError(
                f"{ranks_on_node} processes on this machine would run on CUDA (accelerator={accelerator!r}), but "
                f"{visible} GPU{'s are' if visible != 1 else ' is'} visible: each rank needs a GPU of its own. Use "
                f"--trainer.devices {visible} (devices={visible}), or --trainer.accelerator cpu "
                f"(accelerator='cpu') to run {ranks_on_node} processes on the CPU."
            )

    @staticmethod
    def resolve_device(accelerator: str, local_rank: int = 0) -> torch.device:
        """This rank's device: ``cuda:<local_rank>`` (one GPU per rank), or the CPU."""
        if Environment.accelerator_type(accelerator) == "cpu":
            return torch.device("cpu")
        Environment.check_gpu_count(local_rank + 1, accelerator)
        return torch.device("cuda", local_rank)

    @classmethod
    def from_env(cls, accelerator: str = "auto", timeout_s: float = 1800.0, peer_timeout_s: float = 15.0
                 ) -> Environment:
        """Read RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun's variables)."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return cls(
            device=cls.resolve_device(accelerator, local_rank),
            rank=int(os.environ.get("RANK", 0)),
            local_rank=local_rank,
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 0)),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", 29500)),
            timeout_s=timeout_s,
            peer_timeout_s=peer_timeout_s,
        )


class RendezvousError(RuntimeError):
    """The ranks could not meet: rank 0 cannot serve the store at MASTER_PORT, or the ranks did not all reach it within
    ``timeout_s``."""


def loopback(host: str) -> bool:
    """Whether ``host`` (MASTER_ADDR) names only this machine's loopback (127.0.0.1, ::1, localhost): every rank then
    runs here, as no other machine could reach rank 0 there."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in found)


def _loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux), from each interface's flags."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return None


def collectives_on_loopback(env: Environment) -> None:
    """Before the process group is made: when every rank runs on this machine, gloo's connections
    (``GLOO_SOCKET_IFNAME``; otherwise gloo listens on the address the host name resolves to) and NCCL's bootstrap
    and socket transport (``NCCL_SOCKET_IFNAME``; otherwise its first usable interface) use the loopback interface,
    rather than listening where the network reaches them. An interface the user named is kept."""
    name = _loopback_interface()
    if name is not None and loopback(env.master_addr):
        for variable, value in (("GLOO_SOCKET_IFNAME", name), ("NCCL_SOCKET_IFNAME", f"={name}")):  # NCCL: "=" is
            if not os.environ.get(variable):  # exactly this interface, where a bare name is a prefix of names
                os.environ[variable] = value


def elastic_store(env: Environment, timeout: timedelta) -> Any:
    """The store this round of ranks meets in.

    Outside torchelastic: a TCPStore served by rank 0 at MASTER_ADDR:MASTER_PORT, listening on that address alone
    when it is a loopback address (torch's own listens on every interface), and made within ``timeout`` on every
    rank. Under torchelastic (torchrun), the store its agent provides (``env://`` reads the round's variables), with
    this restart round's keys kept apart: torchrun's agent shares one TCPStore across restarts, so without a prefix a
    restarted rank can read the previous round's addresses and fail to connect ("Connection refused";
    pytorch/pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` numbers the rounds, consistently across nodes
    as long as they restart together; for jobs whose nodes join or leave, run torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store every round).
    """
    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    if elastic:
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    else:
        store = _within_timeout(lambda: _tcp_store(env, timeout), env)
    store.set_timeout(timeout)
    if elastic:
        store = dist.PrefixStore(f"trainkit/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return dist.PrefixStore("default_pg", store)


def _tcp_store(env: Environment, timeout: timedelta) -> Any:
    host, port = env.master_addr, env.master_port
    if env.rank != 0:
        return dist.TCPStore(host, port, env.world_size, False, timeout, multi_tenant=True)
    listening = _listen_on_loopback(env) if loopback(host) else None
    try:
        return dist.TCPStore(host, port, env.world_size, True, timeout, multi_tenant=listening is None,
                             master_listen_fd=listening)
    except dist.DistNetworkError as err:
        if "EADDRINUSE" in str(err):
            raise RendezvousError(_port_taken(env)) from None
        raise


def _listen_on_loopback(env: Environment) -> int:
    """A socket listening at MASTER_ADDR:MASTER_PORT (a loopback address) for rank 0's store to serve on."""
    family, kind, proto, _, address = socket.getaddrinfo(env.master_addr, env.master_port,
                                                         type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own: a port left in TIME_WAIT is free
    try:
        sock.bind(address)
        sock.listen()
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise RendezvousError(_port_taken(env)) from None
        raise
    return sock.detach()


def _port_taken(env: Environment) -> str:
    return (f"Rank 0 cannot serve the rendezvous at {env.master_addr}:{env.master_port}: another program listens on "
            f"port {env.master_port} (MASTER_PORT). Unset MASTER_PORT (trainkit picks a free port when it launches the "
            "ranks itself, with --trainer.devices N), or set it to a free port on every rank.")


def _within_timeout(make: Callable[[], Any], env: Environment) -> Any:
    """``make()``, or a ``RendezvousError`` once ``env.timeout_s`` has passed. torch's TCPStore bounds a client's
    attempts to connect by its timeout but not the handshake after: a port held by a program that accepts and never
    answers (not a store) holds a rank until that program closes the connection (58 s measured, timeout 5 s)."""
    made: dict[str, Any] = {}

    def run() -> None:
        try:
            made["store"] = make()
        except Exception as err:  # handed to the waiting thread
            made["error"] = err

    thread = threading.Thread(target=run, name="trainkit-rendezvous", daemon=True)
    thread.start()
    thread.join(env.timeout_s)
    error = made.get("error")
    if "store" in made:
        return made["store"]
    if isinstance(error, RendezvousError) or (error is not None and not isinstance(error, dist.DistError)):
        raise error
    who = ("not every rank joined" if env.rank == 0 else
           "rank 0's store did not answer (rank 0 has not started, or failed, or another program holds the port)")
    raise RendezvousError(
        f"Rank {env.rank}: the ranks did not meet at {env.master_addr}:{env.master_port} (MASTER_ADDR:MASTER_PORT) "
        f"within timeout_s={env.timeout_s:g}: {who}{f' ({error})' if error else ''}. Start every rank with the same "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, with MASTER_PORT free on rank 0's machine (trainkit picks a free "
        "one when it launches the ranks itself, with --trainer.devices N)."
    ) from error
