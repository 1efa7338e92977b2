"""bench_head.py: the lm_head's forward + backward three ways, side by side in one process, float32, GRPO's clipped
surrogate at mu = 1 on top:

  slices   logprobs.head_logprobs: the vocabulary a slice at a time (~64 MB of logits), a product more than chunks
  chunks   tokens a chunk at a time (the same 64 MB: 2**24 // V tokens), logits recomputed per chunk in backward:
           the head_logprobs of earlier commits, written out here as the baseline
  autograd the full (N, V) logits, log_softmax and gather, autograd's backward (TRL's way, with logits_to_keep)

    python bench/bench_head.py                                  # Qwen3.5-0.8B's head, 128 / 1024 / 2048 tokens
    python bench/bench_head.py --vocab 151936 --hidden 896      # Qwen2.5-0.5B's head
    python bench/bench_head.py --threads 1 --reps 1 --tokens 2048
    python bench/bench_head.py --memory                         # each side's peak RSS, a fresh process each

Times are medians of --reps rounds, the sides interleaved (a drift in the machine's load hits all alike).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from logprobs import head_logprobs  # noqa: E402


class _TokenChunks(torch.autograd.Function):
    """The baseline: logp = log_softmax(h @ w.T)[target] over chunks of `step` tokens; the backward recomputes each
    chunk's logits, (onehot - softmax) g, and adds the chunk's d.T @ h into one float32 (V, C) gradient."""

    @staticmethod
    def forward(ctx, h, w, t, step):
        logp, lse = h.new_empty(len(h)), h.new_empty(len(h))
        for i in range(0, len(h), step):
            x = h[i : i + step] @ w.T
            lse[i : i + step] = torch.logsumexp(x, -1)
            logp[i : i + step] = x.gather(1, t[i : i + step, None])[:, 0] - lse[i : i + step]
        ctx.save_for_backward(h, w, t, lse)
        ctx.step = step
        return logp

    @staticmethod
    def backward(ctx, g):
        h, w, t, lse = ctx.saved_tensors
        g_h, g_w = torch.empty_like(h), torch.zeros_like(w)
        for i in range(0, len(h), ctx.step):
            s = slice(i, i + ctx.step)
            d = (h[s] @ w.T).sub_(lse[s, None]).exp_().mul_(-g[s, None])
            d.scatter_add_(1, t[s, None], g[s, None])
            g_h[s] = d @ w
            g_w.addmm_(d.T, h[s])
        return g_h, g_w, None, None


def setup(tokens: int, vocab: int, hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.02)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    return head, h, torch.randint(0, vocab, (tokens,), generator=g), torch.randn(tokens, generator=g)


def logprobs(side: str, head, h, targets):
    if side == "slices":
        return head_logprobs(head, h, targets)[0]
    if side == "chunks":
        return _TokenChunks.apply(h, head.weight, targets, max(1, 2**24 // head.weight.shape[0]))
    return torch.log_softmax(head(h).float(), -1).gather(-1, targets[:, None])[:, 0]


def step(side: str, head, h, targets, adv) -> float:
    """One forward + backward of the head and GRPO's clipped surrogate at mu = 1 (ratio 1); seconds."""
    head.weight.grad = h.grad = None
    t = time.perf_counter()
    logp = logprobs(side, head, h, targets)
    ratio = (logp - logp.detach()).exp()
    (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()).backward()
    return time.perf_counter() - t


def rss(field: str) -> float:
    """/proc/self/status's VmRSS or VmHWM (the peak), GiB."""
    line = next(li for li in open("/proc/self/status") if li.startswith(field + ":"))
    return int(line.split()[1]) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 2048])
    p.add_argument("--vocab", type=int, default=248320)  # Qwen3.5-0.8B's vocabulary and hidden size
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--sides", default="slices,chunks,autograd")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--memory", action="store_true", help="each side's peak RSS, in a fresh process each")
    p.add_argument("--peak", help=argparse.SUPPRESS)  # the child of --memory: this side's peak
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sides, shape = args.sides.split(","), (args.vocab, args.hidden)
    if args.peak:  # the high-water mark reset after setup (/proc/self/clear_refs): setup's temporaries do not count
        head, h, targets, adv = setup(args.tokens[-1], *shape)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = rss("VmRSS")
        step(args.peak, head, h, targets, adv)
        print(f"{args.peak:>8}: peak RSS {rss('VmHWM') - base:.3f} GiB over setup's {base:.3f}", flush=True)
        return
    if args.memory:
        for side in sides:
            cmd = [sys.executable, __file__, "--peak", side, "--tokens", str(args.tokens[-1])]
            subprocess.run(cmd + ["--vocab", str(args.vocab), "--hidden", str(args.hidden)], check=True)
        return
    print(f"head ({args.vocab}, {args.hidden}), float32, {args.threads} threads, median of {args.reps}")
    for n in args.tokens:
        head, h, targets, adv = setup(n, *shape)
        step(sides[0], head, h, targets, adv)  # warm-up
        times = {s: [] for s in sides}
        for _ in range(args.reps):
            for s in sides:
                times[s].append(step(s, head, h, targets, adv))
        med = {s: statistics.median(ts) for s, ts in times.items()}
        cells = "  ".join(f"{s} {med[s]:7.2f} s" for s in sides)
        ratios = "  ".join(f"{s} / slices {med[s] / med['slices']:.2f}" for s in sides if s != "slices")
        print(f"{n:5d} tokens: {cells}   {ratios if 'slices' in med else ''}", flush=True)


if __name__ == "__main__":
    main()
