"""Where ranks meet: a one-machine run listens on the loopback interface only (rank 0's store, gloo's connections,
NCCL's bootstrap), and the rendezvous is bounded by ``timeout_s``, a busy MASTER_PORT named at once with the fix."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cli_runs import ROOT

LISTENING = '''
import json, os, socket
import trainkit as tk


def listening():
    """The TCP sockets this process listens on: its socket inodes (/proc/self/fd) in the tables of /proc/self/net."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/self/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-order
                found.append([socket.inet_ntop(family, raw), int(port, 16)])
    return found


if __name__ == "__main__":
    trainer = tk.Trainer(devices=2, accelerator="cpu", strategy="ddp", logger=False, timeout_s=120)
    with open(f"rank{trainer.global_rank}.json", "w") as f:
        json.dump({"listening": listening(), "port": int(os.environ["MASTER_PORT"]),
                   "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}, f)
    trainer.strategy.barrier()
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


@pytest.mark.slow
def test_a_one_machine_run_listens_on_loopback_only(tmp_path):
    """Both ranks of ``devices=2`` list every socket they listen on: all on 127.0.0.1, the store at MASTER_PORT among
    them (torch's own store listens on every interface, ``*:port``). gloo listens where its interface variable says;
    on a machine whose host name resolves to a network address it would listen there without it."""
    script = tmp_path / "listening.py"
    script.write_text(LISTENING)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [address for address, port in ranks[0]["listening"] if port == ranks[0]["port"]] == ["127.0.0.1"]
    for rank in ranks:
        assert rank["listening"] and all(ipaddress.ip_address(a).is_loopback for a, _ in rank["listening"]), rank
        flags = int(Path(f"/sys/class/net/{rank['gloo']}/flags").read_text(), 16)
        assert flags & 0x8 and rank["nccl"] == f"={rank['gloo']}"  # IFF_LOOPBACK


@pytest.mark.slow
def test_a_busy_master_port_is_named_at_once_and_no_rank_waits_past_timeout_s(tmp_path):
    """MASTER_PORT held by a program that accepts connections and never answers: rank 0 says at once that the port is
    taken and how to free it; rank 1, whose connection that program accepted, gives up after ``timeout_s`` (it
    waited for as long as the program held the port)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    procs, elapsed = {}, {}
    start = time.monotonic()
    try:
        for rank in (0, 1):
            env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                 "--trainer.timeout_s", "5", "--trainer.logger", "false", "--data", "trainkit.demo.markov.MarkovData"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        outputs = {}
        for rank, proc in procs.items():
            outputs[rank] = proc.communicate(timeout=120)[1]
            elapsed[rank] = time.monotonic() - start
    finally:
        for proc in procs.values():
            proc.kill()
        held.close()
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    assert f"another program listens on port {port} (MASTER_PORT). Unset MASTER_PORT" in outputs[0], outputs[0][-2000:]
    assert "rank 0's store did not answer" in outputs[1] and "within timeout_s=5" in outputs[1], outputs[1][-2000:]
    assert "Traceback" not in outputs[0] + outputs[1]
    assert elapsed[1] < 60, elapsed  # a hang guard: starting Python and torch takes 5-20 s here, the wait itself 5 s


def test_loopback_means_this_machine_only():
    from trainkit_strategies.communication.environment import loopback

    assert loopback("127.0.0.1") and loopback("localhost") and loopback("127.0.0.2")
    assert not loopback("192.0.2.1") and not loopback("10.0.0.1") and not loopback("::ffff:8.8.8.8")


def test_an_interface_the_user_named_is_kept(monkeypatch):
    from trainkit_strategies import Environment
    from trainkit_strategies.communication.environment import collectives_on_loopback

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    collectives_on_loopback(Environment(master_addr="127.0.0.1"))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7" and os.environ["NCCL_SOCKET_IFNAME"].startswith("=")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    collectives_on_loopback(Environment(master_addr="192.0.2.1"))  # a multi-node run binds where it did
    assert "NCCL_SOCKET_IFNAME" not in os.environ
