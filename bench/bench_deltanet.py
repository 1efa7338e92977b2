"""bench_deltanet.py: the Gated DeltaNet layer in training, ours (deltanet.py) against transformers' torch code
(torch_chunk_gated_delta_rule, Qwen3_5GatedDeltaNet), at Qwen3.5-0.8B's widths (hidden 1024, 16 key and 16 value
heads of 128, kernel 4), float32, random weights shared by both sides.

    python bench/bench_deltanet.py                       # eager at the 3 shapes, compiled at (a)
    python bench/bench_deltanet.py --shapes a b --compile   # a quick look, nothing compiled

Shapes: (a) one 256-token prompt row; (b) 2 rows x 64 tokens from a given state (conv window and S); (c) 16 rows x
320 tokens. Each is timed for the bare rule (q, k, v, g, beta, S -> out, S) and the whole layer (projections,
convolution, norms, out_proj; ours also with `valid` given, all True, as training passes it, and with a quarter
of each row left-padded, which runs `compact`'s gathers), forward alone (autograd recording, as in training) and
forward+backward, in microseconds per token: the median of --reps runs, the sides in turns in one process.
Then torch.compile (Inductor, dynamic shapes) of our rule and of our layer's mix, against eager, with the compile
(the first call, forward and backward) timed apart. A comparison to read, not a test: nothing asserts on a time.

Measured (2 shared CPU cores under load, 1 thread; ours / transformers' time, medians of 5; before: 573e536):
    rule fwd+bwd   (a) 1.11 -> 0.73   (b) 0.91 -> 0.73   (c) 0.81 -> 0.55
    rule fwd       (a) 0.77 -> 0.77   (b) 0.70 -> 0.66   (c) 0.91 -> 0.66
    layer fwd+bwd, valid all True: (a) 1.03 -> 0.87   (b) 1.05 -> 0.97   (c) 0.86 -> 1.06 (noise: projections dominate)
    compiled rule (a): 1.08 x eager, first call 224 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import deltanet  # noqa: E402

SHAPES = {"a": (1, 256, False), "b": (2, 64, True), "c": (16, 320, False)}  # rows, tokens, from a given state


def config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=1024,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )


class Cache:
    """The state one layer starts from, in both sides' cache interfaces (ours: state/set_state; transformers':
    its linear-attention layer's getters and updates); nothing is written back, so each call starts afresh."""

    def __init__(self, conv, S):
        self.conv, self.S = conv, S

    def state(self, layer_idx, B):
        return self.conv, self.S

    def set_state(self, layer_idx, conv, S):
        pass

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.S

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_states_to_keep(self, layer_idx):
        return 0

    def is_recording_past(self, layer_idx):
        return False

    def update_conv_state(self, x, layer_idx, state_idx=0, conv_kernel_size=4):
        return torch.cat([self.conv, x], -1)

    def update_recurrent_state(self, S, layer_idx):
        pass


def rule_inputs(B, T, H, dk, dv, g):
    """Inputs of the bare rule as our layer hands them over: (B, H, T, d) contiguous, q and k L2-normalised."""
    q, k = (deltanet.l2norm(torch.randn(B, H, T, dk, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g)
    decay, beta = -torch.rand(B, H, T, generator=g) * 0.5, torch.rand(B, H, T, generator=g)
    S = torch.randn(B, H, dk, dv, generator=g) * 0.1
    return [q * dk**-0.5, k, v, decay, beta, S]


def theirs_rule(q, k, v, g, beta, S):
    """transformers' chunked rule on the same inputs: it takes (B, T, H, d) and scales q itself."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    dk = q.shape[-1]
    t = (x.transpose(1, 2) for x in (q * dk**0.5, k, v, g, beta))
    out, S = torch_chunk_gated_delta_rule(*t, initial_state=S, output_final_state=True)
    return out.transpose(1, 2), S


def cases(shape):
    """{case: (ours, theirs, leaves)}: zero-argument callables giving the outputs, and the tensors the gradient
    flows to; and our layer's pieces for the compiled runs."""
    B, T, stateful = SHAPES[shape]
    cfg = config()
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    theirs = Qwen3_5GatedDeltaNet(cfg, 0)
    ours = deltanet.GatedDeltaNet(cfg, 0)
    ours.load_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(1)
    H, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = rule_inputs(B, T, H, dk, dv, g)
    if not stateful:
        r[5] = torch.zeros_like(r[5])
    leaves = [t.requires_grad_() for t in r]
    x = torch.randn(B, T, cfg.hidden_size, generator=g).requires_grad_()
    conv = torch.randn(B, ours.conv1d.weight.shape[0], cfg.linear_conv_kernel_dim - 1, generator=g) * 0.1
    cache = Cache(conv, r[5].detach()) if stateful else None
    full = torch.ones(B, T, dtype=torch.bool)
    padded = torch.arange(T) >= T // 4
    padded = padded.expand(B, T)
    mask = padded.long()
    out = {
        "rule": (lambda: deltanet.chunked_delta_rule(*leaves), lambda: theirs_rule(*leaves), leaves),
        "layer": (lambda: ours(x, cache), lambda: theirs(x, cache), [x]),
        "layer, valid all True": (lambda: ours(x, cache, full), lambda: theirs(x, cache), [x]),
        "layer, 1/4 left padding": (lambda: ours(x, cache, padded), lambda: theirs(x, cache, mask), [x]),
    }
    if stateful:  # transformers' layer reads a padding mask only without a cache
        del out["layer, 1/4 left padding"]
    return out, (ours, x, cache, full, leaves)


def loss_of(outs):
    outs = outs if isinstance(outs, tuple) else (outs,)
    return sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)


def outputs_and_grads(fn, leaves):
    out = fn()
    out = out if isinstance(out, tuple) else (out,)
    return (tuple(o.detach() for o in out), *torch.autograd.grad(loss_of(out), leaves))


def fwd(fn):
    def run():
        fn()

    return run


def fwd_bwd(fn, leaves):
    def run():
        loss_of(fn()).backward()
        for t in leaves:
            t.grad = None

    return run


def timeit(runs: dict, reps: int) -> dict:
    """Median seconds of each callable, run in turns (one warm-up each first)."""
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(reps):
        for k, f in runs.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def compare(shape, reps):
    B, T, _ = SHAPES[shape]
    tests, _ = cases(shape)
    rows = []
    for name, (o, t, leaves) in tests.items():
        runs = {"of": fwd(o), "tf": fwd(t), "ob": fwd_bwd(o, leaves), "tb": fwd_bwd(t, leaves)}
        m = {k: v / (B * T) * 1e6 for k, v in timeit(runs, reps).items()}
        rows.append((name, m))
        print(
            f"({shape}) {B:>2} x {T:<3} {name:<24} fwd {m['of']:8.1f} {m['tf']:8.1f} {m['of'] / m['tf']:6.2f}   "
            f"fwd+bwd {m['ob']:8.1f} {m['tb']:8.1f} {m['ob'] / m['tb']:6.2f}",
            flush=True,
        )
    return rows


def compiled(shape, reps):
    """Our rule and our layer's mix, eager against torch.compile(dynamic=True), fwd+bwd; the first call apart."""
    B, T, _ = SHAPES[shape]
    _, (layer, x, cache, full, leaves) = cases(shape)
    torch._dynamo.reset()
    rule_c = torch.compile(deltanet.chunked_delta_rule, dynamic=True)
    mix_c = torch.compile(layer.mix, dynamic=True)
    pairs = {
        "rule": (lambda: deltanet.chunked_delta_rule(*leaves), lambda: rule_c(*leaves), leaves),
        "mix, valid all True": (lambda: layer.mix(x, cache, full), lambda: mix_c(x, cache, full), [x]),
    }
    for name, (e, c, lv) in pairs.items():
        start = time.perf_counter()
        try:
            fwd_bwd(c, lv)()
        except Exception as err:  # the mix at B = 1, dynamic: Inductor (torch 2.13) fails ordering symbolic strides
            print(f"({shape}) {name}: compile failed: {str(err).splitlines()[0]}", flush=True)
            continue
        first = time.perf_counter() - start
        (ye, *want), (yc, *got) = (outputs_and_grads(f, lv) for f in (e, c))
        diff = max((a - b).abs().max().item() for a, b in zip([*ye, *want], [*yc, *got]))
        runs = {"e": fwd_bwd(e, lv), "c": fwd_bwd(c, lv)}
        m = {k: v / (B * T) * 1e6 for k, v in timeit(runs, reps).items()}
        print(
            f"({shape}) {B:>2} x {T:<3} {name:<24} fwd+bwd eager {m['e']:8.1f} compiled {m['c']:8.1f} "
            f"ratio {m['c'] / m['e']:5.2f}   first call {first:6.1f} s   max |grad diff| {diff:.1e}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compile", nargs="*", default=["a"], choices=list(SHAPES), help="shapes to compile at")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per token: ours, transformers', ratio")
    with torch.random.fork_rng():
        for s in args.shapes:
            compare(s, args.reps)
        for s in args.compile:
            compiled(s, args.reps)


if __name__ == "__main__":
    main()
