"""bench_head.py: the lm_head's forward + backward with the loss's gradient fused into the forward (head_logprobs'
loss: 3 head matmuls per chunk) against the plain path (forward, then a backward that recomputes each chunk's
logits: 4), at Qwen3.5-0.8B's head (vocab 248320, hidden 1024), float32, one thread, GRPO's clipped surrogate.

    python bench/bench_head.py                   # 128 and 1024 tokens: median of 3 each, the two interleaved
    python bench/bench_head.py --tokens 128 --reps 1
    python bench/bench_head.py --memory          # each path's peak RSS in a fresh process (1024 tokens)
    python bench/bench_head.py --same-chunks     # fused with the plain path's chunks, not half: faster, +1 chunk

Measured (2-core CPU machine, nice'd beside other work: absolute seconds inflated, the ratio is the number; median
of 3, interleaved), fused / plain time:  128 tokens 0.83, 1024 tokens 0.85 (default: the fused path's chunks are half
the plain one's, so its peak stays the plain backward's: 1.086 vs 1.088 GiB over setup at 1024 tokens; each chunk
also reads and writes the whole (V, C) weight gradient, hence the smaller gain);  --same-chunks: 0.65 and 0.70, its
peak one chunk (64 MB) higher (1.150 GiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from config import TrainConfig  # noqa: E402
from logprobs import head_logprobs  # noqa: E402
from losses import CLIP, token_loss  # noqa: E402

V, C, ROWS = 248320, 1024, 4  # Qwen3.5-0.8B's vocabulary and hidden size; the tokens as ROWS rows


def setup(tokens: int, seed: int = 0):
    """The head (a bias-free Linear), hidden states (ROWS, tokens / ROWS, C) with grad, targets, and the loss as a
    function of the (ROWS, T) log-probs: GRPO's clip at mu = 1 (old_logp: the log-probs, detached), beta 0."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(C, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, C, generator=g) * 0.02)
    shape = (ROWS, tokens // ROWS)
    hidden = torch.randn(*shape, C, generator=g).requires_grad_()
    targets = torch.randint(0, V, shape, generator=g)
    mask = torch.ones(shape, dtype=torch.bool)
    fields = dict(adv=torch.randn(shape, generator=g), weight=mask.float() / mask.sum(), mask=mask)
    hp = types.SimpleNamespace(**dataclasses.asdict(TrainConfig()))
    return head, hidden, targets, functools.partial(token_loss, fields, None, hp, CLIP, 1.0)


def step(head, hidden, targets, loss, fused: bool, chunk: int | None = None) -> float:
    """One forward + backward of the head and the loss; seconds. chunk: rows per chunk (None: head_logprobs')."""
    head.weight.grad = hidden.grad = None
    t = time.perf_counter()
    logp, _ = head_logprobs(head, hidden, targets, loss=loss if fused else None, chunk_tokens=chunk)
    loss(logp).backward()
    return time.perf_counter() - t


def timing(tokens: int, reps: int, same_chunks: bool) -> None:
    head, hidden, targets, loss = setup(tokens)
    chunk = 2**24 // V if same_chunks else None  # None: the fused path's default, half the plain one's
    step(head, hidden, targets, loss, True, chunk)  # warm-up
    times = {False: [], True: []}
    for _ in range(reps):  # interleaved: a drift in the machine's load hits both alike
        for fused in (False, True):
            times[fused].append(step(head, hidden, targets, loss, fused, chunk if fused else None))
    plain, fused = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{tokens:5d} tokens: plain {plain:7.2f} s  fused {fused:7.2f} s  fused / plain {fused / plain:.3f}", flush=True
    )


def rss(field: str) -> float:
    """/proc/self/status's VmRSS or VmHWM (the peak), GiB."""
    line = next(li for li in open("/proc/self/status") if li.startswith(field + ":"))
    return int(line.split()[1]) / 2**20


def peak(fused: bool, tokens: int, same_chunks: bool) -> None:
    """In a fresh process: the peak RSS of one step over what setup holds (Linux: the high-water mark is reset after
    setup through /proc/self/clear_refs, so setup's own temporaries do not count)."""
    head, hidden, targets, loss = setup(tokens)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = rss("VmRSS")
    step(head, hidden, targets, loss, fused, 2**24 // V if same_chunks and fused else None)
    top = rss("VmHWM")
    print(f"{'fused' if fused else 'plain'}: peak RSS {top:.3f} GiB, {top - base:.3f} GiB over setup's {base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="each path's peak RSS, in a fresh process each")
    parser.add_argument("--same-chunks", action="store_true", help="fused with the plain path's chunks (2**24 // V)")
    parser.add_argument("--peak", choices=("plain", "fused"), help=argparse.SUPPRESS)  # the child of --memory
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peak:
        return peak(args.peak == "fused", args.tokens[-1], args.same_chunks)
    if args.memory:
        for which in ("plain", "fused"):
            cmd = [sys.executable, __file__, "--peak", which, "--tokens", str(args.tokens[-1])]
            cmd += ["--same-chunks"] if args.same_chunks else []
            subprocess.run(cmd, check=True)
        return
    for n in args.tokens:
        timing(n, args.reps, args.same_chunks)


if __name__ == "__main__":
    main()
