"""decode_profile.py: where a decode step's time goes, for gpu_check.py's profile rows.

* kernels per step and GPU-busy time per step: torch.profiler over two generate calls that differ only in their
  number of new tokens, the difference divided by the extra steps (so prefill, forks and the first capture cancel
  out). On CPU, where there are no kernels, the aten ops dispatched per step (TorchDispatchMode) stand in.
* the floor: a step must read the weights and each row's keys and values once; at the bandwidth a device-to-device
  copy reaches in the same run, that takes floor_ms. A step's wall time against it is the % of the HBM floor.
* the first differing position of two greedy runs (graphs or compiled against eager): bf16 kernels that fuse or
  order differently round differently, so greedy paths part somewhere; how soon is the number to watch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import Transformer
from sampler import generate


class CountOps(TorchDispatchMode):
    """The aten ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _run(model: Transformer, prompts: list[list[int]], new: int, static_step) -> Callable[[], object]:
    return lambda: generate(model, prompts, max_new_tokens=new, temperature=1.0, seed=0, static_step=static_step)


def step_profile(model: Transformer, prompts: list[list[int]], static_step, short: int = 8, long: int = 40) -> dict:
    """Kernels per decode step and the GPU's busy milliseconds per step (CUDA), or aten ops per step (CPU):
    the difference between a `long` and a `short` generate call, divided by long - short. Both are run once
    first, so captures and compiles are not counted."""
    device = next(model.parameters()).device
    runs = {n: _run(model, prompts, n, static_step) for n in (short, long)}
    for fn in runs.values():
        fn()
    counts, busy = {}, {}
    for n, fn in runs.items():
        if device.type != "cuda":
            with CountOps() as ops:
                fn()
            counts[n], busy[n] = ops.n, 0.0
            continue
        torch.cuda.synchronize(device)
        activity = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activity) as prof:
            fn()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[n], busy[n] = len(kernels), sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    steps = long - short
    return dict(per_step=(counts[long] - counts[short]) / steps, busy_ms=(busy[long] - busy[short]) / steps)


def copy_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    n = int(gib * 2**30) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n * 4 / best


def floor_ms(model: Transformer, rows: int, context: float, bandwidth: float) -> float:
    """Milliseconds a decode step needs at `bandwidth` to read the weights once and, for each of `rows` rows, the
    keys and values of its `context` tokens (the mean over the run)."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * next(model.parameters()).element_size()
    return 1e3 * (weights + rows * context * per_token) / bandwidth


def first_differences(a: list[list[int]], b: list[list[int]]) -> str:
    """Rows of a and b that are identical, and where the others first differ (median and earliest position)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), None) for r, s in zip(a, b)]
    differ = [f for f in firsts if f is not None]
    same = f"{len(a) - len(differ)}/{len(a)} rows identical"
    if not differ:
        return same
    return f"{same}; first differing position: median {statistics.median(differ):g}, earliest {min(differ)}"
