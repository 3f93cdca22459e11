"""The collectives at 3 ranks (chunks that do not split evenly by 2): on gloo the ring reduce-scatter, all-gather and
all-to-all give exactly torch's results with chunks larger than one message (several messages per round, sizes that
do not divide evenly); all-to-all moves every chunk to its rank, with uneven splits too (empty ones among them); and
1-bit averaging with error feedback on both sides converges on the exact mean over repeated exchanges, where
dropping the feedback leaves a bias."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.parity.harness import free_port, start_method
from trainkit_strategies import Environment
from trainkit_strategies.communication.comm import MESSAGE_BYTES, Comm
from trainkit_strategies.data_parallel.onebit import SignReduceScatter, compressed_all_reduce

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

WORLD = 3
N = 8 * WORLD * 40  # elements; a multiple of 8 bits per rank


def _inputs(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(N, generator=generator) * torch.linspace(0.05, 2.0, N)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    comm = Comm.connect(Environment.from_env("cpu", timeout_s=60))
    results: dict[str, object] = {}

    sent = torch.tensor([[rank * 10 + j] * 4 for j in range(WORLD)], dtype=torch.int64)
    received = torch.empty_like(sent)
    comm.all_to_all(received.view(-1), sent.view(-1))
    results["all_to_all"] = received[:, 0].tolist()

    # rings whose rounds travel as several messages: a chunk of 2.3 messages' worth, not a multiple of anything
    chunk = MESSAGE_BYTES // 4 * 2 + MESSAGE_BYTES // 12 + 7
    assert comm.ring
    big = [torch.arange(WORLD * chunk, dtype=torch.float64) * (r + 1) % 1000 for r in range(WORLD)]  # every rank's
    mine_of = lambda t: t.view(WORLD, chunk)[rank]
    piece = torch.empty(chunk, dtype=torch.float64)
    comm.reduce_scatter(piece, big[rank].clone())
    results["ring_reduce_scatter"] = bool(torch.equal(piece, mine_of(sum(big))))
    gathered = torch.empty(WORLD * chunk, dtype=torch.float64)
    comm.all_gather(gathered, mine_of(big[rank]).clone())
    results["ring_all_gather"] = bool(torch.equal(gathered, torch.cat([b.view(WORLD, chunk)[i]
                                                                       for i, b in enumerate(big)])))
    swapped = torch.empty(WORLD * chunk, dtype=torch.float64)
    comm.all_to_all(swapped, big[rank])
    results["ring_all_to_all"] = bool(torch.equal(swapped, torch.cat([b.view(WORLD, chunk)[rank] for b in big])))

    # uneven: rank r sends rows(r, j) rows to rank j (none at times), a block of several messages among them
    rows = lambda r, j: (r + 2 * j) % 4 * (1 if (r, j) != (1, 2) else MESSAGE_BYTES // 8 * 3 + 5)
    block = lambda r, j: torch.arange(rows(r, j) * 5, dtype=torch.float64).view(-1, 5) + 1000 * r + 100 * j
    sent = torch.cat([block(rank, j) for j in range(WORLD)])
    received = torch.full((sum(rows(i, rank) for i in range(WORLD)), 5), -1.0, dtype=torch.float64)
    before = comm.stats.bytes["all_to_all"]
    comm.all_to_all(received, sent, output_splits=[rows(i, rank) for i in range(WORLD)],
                    input_splits=[rows(rank, j) for j in range(WORLD)])
    results["uneven_all_to_all"] = bool(torch.equal(received, torch.cat([block(i, rank) for i in range(WORLD)])))
    results["uneven_bytes"] = [comm.stats.bytes["all_to_all"] - before, sent.numel() * 8]

    x = _inputs(rank)
    exact = sum(_inputs(r) for r in range(WORLD)) / WORLD
    for feedback in (True, False):
        worker, server, arrived = torch.zeros(N), torch.zeros(N // WORLD), torch.zeros(N)
        for _ in range(200):
            y = x.clone()
            compressed_all_reduce(y, worker, server, comm, feedback)
            arrived += y
        results[f"all_reduce_feedback_{feedback}"] = _relative(arrived / 200, exact)
        results[f"all_reduce_same_{feedback}"] = bool(torch.equal(torch.stack(comm.all_gather_object(y)).std(0),
                                                                  torch.zeros(N)))

        codec, piece = SignReduceScatter(feedback), torch.empty(N // WORLD)
        summed = torch.zeros(N // WORLD)
        for _ in range(200):
            handle, finish = codec.start(comm, piece, x, key=0)
            handle.wait()
            finish()
            summed += piece
        mine = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
        results[f"reduce_scatter_feedback_{feedback}"] = _relative(summed / 200, exact[mine] * WORLD)

    everyone = comm.all_gather_object(results)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    comm.barrier()
    sys.stdout.flush()
    os._exit(0)


def test_compressed_collectives_at_three_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "results.json"))
        mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD, start_method=start_method())
        everyone = json.loads(Path(out).read_text())
    for rank, results in enumerate(everyone):
        assert results["all_to_all"] == [source * 10 + rank for source in range(WORLD)]
        assert results["ring_reduce_scatter"] and results["ring_all_gather"] and results["ring_all_to_all"], results
        assert results["uneven_all_to_all"], results  # every block where it belongs, the empty ones too
        assert results["uneven_bytes"][0] == results["uneven_bytes"][1]  # counted: the whole input
        assert results["all_reduce_same_True"] and results["all_reduce_same_False"]  # every rank ends alike
        assert results["all_reduce_feedback_True"] < 0.03, results
        assert results["all_reduce_feedback_False"] > 0.2, results
        assert results["reduce_scatter_feedback_True"] < 0.03, results
        assert results["reduce_scatter_feedback_False"] > 0.2, results
