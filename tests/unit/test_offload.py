"""ZeRO-Offload's host side: the one-pass host step equals torch's fused Adam, an offloaded step calls the host per
bucket (not per parameter or per chunk), a bucket steps while backward is still running and lands on the same bits
as after it, ``zero_grad`` leaves host memory alone, and the delayed parameter update applies each step one step
late."""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.data_parallel.gradients import OffloadedGradients
from trainkit_strategies.offload import host_adam as host_adam_module
from trainkit_strategies.offload import native
from trainkit_strategies.offload.host_adam import HostAdam
from trainkit_strategies.state import master as master_module


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The compiled kernel, and torch's kernels as where no compiler exists."""
    if request.param == "torch":
        monkeypatch.setattr(host_adam_module, "_kernel", lambda: None)
    elif native.compiler() is None:
        pytest.skip("no C compiler on this machine: the kernel cannot be built (the torch path runs instead)")
    else:
        assert host_adam_module.uses_kernel(), native.why_not("host_adam")
    return request.param


def _host_adam(cls, n: int, **options: Any) -> tuple[HostAdam, torch.Tensor, torch.optim.Optimizer]:
    master = torch.randn(n)
    pieces = [master[: n // 3], master[n // 3 :]]  # two pieces of one flat, stepped as one run
    opt = cls(pieces, **options)
    return HostAdam(opt, [(master, 0, [(pieces[0], 0), (pieces[1], n // 3)])]), master, opt


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"maximize": True}], ids=["plain", "amsgrad", "maximize"])
@pytest.mark.parametrize(("grad_dtype", "out_dtype"), [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                                       (torch.float16, torch.float16), (torch.float32, torch.float32),
                                                       (torch.bfloat16, "in place")])
def test_host_adam_equals_torch_fused_adam(path, cls, options, grad_dtype, out_dtype):
    torch.manual_seed(0)
    n = 10_007  # no multiple of a vector or of a thread's tile
    adam, master, opt = _host_adam(cls, n, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, **options)
    ref = master.clone()
    torch_opt = cls([ref], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, fused=True, **options)
    for step in range(4):
        grad = torch.randn(n).to(grad_dtype)
        ref.grad = grad.float() * 0.25
        torch_opt.step()
        out = grad if out_dtype == "in place" else torch.empty(n, dtype=out_dtype) if out_dtype else None
        adam.begin(0.25, threads=2)
        cut = lambda t: [t[: n // 3], t[n // 3 :]]
        adam.step(opt.param_groups[0]["params"], cut(grad), cut(out) if out is not None else None)
        # torch divides by the loss scale where this multiplies, and may fuse multiply-adds differently
        torch.testing.assert_close(master, ref, rtol=0, atol=2e-6, msg=lambda m, s=step: f"step {s}: {m}")
        if out is not None:
            assert torch.equal(out, master.to(out.dtype))  # the compute-dtype copy is the updated master's
    for piece in opt.param_groups[0]["params"]:
        state, want = opt.state[piece], torch_opt.state[ref]
        assert state.keys() == want.keys() and float(state["step"]) == 4.0
        for key in state.keys() - {"step"}:  # the state torch keeps, as views of the run's moments
            lo = piece.data_ptr() - master.data_ptr() >> 2
            torch.testing.assert_close(state[key], want[key][lo : lo + piece.numel()], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_path_of_the_kernel_gives_the_same_bits(grad_dtype, threads):
    """However a run is cut into calls, tiles and code paths (the streaming path for an aligned separate bf16 output,
    the general loop otherwise, in any alignment), each element's update is the same expression: the same bits.
    With 2 threads the kernel splits a call of at least 2 x 4096 elements into a tile per thread, so the large pieces
    here (12,291, 11,284 and 10,243 elements) are split and the tiles' seams are among the elements compared."""
    if not host_adam_module.uses_kernel():
        pytest.skip(f"the kernel is not built here: {native.why_not('host_adam')}")
    torch.manual_seed(0)
    n = 3 * 4096 + 3
    start = torch.randn(n)
    grads = [torch.randn(n).to(grad_dtype) for _ in range(3)]
    results = []
    for shift, cuts in ((0, [n]), (1, [n]), (0, [7, 1000, n - 1007]), (3, [2048, n - 2048])):
        master = start.clone()
        pieces = list(master.split(cuts))
        opt = torch.optim.AdamW(pieces, lr=1e-2, weight_decay=0.1)
        offsets = [sum(cuts[:i]) for i in range(len(cuts))]
        adam = HostAdam(opt, [(master, 0, list(zip(pieces, offsets, strict=True)))])
        out = torch.empty(n + shift, dtype=torch.bfloat16)[shift:]  # shifted by 2 bytes: no longer 32-byte aligned
        for grad in grads:
            adam.begin(0.5, threads)
            for piece, offset, size in zip(pieces, offsets, cuts, strict=True):  # one call per piece
                adam.step([piece], [grad[offset : offset + size]], [out[offset : offset + size]])
        results.append((master, opt.state[pieces[0]]["exp_avg"], out))
    for master, _, out in results[1:]:
        assert torch.equal(master, results[0][0]) and torch.equal(out, results[0][2])
    assert torch.equal(results[0][2], results[0][0].bfloat16())


def test_conversions_round_to_nearest_even_as_torch_does():
    """The kernel's compute-dtype copies equal torch's conversions of the same fp32 values, subnormals, rounding
    ties, overflow and infinities included; fp16 gradients are read exactly (every finite half, each once)."""
    torch.manual_seed(0)
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[torch.isfinite(halves)]
    special = torch.tensor([0.0, -0.0, 1e-45, 6e-8, 5.96e-8, 2.98e-8, 65504.0, 65519.0, 65520.0, 1e38, 3.4e38,
                            float("inf"), float("-inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11])
    values = torch.cat([special, -special, torch.randn(4096) * 10.0 ** torch.randint(-40, 38, (4096,)),
                        torch.randint(0, 2**32, (4096,), dtype=torch.int64).to(torch.int32).view(torch.float32)])
    values = values[torch.isfinite(values) | torch.isinf(values)]
    n = max(values.numel(), halves.numel())
    master = torch.zeros(n)
    master[: values.numel()] = values
    opt = torch.optim.Adam([master], lr=0.0, betas=(0.0, 0.0), eps=1.0)  # the weights stay as they are; m = g
    adam = HostAdam(opt, [(master, 0, [(master, 0)])])
    grad = torch.zeros(n, dtype=torch.float16)
    grad[: halves.numel()] = halves
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(n, dtype=dtype)
        adam.begin(1.0, threads=2)
        adam.step(opt.param_groups[0]["params"], [grad], [out])
        assert torch.equal(master[: values.numel()], values)
        assert torch.equal(out.view(torch.int16), master.to(dtype).view(torch.int16)), dtype
    assert torch.equal(opt.state[master]["exp_avg"][: halves.numel()], halves.float())


def _offloaded(model: nn.Module, precision: str = "bf16-mixed", lr: float = 1e-2, **options: Any):
    strategy = get_strategy("zero_offload", **{"bucket_mb": 0.02, **options})
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1),
                   Precision.from_name(precision))
    return strategy


def _train_step(strategy, model: nn.Module, x: torch.Tensor, in_backward: bool = False) -> None:
    with strategy.forward_context():
        loss = model(x).float().pow(2).mean()
    if in_backward:
        assert strategy.step_in_backward(0.5)
    strategy.backward(loss)
    strategy.reduce_gradients(0.5)
    strategy.optimizer_step()
    strategy.zero_grad()


def test_zero_offload_runs_the_offloaded_layout_and_the_host_step():
    strategy = _offloaded(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    assert isinstance(strategy.grads, OffloadedGradients)
    assert isinstance(strategy._master.adam, HostAdam)
    assert all(g.device.type == "cpu" for g in strategy.grads.buffers)
    # on a CPU device backward computes on the host's cores: by default the host step waits for it
    assert not strategy.step_in_backward(1.0)


def _events(prof: torch.profiler.profile) -> list[str]:
    """Host calls: every operator or labelled call the profiler saw at the top level of some thread."""
    return [e.name for e in prof.events() if e.cpu_parent is None and not e.name.startswith("ProfilerStep")]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("min_run", [master_module.MIN_RUN, 0], ids=["runs", "a-run-per-bucket"])
def test_an_offloaded_step_makes_at_most_two_host_calls_per_bucket(monkeypatch, precision, min_run):
    """48 parameter tensors in several buckets: reducing, stepping and zeroing issue at most two host calls per
    bucket (the profiler's count of operators and labelled calls, views included), none of them a fill of host
    memory, whether small buckets step together or each on its own."""
    monkeypatch.setattr(master_module, "MIN_RUN", min_run)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])
    strategy = _offloaded(model, precision, bucket_mb=0.01)
    params, buckets = sum(1 for _ in model.parameters()), len(strategy.buckets)
    assert params == 48 and 6 <= buckets <= 24
    x = torch.randn(4, 32)
    _train_step(strategy, model, x)  # the first step creates the optimizer state
    with strategy.forward_context():
        loss = model(x).float().pow(2).mean()
    strategy.backward(loss)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        strategy.reduce_gradients(0.5)
        strategy.optimizer_step()
        strategy.zero_grad()
    calls = _events(prof)
    assert len(calls) <= 2 * buckets, calls
    assert calls.count("trainkit::host_adam") == (buckets if min_run == 0 else 1)
    assert not [c for c in calls if "fill" in c or "zero" in c], calls


def test_tiny_buckets_step_as_one_call():
    """Biases and norms in buckets of their own (a param group without weight decay, in many small buckets) step
    in one call, not one each: they lie end to end in host memory."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.LayerNorm(64) for _ in range(16)])
    strategy = get_strategy("zero_offload", bucket_mb=0.0005)
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.AdamW(model.parameters(), weight_decay=0.0), Precision.from_name("32"))
    assert len(strategy.buckets) >= 16
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train_step(strategy, model, torch.randn(4, 64))
    assert _events(prof).count("trainkit::host_adam") == 1


class _Gate(torch.autograd.Function):
    """Identity whose backward holds until ``opened`` is set (or a timeout): backward cannot finish before."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, opened: threading.Event, seen: list[bool]) -> torch.Tensor:
        ctx.opened, ctx.seen = opened, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.seen.append(ctx.opened.wait(timeout=20))
        return grad, None, None


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.rest = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 1))
        self.opened, self.seen = threading.Event(), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(_Gate.apply(torch.tanh(self.first(x)), self.opened, self.seen))


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_a_bucket_steps_on_the_host_before_backward_ends_and_lands_on_the_same_bits(monkeypatch, precision):
    """With the step in backward, the first layers' backward holds until a host step has started: it can finish
    only because buckets of the last layers step while it waits. The parameters come out bit for bit as when every
    bucket steps after backward."""
    monkeypatch.setattr(master_module, "MIN_RUN", 0)  # every bucket of this small model steps as soon as it lands
    xs = [torch.randn(8, 16) for _ in range(3)]
    runs = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = _Gated()
        strategy = _offloaded(model, precision, bucket_mb=0.015, overlap_step=in_backward)
        assert len(strategy.buckets) >= 4
        real_step = strategy._master.adam.step
        started: list[bool] = []

        def step(*args: Any, model: _Gated = model, real_step: Any = real_step, started: list = started) -> None:
            started.append(not model.opened.is_set())  # stepping while the gate still holds backward
            model.opened.set()
            real_step(*args)

        monkeypatch.setattr(strategy._master.adam, "step", step)
        for x in xs:
            model.opened.clear()
            if not in_backward:
                model.opened.set()  # nothing would open it: the host steps after backward
            _train_step(strategy, model, x, in_backward=in_backward)
        assert all(model.seen)  # no gate timed out
        if in_backward:
            assert started[0] and strategy.steps_in_backward == len(xs)
        runs[in_backward] = {k: v.clone() for k, v in strategy.full_parameters().items()}
    for name, value in runs[False].items():
        assert torch.equal(runs[True][name], value), name


def test_zero_grad_writes_no_host_memory():
    """``zero_grad`` leaves the host gradient partition as it is (a sentinel survives it), and it does not matter:
    the next window's first micro-step overwrites every bucket, with accumulation and with a parameter no forward
    uses, so a run that poisons the partition after every ``zero_grad`` ends on the same bits as one that does not."""

    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
            self.unused = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    template = Routed()
    xs = [torch.randn(4, 8) for _ in range(6)]
    runs = []
    for poison in (False, True):
        model = copy.deepcopy(template)
        strategy = _offloaded(model, "32", bucket_mb=0.001)
        for step in range(3):
            for micro in range(2):
                with strategy.no_sync() if micro == 0 else contextlib.nullcontext():
                    with strategy.forward_context():
                        loss = model(xs[2 * step + micro]).pow(2).mean()
                    strategy.backward(loss)
            strategy.reduce_gradients(0.5)
            strategy.optimizer_step()
            if poison:
                for buffer in strategy.grads.buffers:
                    buffer.fill_(12345.0)
            strategy.zero_grad()
            if poison:
                assert all(bool((b == 12345.0).all()) for b in strategy.grads.buffers)
        runs.append(strategy.full_parameters())
    for name, value in runs[0].items():
        assert torch.equal(runs[1][name], value), name


def test_without_a_compiler_the_host_step_says_so_once_and_uses_torchs_kernels(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert native.load("host_adam") is None
    assert native.load("host_adam") is None  # said once
    assert not host_adam_module.uses_kernel()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    strategy = _offloaded(model, "32")
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        x = torch.randn(4, 8)
        _train_step(strategy, model, x)
        opt.zero_grad()
        (reference(x).pow(2).mean() * 0.5).backward()
        opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(strategy.full_parameters()[name], p.detach(), rtol=0, atol=1e-6, msg=name)


def test_the_kernel_is_built_once_per_machine(monkeypatch, tmp_path):
    """Built into the cache directory on first use and loaded from there afterwards, with no compiler run."""
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine: nothing is built (test_without_a_compiler... covers it)")
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("host_adam") is not None, native.why_not("host_adam")
    built = list((tmp_path / "native").glob("host_adam-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_compile", lambda *args: pytest.fail("compiled again"))
    assert native.load("host_adam") is not None


class CopyCount(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") in ("copy_", "to", "_to_copy"):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_an_offloaded_step_copies_nothing_on_the_cpu():
    """Where host memory is the device's, the host step writes the working parameters itself: no conversion, no
    copy of gradients or parameters (the old step converted every chunk of gradient and copied it back)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)])
    strategy = _offloaded(model)
    x = torch.randn(4, 16)
    _train_step(strategy, model, x)
    with strategy.forward_context():
        loss = model(x).float().pow(2).mean()
    strategy.backward(loss)
    counter = CopyCount()
    with counter:
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
    assert counter.copies == 0


@pytest.mark.cuda
def test_host_device_transfers_are_two_per_bucket_without_conversion(monkeypatch):
    """On a GPU: one gradient copy down and one parameter copy up per bucket, each in the compute dtype."""
    calls: list[tuple[torch.dtype, str, str]] = []
    real = master_module.transfer

    def counted(dst, src):
        calls.append((src.dtype, src.device.type, dst.device.type))
        return real(dst, src)

    monkeypatch.setattr(master_module, "transfer", counted)
    monkeypatch.setattr("trainkit_strategies.data_parallel.gradients.transfer", counted)
    torch.manual_seed(0)
    for in_backward in (False, True):
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)]).cuda()
        strategy = get_strategy("zero_offload", bucket_mb=0.02)
        strategy.setup_environment(Environment(device=torch.device("cuda", 0)))
        strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Precision.from_name("bf16-mixed"))
        calls.clear()
        _train_step(strategy, model, torch.randn(4, 16, device="cuda"), in_backward=in_backward)
        buckets = len(strategy.buckets)
        down, up = (torch.bfloat16, "cuda", "cpu"), (torch.bfloat16, "cpu", "cuda")
        assert sorted(calls) == sorted([down] * buckets + [up] * buckets)


def test_delayed_update_applies_each_step_one_step_late():
    """With DPU, step t's forward sees the parameters after step t-2: after k steps the parameters are those a
    synchronous run reaches after k-1 steps fed the same (delayed) gradients, and reading state settles it."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    xs = [torch.randn(4, 8) for _ in range(5)]
    delayed_model = copy.deepcopy(template)
    delayed = _offloaded(delayed_model, precision="32", delayed_update=True)
    seen = []
    for x in xs:
        seen.append(copy.deepcopy(delayed_model.state_dict()))
        _train_step(delayed, delayed_model, x)
    # reference: a hand loop where the gradient of step t is taken at the parameters of step t-2
    ref = copy.deepcopy(template)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    visible = copy.deepcopy(template)
    for t, x in enumerate(xs):
        for k, v in visible.state_dict().items():  # fused vs foreach Adam: rounding apart, a step is ~1e-2 apart
            torch.testing.assert_close(seen[t][k], v, rtol=0, atol=1e-6, msg=lambda m, k=k, t=t: f"step {t} {k}: {m}")
        visible.zero_grad()
        (visible(x).float().pow(2).mean() * 0.5).backward()
        for p, q in zip(ref.parameters(), visible.parameters(), strict=True):
            p.grad = q.grad.clone()
        visible.load_state_dict(ref.state_dict())  # what the device sees next: the update of the step before
        opt.step()
    final = delayed.full_parameters()  # settles the last step
    for name, p in ref.named_parameters():
        torch.testing.assert_close(final[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


def _on_a_gpu_stand_in(world, **options: Any):
    """zero_offload as on a GPU (host memory apart from the device's; ``meta`` stands in for the GPU), 1 rank."""
    from tests.simworld import META, on_device

    strategy = get_strategy("zero_offload", bucket_mb=0.002, **options)
    strategy.setup_environment(Environment(device=META), comm=world.comm(0))
    torch.manual_seed(0)
    model = on_device(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Precision.from_name("bf16-mixed"))
    return strategy, model


def test_offload_accumulation_never_waits_for_the_bus_inside_backward(monkeypatch):
    """An accumulating micro-step copies each bucket to page-locked staging on the side stream and a host thread adds
    it into the partition once it landed: nothing in backward waits for a copy (the old hook synchronised on every
    bucket's copy), and the window's end waits for all of them."""
    from tests.simworld import META, SimWorld
    from trainkit_strategies.offload.hostcopy import CopyStream

    waits: list[tuple[str, bool]] = []
    pending = lambda self: object()  # a pending copy
    monkeypatch.setattr("trainkit_strategies.data_parallel.gradients.CopyStream.mark", pending)
    monkeypatch.setattr(CopyStream, "wait", staticmethod(lambda event: None))  # a wait on the device, not the host
    monkeypatch.setattr(CopyStream, "synchronize", staticmethod(
        lambda event: waits.append((threading.current_thread().name, torch._C._current_graph_task_id() != -1))))
    world = SimWorld(1)

    def run(rank: int) -> None:
        strategy, model = _on_a_gpu_stand_in(world)
        x = torch.randn(4, 32).to(META)
        for micro in range(3):
            with strategy.no_sync() if micro < 2 else contextlib.nullcontext():
                with strategy.forward_context():
                    loss = model(x).float().pow(2).mean()
                strategy.backward(loss)
        inside = [w for w in waits if w[1]]
        assert not inside, f"backward waited for copies: {inside}"
        strategy.reduce_gradients(1.0)  # the window's end: every add and copy has landed
        buckets = len(strategy.buckets)
        assert sum(name.startswith("trainkit-offload-accumulate") for name, _ in waits) == 2 * buckets
        assert len(waits) == 2 * buckets + 2  # and the window's end waited for the last copy of each slot

    world.run(run)


class _GatedStack(nn.Module):
    """Linear layers with a gate after the first: its backward holds until ``opened`` (a host step's upload)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.rest = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
        self.opened, self.seen = threading.Event(), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(_Gate.apply(self.first(x), self.opened, self.seen))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_on_a_gpu_the_step_in_backward_sends_each_bucket_up_from_the_host_thread(monkeypatch, accumulate):
    """As on a GPU (host memory apart; ``meta`` stands in for the device): during the window's last backward the
    host thread waits for each bucket's copy down (or its accumulation add), steps it and sends its parameters up
    from over the gradient they came from, one bulk copy per bucket, while backward still runs (the first layer's
    backward holds until an upload has been issued); the device then waits, on its stream, for each bucket."""
    from tests.simworld import META, SimWorld, on_device
    from trainkit_strategies.offload.hostcopy import CopyStream

    monkeypatch.setattr(master_module, "MIN_RUN", 0)
    token = object()
    uploads: list[tuple[str, bool]] = []
    device_waits: list[object] = []
    real = master_module.transfer
    world = SimWorld(1)
    partition: set[int] = set()
    model_box: list[_GatedStack] = []

    def counted(dst, src):
        uploads.append((threading.current_thread().name, src.data_ptr() in partition))
        model_box[0].opened.set()
        return real(dst, src)

    monkeypatch.setattr(master_module, "transfer", counted)
    monkeypatch.setattr(CopyStream, "mark", lambda self: object())  # copies pending on the device
    monkeypatch.setattr(CopyStream, "wait", staticmethod(device_waits.append))
    monkeypatch.setattr(CopyStream, "synchronize", staticmethod(lambda event: None))

    def run(rank: int) -> None:
        strategy = get_strategy("zero_offload", bucket_mb=0.002)
        strategy.setup_environment(Environment(device=META), comm=world.comm(0))
        torch.manual_seed(0)
        model = on_device(_GatedStack())
        model_box.append(model)
        strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Precision.from_name("bf16-mixed"))
        monkeypatch.setattr(strategy._master._uploads, "mark", lambda: token)  # an upload pending on the device
        partition.update(strategy.grads.piece(b).data_ptr() for b in strategy.buckets)
        buckets = len(strategy.buckets)
        assert buckets >= 4
        x = torch.randn(4, 32).to(META)
        for _ in range(2):
            uploads.clear()
            device_waits.clear()
            for micro in range(accumulate):
                last = micro == accumulate - 1
                model.opened.clear()
                if not last:
                    model.opened.set()  # no step in this backward: nothing to wait for
                with contextlib.nullcontext() if last else strategy.no_sync():
                    with strategy.forward_context():
                        loss = model(x).float().pow(2).mean()
                    if last:
                        assert strategy.step_in_backward(1.0)  # on by default where host memory is apart
                    strategy.backward(loss)
            strategy.reduce_gradients(1.0)
            strategy.optimizer_step()
            strategy.zero_grad()
            assert uploads == [("trainkit-offload-host_0", True)] * buckets
            assert device_waits.count(token) == buckets
        assert all(model.seen) and len(model.seen) == 2 * accumulate  # no gate timed out
        assert strategy.steps_in_backward == 2

    world.run(run)


def test_the_delayed_update_waits_for_the_last_upload_before_rewriting_its_buffers(monkeypatch):
    """Under DPU the host step of step t rewrites the compute-dtype copies that step t-1's parameters were uploaded
    from: it first waits (in its own thread) for those uploads; its spare gradient partition is page-locked too (a
    pageable one makes every other step's copies synchronous)."""
    from tests.simworld import META, SimWorld
    from trainkit_strategies.offload.hostcopy import CopyStream
    from trainkit_strategies.planning.memory import page_locked

    events: list[str] = []
    token = object()
    monkeypatch.setattr("trainkit_strategies.data_parallel.zero.mark", lambda device: token)
    monkeypatch.setattr(CopyStream, "synchronize", staticmethod(
        lambda event: events.append("waited for the upload") if event is token else None))
    world = SimWorld(1)

    def run(rank: int) -> None:
        strategy, model = _on_a_gpu_stand_in(world, delayed_update=True)
        real_step = strategy._master.step
        monkeypatch.setattr(strategy._master, "step", lambda *a, **k: (events.append("host step"), real_step(*a, **k)))
        assert all(b.untyped_storage() in page_locked for b in strategy._spare)
        x = torch.randn(4, 32).to(META)
        for _ in range(2):
            _train_step(strategy, model, x)
        strategy.settle()

    world.run(run)
    # the first step uploads nothing before it; the second one's host step waits for the first one's upload
    assert events == ["host step", "waited for the upload", "host step"]
