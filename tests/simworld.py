"""Ranks as threads of one process, with the ``meta`` device standing in for a GPU: NCCL's rules, checked on a CPU.

gloo forgives what NCCL does not. ``SimWorld`` replaces the ``torch.distributed`` that
``trainkit_strategies.communication.comm`` (the only module that calls collectives) uses by one that enforces NCCL's
rules while W threads, one per rank, run a strategy:

- every tensor handed to a collective or a point-to-point operation of an accelerator group lives on the rank's
  device (``meta``); control-plane groups (created with ``backend="gloo"``) take CPU tensors;
- every rank of a group issues the same collectives, with the same shapes, in the same order;
- the two ends of an accelerator communicator issue their point-to-point operations in the same order: NCCL
  matches them by order, and a send above its eager threshold blocks until the matching receive is issued, so
  two ranks that each send first on one communicator wait on each other;
- no collective on one accelerator communicator is outstanding while a point-to-point operation with one of its
  members is outstanding on another (kernels of two communicators waiting on each other).

Compute follows CUDA's device rules through ``DeviceRules``: an operation mixing device tensors with host tensors
(other than 0-dim host scalars, which CUDA kernels take as numbers) fails; a host read of a device value
(``.item()``, ``float()``, ``bool()``, a copy to the CPU) is counted and answered with a placeholder, since meta
tensors hold no values. Host tensors hold real values, meta tensors only shapes: numbers are meaningless here
(parity is the parity suite's business); this checks where tensors live and what crosses ranks in which order.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from trainkit_strategies.communication import comm as comm_module

META = torch.device("meta")
CPU = torch.device("cpu")
aten = torch.ops.aten
_EXECUTOR_USERS = ("trainkit_strategies.data_parallel.gradients", "trainkit_strategies.data_parallel.offload")
for _name in _EXECUTOR_USERS:
    importlib.import_module(_name)


class RuleViolation(AssertionError):
    """What NCCL would reject, deadlock on, or what would fail on a GPU."""


# -- compute on the stand-in device ----------------------------------------------------------------------------
_TRANSFERS = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default,
              aten.lift_fresh.default, aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default}


def _placeholder(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return True
    return 1.0 if dtype.is_floating_point else 1


def _caller() -> str:
    """The innermost trainkit (or test) frame that led here: where a host read came from."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if ("trainkit" in frame.filename or "tests" in frame.filename) and "simworld" not in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class DeviceRules(TorchDispatchMode):
    """CUDA's device rules on ``device`` (meta) beside the CPU host; host reads of device values are recorded in
    ``host_reads`` (what forced it, from where) and answered with a placeholder."""

    def __init__(self, device: torch.device = META, host_reads: list[tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.device = device
        self.host_reads: list[tuple[str, str]] = host_reads if host_reads is not None else []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].device == self.device:
            self.host_reads.append(("item", _caller()))
            return _placeholder(args[0].dtype)
        if func is aten._to_copy.default and args[0].device == self.device and kwargs.get("device") == CPU:
            self.host_reads.append(("copy to host", _caller()))
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=CPU)
        if func is aten.copy_.default and args[0].device == CPU and args[1].device == self.device:
            self.host_reads.append(("copy to host", _caller()))
            return args[0]
        if func not in _TRANSFERS:
            self._check_mixing(func, args, kwargs)
        return func(*args, **kwargs)

    def _check_mixing(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A CUDA kernel takes host tensors only as 0-dim inputs (numbers); it never reads a host tensor of data nor
        writes one."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(t.device == self.device for t in tensors):
            return
        written: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if t.device.type == "cpu" and (t.dim() > 0 or any(t is w for w in written))]
        if host:
            raise RuleViolation(f"{func} mixes tensors on the device ({self.device}) with a host tensor of shape "
                                f"{tuple(host[0].shape)}: on a GPU this fails (called from {_caller()})")


def on_device(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its parameters and buffers replaced by meta tensors of the same shapes (ties kept), as if
    the user had built it on the GPU; anything else it holds (a torchmetrics metric's states) stays on the host.

    A strategy moving host parameters to the device re-points them (``p.data = ...``), which torch allows from
    the CPU to CUDA but not to meta, so the simulation starts from parameters already on the device."""
    swapped: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in swapped:
            empty = torch.empty_like(t, device=META)
            swapped[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
        return swapped[id(t)]

    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is not None:
                    store[key] = meta(t)
    return module


# -- the simulated process groups ------------------------------------------------------------------------------
@dataclass(eq=False)
class Group:
    index: int
    ranks: list[int]
    backend: str  # "nccl" (accelerator) or "gloo" (control plane)
    device: torch.device  # what its tensors live on


@dataclass
class _Op:
    """One point-to-point operation as a rank issued it."""

    group: Group
    kind: str  # "send" or "recv"
    peer: int  # global rank
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str
    done: bool = False
    batch: int | None = None  # posted by one batch_isend_irecv (one NCCL group: its operations progress together)


@dataclass(eq=False)
class _Collective:
    name: str
    signature: tuple
    key: tuple  # (group, sequence number)
    entries: dict[int, Any] = field(default_factory=dict)
    result: Any = None
    ready: threading.Event = field(default_factory=threading.Event)


class _Work:
    def __init__(self, wait: Callable[[], None] | None = None, on_done: Callable[[], None] | None = None) -> None:
        self._wait, self._on_done, self._done = wait, on_done, wait is None

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            assert self._wait is not None
            self._wait()
            self._done = True
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        return True

    def is_completed(self) -> bool:
        return self._done


@dataclass
class P2POp:
    op: Callable
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0


class SimWorld:
    """``world_size`` ranks run ``fn(rank)`` in threads of this process (``run``), each under ``DeviceRules``, with
    ``trainkit_strategies.communication.comm`` talking to this object instead of ``torch.distributed``. With
    ``device`` the CPU the
    ranks compute with real values and the collectives move them: a whole world in one process, for tests that
    need many small runs (resuming across strategies and world sizes)."""

    ReduceOp = dist.ReduceOp
    DistError = dist.DistError
    P2POp = P2POp

    def __init__(self, world_size: int, timeout_s: float = 60.0, device: torch.device = META,
                 backend: str = "nccl") -> None:
        self.world_size, self.timeout_s, self.device, self.backend = world_size, timeout_s, device, backend
        self.default = Group(0, list(range(world_size)), backend, device)
        self.rules: dict[int, DeviceRules] = {}
        self._lock = threading.Condition()
        self._batch = threading.local()  # .id: the batch_isend_irecv a rank's thread is posting
        self._batch_ids = itertools.count()
        self._local = threading.local()
        self._groups: list[Group] = []  # in creation order (every rank creates every group, in one order)
        self._created: dict[int, int] = defaultdict(int)  # per rank, groups created so far
        self._calls: dict[tuple[int, int], int] = defaultdict(int)  # (rank, group) -> collectives issued
        self._collectives: dict[tuple[int, int], _Collective] = {}
        self._mail: dict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)  # (group, src, dst)
        self._sent: dict[tuple[int, int, int], int] = defaultdict(int)
        self._posted: dict[tuple[int, int, int], int] = defaultdict(int)
        self.p2p: dict[int, list[_Op]] = defaultdict(list)  # per rank, in issue order
        self.outstanding: dict[int, list[tuple[Group, set[int], str]]] = defaultdict(list)  # rank -> ops in flight
        self._aborted = threading.Event()

    # -- running ---------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._local.rank

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimWorld]:
        """``trainkit_strategies.communication.comm`` uses this world while inside, and worker threads a strategy
        starts (the offloaded step's) compute under their rank's device rules."""
        world = self

        class RankExecutor(ThreadPoolExecutor):
            """Runs each task under the submitting rank's rules (a mode of its own: modes are per thread, and one
            left active in a worker would outlive the interpreter at exit)."""

            def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
                rules = world.rules[world.rank]

                def task() -> Any:
                    stand_in = rules.device == META
                    with DeviceRules(rules.device, rules.host_reads) if stand_in else contextlib.nullcontext():
                        return fn(*args, **kwargs)

                return super().submit(task)

            def map(self, fn: Callable, *iterables: Any, **kwargs: Any) -> Any:
                return [f.result() for f in [self.submit(fn, *args) for args in zip(*iterables, strict=True)]]

        saved = comm_module.dist, comm_module._reduce_scatter, comm_module._all_gather
        comm_module.dist, comm_module._reduce_scatter, comm_module._all_gather = (
            self, self.reduce_scatter_tensor, self.all_gather_into_tensor)
        executors = {name: sys.modules[name].ThreadPoolExecutor for name in _EXECUTOR_USERS}
        for name in _EXECUTOR_USERS:
            sys.modules[name].ThreadPoolExecutor = RankExecutor
        try:
            yield self
        finally:
            comm_module.dist, comm_module._reduce_scatter, comm_module._all_gather = saved
            for name, executor in executors.items():
                sys.modules[name].ThreadPoolExecutor = executor

    def comm(self, rank: int) -> comm_module.Comm:
        """The world communicator of ``rank`` (call from its thread)."""
        return comm_module.Comm(self.world_size, rank, None, timeout_s=self.timeout_s, device=self.device)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank at once; returns their results, or raises the first rank's error (a rank that
        waits longer than ``timeout_s`` for its peers is reported as a deadlock)."""
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            self._local.rank = rank
            rules = self.rules.setdefault(rank, DeviceRules(self.device))
            try:
                with rules if self.device == META else contextlib.nullcontext():  # on the CPU: real values
                    results[rank] = fn(rank)
            except BaseException as err:  # reported below, with its rank
                errors[rank] = err
                self._abort()
            finally:
                self._finished(rank)

        with self.installed():
            threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank{r}", daemon=True)
                       for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.timeout_s + 5)
            if any(t.is_alive() for t in threads):
                self._abort()
                raise RuleViolation(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} are still waiting "
                                    f"after {self.timeout_s} s: a deadlock")
        if errors:
            first = min(errors, key=lambda r: isinstance(errors[r], _Aborted))
            raise errors[first]
        return results

    def _finished(self, rank: int) -> None:
        """``rank``'s function returned or raised."""

    def _abort(self) -> None:
        self._aborted.set()
        with self._lock:
            self._lock.notify_all()

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        with self._lock:
            while not ready():
                if self._aborted.is_set():
                    raise _Aborted(f"rank {self.rank} gave up waiting for {what}: another rank failed")
                if not self._lock.wait(timeout=self.timeout_s):
                    raise RuleViolation(f"rank {self.rank} waited {self.timeout_s} s for {what}: a deadlock")

    # -- what comm.py calls ----------------------------------------------------------------------------------
    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group: Any = None) -> int:
        return len((group or self.default).ranks)

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def get_backend(self, group: Any = None) -> str:
        return (group or self.default).backend

    def destroy_process_group(self, group: Any = None) -> None:
        pass

    def new_group(self, ranks: list[int], timeout: Any = None, backend: str | None = None) -> Group:
        with self._lock:
            index = self._created[self.rank]
            self._created[self.rank] += 1
            kind = backend or self.backend
            if index == len(self._groups):
                self._groups.append(Group(index + 1, list(ranks), kind, self.device if kind == self.backend else CPU))
            group = self._groups[index]
            if group.ranks != list(ranks) or group.backend != kind:
                raise RuleViolation(f"rank {self.rank} created its group #{index} over {list(ranks)} ({backend}), but "
                                    f"another rank created it over {group.ranks} ({group.backend}): every rank must "
                                    "create every group in the same order")
            return group

    def _check_device(self, group: Group, name: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != group.device:
                raise RuleViolation(f"{name} on a {group.backend} group was handed a tensor on {t.device}; it takes "
                                    f"only tensors on {group.device} (called from {_caller()})")

    def _check_crossing(self, group: Group, peers: set[int], collective: bool, name: str) -> None:
        """No collective on an accelerator communicator while an operation with one of its ranks is in flight on
        another accelerator communicator, nor the other way round."""
        if group.backend != "nccl":
            return
        for other, other_peers, other_name in self.outstanding[self.rank]:
            collectives = collective or other_name not in ("send", "recv")
            if other is not group and other.backend == "nccl" and collectives and peers & other_peers:
                raise RuleViolation(
                    f"rank {self.rank} issued {name} on a communicator of ranks {group.ranks} while {other_name} with "
                    f"rank(s) {sorted(peers & other_peers)} is in flight on another communicator ({other.ranks}): on "
                    f"NCCL kernels of two communicators can wait on each other (called from {_caller()})")

    def _track(self, group: Group, peers: set[int], name: str) -> Callable[[], None]:
        entry = (group, peers, name)
        self.outstanding[self.rank].append(entry)
        rank = self.rank
        return lambda: self.outstanding[rank].remove(entry) if entry in self.outstanding[rank] else None

    def _collective(self, name: str, group: Any, tensors: tuple[torch.Tensor, ...], signature: tuple, payload: Any,
                    compute: Callable[[dict[int, Any]], Any], apply: Callable[[Any], None], async_op: bool) -> Any:
        group = group or self.default
        if self.rank not in group.ranks:
            raise RuleViolation(f"rank {self.rank} issued {name} on a group it is not in ({group.ranks})")
        self._check_device(group, name, *tensors)
        peers = set(group.ranks) - {self.rank}
        self._check_crossing(group, peers, True, name)
        with self._lock:
            key = (self.rank, group.index)
            seq = self._calls[key]
            self._calls[key] += 1
            slot = self._collectives.setdefault((group.index, seq), _Collective(name, signature, (group.index, seq)))
            if (slot.name, slot.signature) != (name, signature):
                raise RuleViolation(f"collective #{seq} of group {group.ranks}: rank {self.rank} issued {name} "
                                    f"{signature}, another rank {slot.name} {slot.signature}")
            slot.entries[self.rank] = payload
            if len(slot.entries) == len(group.ranks):
                with _disable_current_modes():  # the last rank to arrive computes for all: as one opaque c10d op,
                    slot.result = compute(slot.entries)  # unseen by its dispatch modes (selective checkpointing's)
                self._deliver(slot, group, tensors)
                self._lock.notify_all()
        done = self._track(group, peers, name)

        def wait() -> None:
            self._wait_for(slot.ready.is_set, f"{name} on group {group.ranks}")
            apply(slot.result)

        work = _Work(wait, done)
        if async_op:
            return work
        work.wait()
        return None

    def _deliver(self, slot: _Collective, group: Group, tensors: tuple[torch.Tensor, ...]) -> None:
        """Every rank has issued the collective of ``slot`` (on ``group``, the last one with ``tensors``): its result
        is there at once (called with the world's lock held)."""
        slot.ready.set()

    @staticmethod
    def _clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def _index(self, group: Any) -> int:
        return (group or self.default).ranks.index(self.rank)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
        def compute(entries: dict[int, Any]) -> torch.Tensor:
            stacked = torch.stack([entries[r] for r in sorted(entries)])
            if op == dist.ReduceOp.MAX:
                return stacked.amax(0)
            if op == dist.ReduceOp.MIN:
                return stacked.amin(0)
            total = stacked.sum(0)
            return total / len(entries) if op == dist.ReduceOp.AVG else total

        return self._collective("all_reduce", group, (tensor,), (tuple(tensor.shape), tensor.dtype, str(op)),
                                self._clone(tensor), compute, lambda r: tensor.copy_(r), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        return self._collective("broadcast", group, (tensor,), (tuple(tensor.shape), tensor.dtype, src),
                                self._clone(tensor), lambda e: e[src], lambda r: tensor.copy_(r), async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                              group: Any = None, async_op: bool = False) -> Any:
        index = self._index(group)
        return self._collective(
            "reduce_scatter", group, (output, input), (tuple(input.shape), input.dtype), self._clone(input),
            lambda e: torch.stack([e[r] for r in sorted(e)]).sum(0),
            lambda r: output.copy_(r.view(-1, output.numel())[index].view_as(output)), async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Any = None,
                               async_op: bool = False) -> Any:
        order = (group or self.default).ranks
        return self._collective(
            "all_gather", group, (output, input), (tuple(input.shape), input.dtype), self._clone(input),
            lambda e: torch.cat([e[r].reshape(-1) for r in order]), lambda r: output.view(-1).copy_(r), async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list | None = None,
                          input_split_sizes: list | None = None, group: Any = None, async_op: bool = False) -> Any:
        """Even or uneven (``*_split_sizes`` along dimension 0): what rank i sends to rank j must be what j expects
        from i (NCCL hangs or corrupts otherwise)."""
        order, index = (group or self.default).ranks, self._index(group)
        n = len(order)

        def splits(t: torch.Tensor, sizes: list | None) -> list[int]:
            return list(sizes) if sizes is not None else [t.shape[0] // n] * n

        def compute(e: dict[int, Any]) -> dict[int, Any]:
            for i, r in enumerate(order):
                for j, q in enumerate(order):
                    if e[r][1][j] != e[q][2][i]:
                        raise RuleViolation(f"all_to_all on group {order}: rank {r} sends {e[r][1][j]} rows to rank "
                                            f"{q}, which expects {e[q][2][i]}")
            return e

        def apply(e: dict[int, Any]) -> None:
            for chunk, r in zip(output.split(splits(output, output_split_sizes)), order, strict=True):
                chunk.copy_(e[r][0].split(e[r][1])[index])

        payload = (self._clone(input), splits(input, input_split_sizes), splits(output, output_split_sizes))
        return self._collective("all_to_all", group, (output, input), (tuple(input.shape[1:]), input.dtype), payload,
                                compute, apply, async_op)

    def barrier(self, group: Any = None, async_op: bool = False) -> Any:
        return self._collective("barrier", group, (), (), None, lambda e: None, lambda r: None, async_op)

    def all_gather_object(self, out: list, obj: Any, group: Any = None) -> None:
        order = (group or self.default).ranks
        self._collective("all_gather_object", group, (), (), obj, lambda e: [e[r] for r in order],
                         lambda r: out.__setitem__(slice(None), list(r)), False)

    def broadcast_object_list(self, box: list, src: int, group: Any = None) -> None:
        self._collective("broadcast_object", group, (), (src,), list(box), lambda e: e[src],
                         lambda r: box.__setitem__(slice(None), list(r)), False)

    # -- point to point ----------------------------------------------------------------------------------------
    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> _Work:
        group = group or self.default
        self._check_device(group, kind, tensor)
        self._check_crossing(group, {peer}, False, kind)
        batch = getattr(self._batch, "id", None)
        op = _Op(group, kind, peer, tuple(tensor.shape), tensor.dtype, _caller(), batch=batch)
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        box = (group.index, src, dst, tag if group.backend == "gloo" else 0)  # NCCL matches by order, gloo by tag
        with self._lock:
            self.p2p[self.rank].append(op)
            if kind == "send":
                self._mail[box].append(self._clone(tensor))
                self._sent[box] += 1
                self._lock.notify_all()
                number = -1
            else:
                number = self._posted[box]
                self._posted[box] += 1
        done = self._track(group, {peer}, kind)

        def received() -> None:
            self._wait_for(lambda: self._sent[box] > number, f"message {number} from rank {peer}")
            message = self._mail[box][number]
            if (tuple(message.shape), message.dtype) != (tuple(tensor.shape), tensor.dtype):
                raise RuleViolation(f"rank {self.rank}'s receive #{number} from rank {peer} ({tuple(tensor.shape)}, "
                                    f"{tensor.dtype}) was matched, in issue order, by a send of "
                                    f"{tuple(message.shape)}, {message.dtype}")
            tensor.copy_(message)

        return _Work(None if kind == "send" else received, lambda: (setattr(op, "done", True), done()))

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> _Work:
        return self._p2p("send", tensor, dst, group, tag)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> _Work:
        return self._p2p("recv", tensor, src, group, tag)

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[_Work]:
        self._batch.id = next(self._batch_ids)
        try:
            return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        finally:
            self._batch.id = None

    # -- checks after a run ----------------------------------------------------------------------------------
    def p2p_order_problems(self) -> list[str]:
        """Accelerator communicators whose two ends issued their point-to-point operations in different orders."""
        problems = []
        pairs: dict[tuple[int, int, int], list[_Op]] = defaultdict(list)
        for rank, ops in self.p2p.items():
            for op in ops:
                if op.group.backend == "nccl":
                    pairs[(op.group.index, rank, op.peer)].append(op)
        for (_, rank, peer), ops in pairs.items():
            # one batch_isend_irecv is one NCCL group: within it, the sends to a peer and the receives from it are
            # matched per direction, in order, whichever is posted first (a ring hop posts a send and a receive on
            # both ends). Put them in one canonical order: the lower rank's sends first, the higher rank's receives.
            first = "send" if rank < peer else "recv"
            starts: dict[int, int] = {}
            keys = []
            for i, op in enumerate(ops):
                if op.batch is None:
                    keys.append((i, 0))
                else:
                    keys.append((starts.setdefault(op.batch, i), int(op.kind != first)))
            ops[:] = [op for _, op in sorted(zip(keys, ops, strict=True), key=lambda pair: pair[0])]
        for (group, a, b), ops_a in pairs.items():
            if a > b:
                continue
            ops_b = pairs.get((group, b, a), [])
            for i, (x, y) in enumerate(zip(ops_a, ops_b, strict=False)):
                if x.kind == y.kind or (x.shape, x.dtype) != (y.shape, y.dtype):
                    problems.append(f"communicator {x.group.ranks}: operation #{i} is a {x.kind} of {x.shape} on rank "
                                    f"{a} ({x.where}) but a {y.kind} of {y.shape} on rank {b} ({y.where})")
                    break
            else:
                if len(ops_a) != len(ops_b):
                    problems.append(f"communicator {ops_a[0].group.ranks}: rank {a} issued {len(ops_a)} operations "
                                    f"with rank {b}, which issued {len(ops_b)}")
        return problems

    def host_reads(self, rank: int) -> list[tuple[str, str]]:
        return self.rules[rank].host_reads if rank in self.rules else []


class _Aborted(RuntimeError):
    """A rank stopped because another one failed first (the first failure is reported)."""
