"""Tree sampling vs flat sampling, printed as ratios from one run (not a test): K=4 thoughts x M=4
answers per prompt (T4A4) against 16 independent full sequences per prompt of the same total
lengths. Thoughts are about 4x longer than answers; lengths are forced (no stop ids, a two-token
marker a random model practically never emits, so every thought runs to its limit and gets the
marker appended). Counts the tokens fed to the model and the wall time. CPU, float32.

    python bench/bench_tree.py [--prompts P] [--threads N] [--repeats R] [--cpu-time]
"""

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_sampler import build_model, setup, timing_args  # noqa: E402  (same directory)

from model import Transformer  # noqa: E402
from sampler import generate, sample_tree  # noqa: E402

K, M, THOUGHT, ANSWER, MARKER = 4, 4, 64, 16, [8190, 8191]


def counted(model: Transformer, fn, clock: Callable[[], float]) -> tuple[float, int, object]:
    """Run fn(), returning its wall time, the number of tokens fed to model.forward, and its result."""
    fed, forward = [0], model.forward

    def wrapped(input_ids, *args, **kw):
        fed[0] += input_ids.numel()
        return forward(input_ids, *args, **kw)

    model.forward = wrapped
    try:
        t = clock()
        out = fn()
        return clock() - t, fed[0], out
    finally:
        del model.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call")
    timing_args(parser)
    args = parser.parse_args()
    clock = setup(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 8190, (int(torch.randint(24, 41, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    total = THOUGHT + len(MARKER) + ANSWER

    def tree():
        return sample_tree(
            model,
            prompts,
            k=K,
            m=M,
            max_thought_tokens=THOUGHT,
            max_answer_tokens=ANSWER,
            end_of_thought=MARKER,
            seed=0,
        )

    def flat():
        return generate(model, prompts, max_new_tokens=total, n=K * M, seed=0)

    generate(model, prompts, max_new_tokens=2, n=K * M, seed=0)  # warm-up
    t_tree = t_flat = float("inf")
    for _ in range(args.repeats):  # interleaved, so a load change on the shared machine hits both
        t, fed_tree, out = counted(model, tree, clock)
        t_tree = min(t_tree, t)
        t, fed_flat, _ = counted(model, flat, clock)
        t_flat = min(t_flat, t)
    assert all(out.thought_truncated) and all(len(a) == ANSWER for a in out.answers), "lengths were not forced"
    print(
        f"{args.prompts} prompts, T{K}A{M}: thoughts {THOUGHT} + marker {len(MARKER)}, answers {ANSWER} "
        f"(flat: {K * M} sequences of {total} per prompt)\n  CPU float32, {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"  tokens fed to the model: tree {fed_tree}, flat {fed_flat} -> {fed_flat / fed_tree:.2f}x fewer (goal >= 2x)"
    )
    print(f"  time: tree {t_tree:.2f} s, flat {t_flat:.2f} s -> {t_flat / t_tree:.2f}x faster (goal >= 1.8x)")


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
