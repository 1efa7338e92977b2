"""Sampler speed, printed as ratios from one run (not a test): sampler.generate against
transformers.generate on the same random ~6M-parameter Qwen2-shaped model, and against the
GEMM-only limit (the same matmuls, timed alone). Also tokens/s at several batch sizes and the KV
cache memory. CPU, float32, temperature 1, no stop ids (every row makes all its tokens).

    python bench/bench_sampler.py [--threads N] [--repeats R] [--cpu-time]
"""

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_profile import CountOps  # noqa: E402  (same directory)

from hf import load_model, save_model  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from sampler import KVCache, generate  # noqa: E402

NEW_TOKENS = 96


def build_model(tmp: str) -> Transformer:
    """A random Qwen2-shaped model (hidden 256, 6 layers, 4/2 heads, vocab 8192, tied), saved to tmp/m
    and loaded back (bench_tree.py uses the same one)."""
    cfg = ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        attention_bias=True,
        tie_word_embeddings=True,
        model_type="qwen2",
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    save_model(Transformer(cfg), Path(tmp) / "m")
    return load_model(Path(tmp) / "m").eval()


def build(tmp: str) -> tuple[Transformer, "transformers.PreTrainedModel"]:  # noqa: F821
    """build_model's checkpoint as ours and as HF's."""
    import transformers

    ours = build_model(tmp)
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "m", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return ours, hf


def timing_args(parser: argparse.ArgumentParser) -> None:
    """Add --threads, --cpu-time, --repeats (shared with bench_tree.py)."""
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time instead of the wall clock: steadier on a "
        "shared machine, meaningful with --threads 1",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per figure; the best is kept")


def setup(args) -> Callable[[], float]:
    """Apply --threads; return the clock --cpu-time selects."""
    torch.set_num_threads(args.threads)
    return time.process_time if args.cpu_time else time.perf_counter


def make_prompts(P: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(P)
    return [
        torch.randint(0, 8192, (int(torch.randint(16, 49, (1,), generator=g)),), generator=g).tolist() for _ in range(P)
    ]


def best_time(fn, repeats: int, clock: Callable[[], float]) -> float:
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)  # the least disturbed run: the machine is shared


def time_ours(
    model: Transformer, prompts: list[list[int]], n: int, repeats: int, clock: Callable[[], float], static_step=None
) -> float:
    """static_step: sampler.decode's (graphs.decode_runner: CUDA graphs on a GPU); None: eager."""
    kw = dict(max_new_tokens=NEW_TOKENS, n=n, temperature=1.0, seed=0, static_step=static_step)
    return best_time(lambda: generate(model, prompts, **kw), repeats, clock)


def hf_run(hf, prompts: list[list[int]], n: int, new_tokens: int) -> Callable[[], None]:
    """transformers.generate of new_tokens per row, sampling as ours does (temperature 1, no top-k/top-p)."""
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts]).to(hf.device)
    mask = (torch.arange(T) >= torch.tensor([T - len(p) for p in prompts])[:, None]).long().to(hf.device)

    def run():
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n,
                pad_token_id=0,
            )
        assert out.shape == (len(prompts) * n, T + new_tokens)

    return run


def time_hf(hf, prompts: list[list[int]], n: int, repeats: int, clock: Callable[[], float]) -> float:
    return best_time(hf_run(hf, prompts, n, NEW_TOKENS), repeats, clock)


def ops_per_step(run: Callable[[int], Callable[[], object]], short: int = 8, long: int = 24) -> float:
    """The aten ops a decode step dispatches (each one a Python-to-C++ round trip on CPU): those of a run of `long`
    new tokens minus those of one of `short`, divided by long - short, so prefill and setup cancel out."""
    counts = {}
    for steps in (short, long):
        fn = run(steps)
        fn()  # first calls (lazy inits) are not counted
        with CountOps() as ops:
            fn()
        counts[steps] = ops.n
    return (counts[long] - counts[short]) / (long - short)


def time_gemms(
    model: Transformer,
    prompts: list[list[int]],
    n: int,
    repeats: int,
    clock: Callable[[], float],
    attention: bool = False,
) -> float:
    """The GEMM-only limit: the prefill's and every decode step's projections + lm_head as plain
    matmuls at the sampler's shapes, nothing else. Prefill: P x longest-prompt rows through the
    layers, P rows through lm_head; then one step per fed token (NEW_TOKENS - 1) at P*n rows.
    attention=True adds each layer's decode attention over the cache as it grows (one SDPA call at
    the sampler's shapes): the work a decode step cannot skip, so the limit of an eager sampler."""
    qkv = [
        (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) for a in (layer.self_attn for layer in model.model.layers)
    ]
    rest = [
        (
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_proj.weight,
            layer.mlp.up_proj.weight,
            layer.mlp.down_proj.weight,
        )
        for layer in model.model.layers
    ]
    head = model.lm_head.weight
    dt, dev = head.dtype, head.device  # activations and cache in the weights' dtype and device, as the sampler's
    P, B, T = len(prompts), len(prompts) * n, max(map(len, prompts))
    steps = [(P * T, P)] + [(B, B)] * (NEW_TOKENS - 1)  # (layer rows, head rows)
    x = {
        (r, w.shape[1]): torch.randn(r, w.shape[1], dtype=dt, device=dev)
        for r, _ in steps
        for ws in qkv + rest
        for w in ws
    }
    x |= {(r, head.shape[1]): torch.randn(r, head.shape[1], dtype=dt, device=dev) for _, r in steps}
    c = model.config
    kv_shape = (2, c.num_hidden_layers, B, c.num_key_value_heads, T + NEW_TOKENS, c.head_dim)  # the cache's layout
    kv = torch.randn(kv_shape, dtype=dt, device=dev)
    q = torch.randn(B, c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim, dtype=dt)
    q = q.to(dev)
    valid = torch.ones(B, 1, 1, T + NEW_TOKENS, dtype=torch.bool, device=dev)

    def run():
        for i, (rows, head_rows) in enumerate(steps):
            for layer in range(len(qkv)):
                for w in qkv[layer]:
                    F.linear(x[rows, w.shape[1]], w)
                if attention and i:  # decode step i attends to the T + i cached keys and its own
                    S = T + i + 1
                    F.scaled_dot_product_attention(
                        q, kv[0, layer, :, :, :S], kv[1, layer, :, :, :S], attn_mask=valid[..., :S]
                    )
                for w in rest[layer]:
                    F.linear(x[rows, w.shape[1]], w)
            F.linear(x[head_rows, head.shape[1]], head)

    with torch.no_grad():
        return best_time(run, repeats, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    timing_args(parser)
    args = parser.parse_args()
    clock = setup(args)
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = build(tmp)
    n_params = sum(p.numel() for p in ours.parameters())
    print(
        f"model: {n_params / 1e6:.1f}M params (Qwen2-shaped, tied), CPU float32, {args.threads} threads "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs), {NEW_TOKENS} new tokens, "
        f"temperature 1, no stop"
    )

    P, n = 8, 4
    prompts = make_prompts(P)
    generate(ours, prompts, max_new_tokens=4, n=n, seed=0)  # warm-up
    t_ours = t_hf = t_gemm = t_attn = float("inf")
    for _ in range(args.repeats):  # interleaved rounds: a load change on a shared machine hits all four
        t_ours = min(t_ours, time_ours(ours, prompts, n, 1, clock))
        t_hf = min(t_hf, time_hf(hf, prompts, n, 1, clock))
        t_gemm = min(t_gemm, time_gemms(ours, prompts, n, 1, clock))
        t_attn = min(t_attn, time_gemms(ours, prompts, n, 1, clock, attention=True))
    tokens = P * n * NEW_TOKENS
    print(f"\nbatch {P * n} ({P} prompts x n={n}):")
    print(f"  sampler.generate        {tokens / t_ours:8.0f} tok/s")
    print(
        f"  transformers.generate   {tokens / t_hf:8.0f} tok/s   -> sampler is {t_hf / t_ours:.2f}x HF (goal >= 2.5x)"
    )
    print(
        f"  GEMM-only limit         {tokens / t_gemm:8.0f} tok/s   -> sampler reaches {100 * t_gemm / t_ours:.0f}% "
        f"of it (goal >= 80%), HF {100 * t_gemm / t_hf:.0f}%"
    )
    print(
        f"  GEMM + attention limit  {tokens / t_attn:8.0f} tok/s   -> sampler reaches {100 * t_attn / t_ours:.0f}% "
        f"of it, HF {100 * t_attn / t_hf:.0f}%"
    )
    print(
        f"  per decode step: sampler {1e3 * t_ours / NEW_TOKENS:.2f} ms = "
        f"GEMMs {1e3 * t_gemm / NEW_TOKENS:.2f} + attention "
        f"{1e3 * (t_attn - t_gemm) / NEW_TOKENS:.2f} + everything else {1e3 * (t_ours - t_attn) / NEW_TOKENS:.2f} "
        f"(norms, RoPE, cache writes, sampling, Python)"
    )
    kw = dict(n=n, temperature=1.0, seed=0)
    ours_ops = ops_per_step(lambda steps: lambda: generate(ours, prompts, max_new_tokens=steps, **kw))
    hf_ops = ops_per_step(lambda steps: hf_run(hf, prompts, n, steps))
    print(f"  aten ops per decode step: sampler {ours_ops:.0f}, transformers.generate {hf_ops:.0f}")

    print("\nbatch   prompts x n   tok/s   KV cache (float32)")
    for P, n in ((1, 1), (2, 4), (8, 4), (32, 4)):
        prompts = make_prompts(P)
        t = time_ours(ours, prompts, n, args.repeats, clock)
        cache_bytes = KVCache.for_model(ours, P * n, max(map(len, prompts)) + NEW_TOKENS).nbytes
        print(f"{P * n:5d}   {P:7d} x {n}   {P * n * NEW_TOKENS / t:7.0f}   {cache_bytes / 2**20:6.1f} MiB")


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
