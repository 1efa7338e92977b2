"""distributed.py: what changes when torchrun starts several processes.

Each rank samples its share of a step's prompts and trains on it; every loss normaliser is a sum
over ranks (all_sum), so the update equals one process's on the same global batch. With --fsdp
(FSDP2's fully_shard) each rank holds a shard of the weights, gradients and optimizer state;
sampling and evaluation gather the whole weights once (full_params), and checkpoints gather the
full state on rank 0 (gather_full_state). One process: every function here is a no-op.
memory_peak reads each device's (or the process's) peak memory, for the mem/... metrics;
weight_norms and check_update catch an update that broke the weights, on every rank at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import resource

import torch
import torch.distributed as dist

from cli import UserError


def wants_cuda(cfg) -> bool:
    """--device names a CUDA device, or is auto on a machine with one."""
    return cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())


def rollout_dtype(cfg, cuda: bool | None = None) -> str:
    """--rollout-dtype resolved: auto is bfloat16 on CUDA (the run's device when `cuda` is None, wants_cuda), else
    float32 (the policy itself samples)."""
    cuda = wants_cuda(cfg) if cuda is None else cuda
    return cfg.rollout_dtype if cfg.rollout_dtype != "auto" else "bfloat16" if cuda else "float32"


def setup_distributed(cfg) -> tuple[int, int, torch.device]:
    """Rank, world size and device from torchrun's environment (one process: 0, 1, --device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    want_cuda = wants_cuda(cfg)
    if want_cuda and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA device")
    device = torch.device("cpu")
    if want_cuda:
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else torch.cuda.current_device()
        )
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if want_cuda else "gloo")
        if cfg.prompts_per_step % world:
            raise UserError(f"--prompts-per-step {cfg.prompts_per_step} must divide evenly over {world} ranks")
    return rank, world, device


def wrap(policy: torch.nn.Module, world: int, device: torch.device, fsdp: bool) -> torch.nn.Module:
    """What the update runs: the policy itself in one process; under torchrun its DDP wrapper, or with
    fsdp the policy sharded in place by FSDP2 (each layer one all-gather unit, the root the rest)."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in policy.model.layers:
            fully_shard(layer)
        return fully_shard(policy)
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(policy, device_ids=ids)
    return policy


def derive_seed(*parts: int) -> int:
    """A seed from (seed, step, global prompt index, ...): the same global batch gives the same
    rollouts whatever the world size or batch composition."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def all_sum(x: float | torch.Tensor, world: int) -> torch.Tensor:
    """Sum over ranks (a no-op in one process); used for every global normaliser."""
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    if world > 1:
        t = t.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
    return t.cpu()


def gather_rows(x: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, slice]:
    """Every rank's (B_r, T_r) rows, in rank order (the global prompt order), as one (sum B_r, max T_r) tensor whose
    padding columns are zero, and the slice of them that is this rank's. For statistics of the whole step (a token
    quantile, a covariance, a draw) that every rank then computes alike. One process: x itself."""
    if world == 1:
        return x, slice(0, x.shape[0])
    shape = torch.tensor(x.shape, dtype=torch.long, device=x.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    rows, cols = (int(max(s[i] for s in shapes)) for i in (0, 1))
    padded = torch.zeros(rows, cols, dtype=x.dtype, device=x.device)
    padded[: x.shape[0], : x.shape[1]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    start = int(sum(s[0] for s in shapes[:rank]))
    return torch.cat([p[: int(s[0])] for p, s in zip(parts, shapes)]), slice(start, start + x.shape[0])


@contextlib.contextmanager
def full_params(policy: torch.nn.Module, fsdp: bool):
    """FSDP: all-gather every parameter once, on every rank, and keep it whole until the block ends.

    Sampling runs a number of forwards that depends on each rank's data (rows stop at different
    steps, dynamic sampling redoes some prompts) and evaluation runs on rank 0 only, so FSDP's
    all-gather per forward would leave the ranks out of step and hang. Inside the block a forward
    does no collectives: FSDP2's pre-forward unshard is a no-op on an already unsharded group, and
    reshard-after-forward is off. Every rank must enter the block (the all-gathers happen here).
    Without FSDP it does nothing."""
    if not fsdp:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in policy.modules() if isinstance(m, FSDPModule)]  # each layer and the root
    for m in groups:
        m.unshard()  # not recursive: one call per fully_shard'ed module
    policy.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in groups:  # back to fully_shard's defaults: layers reshard after forward, the root does not
            m.set_reshard_after_forward(m is not policy, recurse=False)
            m.reshard()


def gather_full_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """FSDP: full (unsharded) model and optimizer state dicts, on CPU, on rank 0 (empty on the other
    ranks); the optimizer's is keyed by parameter name. Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


GROWTH = 1e3  # an update that multiplies a parameter's norm by more than this (past 1) broke the weights


def weight_norms(params: list[torch.Tensor]) -> torch.Tensor:
    """(n,) float32 L2 norm of each parameter (its local shard under FSDP), in one fused pass over the
    weights (torch._foreach_norm): NaN or inf where the parameter holds a NaN or an inf."""
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    return torch.stack([n.float().cpu() for n in torch._foreach_norm(local)]) if local else torch.zeros(0)


def check_update(
    names: list[str], before: torch.Tensor, after: torch.Tensor, world: int, step: int, advice: str
) -> None:
    """Refuse weights an update broke, before anything uses them: a parameter holding NaN or inf, or one
    whose norm grew more than GROWTH-fold past max(its norm before, 1) (finite, but its next forward
    overflows: --lr 1e10 takes the bundled model's weights from about 1 to 1e9 in one step). before,
    after: weight_norms of the parameters `names`; a broken shard on any rank stops every rank. The
    UserError names the step, the parameter, and `advice` (the flags to lower)."""
    bad = ~torch.isfinite(after) | (after > GROWTH * before.clamp(min=1))
    if world > 1:
        bad = all_sum(bad.double(), world) > 0
    if bad.any():
        i = int(bad.nonzero()[0])
        raise UserError(
            f"step {step}: the update took {names[i]}'s norm from {before[i]:.3g} to {after[i]:.3g}; the run "
            f"stopped before these weights were used or saved (the last checkpoint is intact): {advice}"
        )


class WeightGuard:
    """check_update after every update, with one norm pass per update: the norms after an update are the next
    one's "before" (weights change only in updates). params: what the optimizer steps (the masters), by name."""

    def __init__(self, names: list[str], params: list[torch.Tensor], world: int, advice: str) -> None:
        self.names, self.params, self.world, self.advice = names, params, world, advice
        self.norms = weight_norms(params)

    def check(self, step: int) -> None:
        before, self.norms = self.norms, weight_norms(self.params)
        check_update(self.names, before, self.norms, self.world, step, self.advice)


def memory_peak(device: torch.device) -> float:
    """GiB at the peak since the last call, then reset: CUDA's peak allocated memory, or on CPU the
    process's peak resident set size (Linux VmHWM, reset through /proc/self/clear_refs)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return kib / 2**20
    except (OSError, StopIteration):  # not Linux: the lifetime peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def fixed_mmap_threshold(nbytes: int = 8 << 20) -> None:
    """CPU memory: have glibc serve every allocation of at least nbytes with its own mmap, returned to
    the OS when freed. Its default threshold rises with each freed block (up to 32 MiB), after which a
    layer's 8-30 MiB activations come from the heap, which fragments and never shrinks: at
    Qwen2.5-0.5B's shape the update's peak RSS then grew 0.42 GiB per layer in backward instead of
    0.06 (bench/bench_memory.py), with no measurable change in speed. A no-op off glibc, or when the
    user has set MALLOC_MMAP_THRESHOLD_ themselves."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # -3 = M_MMAP_THRESHOLD; fixing it ends the dynamic rise
    except (OSError, AttributeError):  # not glibc
        pass
