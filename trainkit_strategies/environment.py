"""Where a rank runs: its device, its place among the ranks, where host memory is, and how long to wait for peers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
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


def elastic_store(env: Environment, timeout: timedelta) -> Any:
    """The store this round of ranks meets in.

    Outside torchelastic: a TCPStore served by rank 0 at MASTER_ADDR:MASTER_PORT. Under torchelastic
    (torchrun), the store its agent provides (``env://`` reads the round's variables), with this restart
    round's keys kept apart: torchrun's agent shares one TCPStore across restarts, so without a prefix a
    restarted rank can read the previous round's addresses and fail to connect ("Connection refused";
    pytorch/pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` numbers the rounds, consistently across nodes
    as long as they restart together; for jobs whose nodes join or leave, run torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store every round).
    """
    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    url = "env://" if elastic else f"tcp://{env.master_addr}:{env.master_port}"
    store, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    if elastic:
        store = dist.PrefixStore(f"trainkit/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return dist.PrefixStore("default_pg", store)
