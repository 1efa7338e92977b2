"""bench_lora.py: LoRA against full fine-tuning at Qwen2.5-0.5B's shape: optimizer state, peak memory, step time.

    python bench/bench_lora.py                           # 8 rows x 256 tokens, ranks 1 and 16: ~20 min, 2 CPU cores
    python bench/bench_lora.py --gradient-checkpointing  # activations recomputed: what the weights' state costs
    python bench/bench_lora.py --layers 4 --steps 2      # a quick look (4 of the 24 layers)

One training step as the trainer runs it, side by side: a forward to hidden states, the completion tokens'
log-probs through lm_head chunk by chunk (model.head_logprobs, as pack.token_stats does), a loss, backward,
gradient clipping and an AdamW step (fused, betas 0.9/0.99, as train.py), on a fixed batch of random token
ids, float32 weights, gradient checkpointing off (the trainer's default) or on. Sides: full fine-tuning
(every parameter trained) and LoRA of rank 1 and 16 on all seven linear layers (q, k, v, o, gate, up, down;
alpha = 2 x rank; lora.add_lora). Each side runs in its own process, one after the other, so its peak RSS
(Linux VmHWM, reset before each step: distributed.memory_peak) is its own. The first step allocates AdamW's
state; the table reports the last step's time and the highest step peak, with ratios LoRA / full.

Then, on the same checkpoint, what merged weights change for the sampler (lora.py's docstring): the largest
logit difference between the wrapped model (W x + (B (A x)) s) and its merged copy ((W + (B A) s) x) in
float32 and bf16, next to the adapters' own effect, whether greedy decoding gives the same tokens, and the
time of one merged-copy refresh (lora.copy_merged_, which the trainer runs after each update).

The checkpoint is random_checkpoint.py's (Qwen2.5-0.5B-Instruct's published configuration, random weights,
cached in --cache): costs do not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import random_checkpoint  # noqa: E402

SHAPE = "qwen2.5-0.5b"


def step_side(path: str, rank: int, rows: int, tokens: int, steps: int, seed: int, checkpointing: bool) -> dict:
    """One side's steps (rank 0: full fine-tuning); its figures as a dict."""
    import lora
    from distributed import fixed_mmap_threshold, memory_peak
    from hf import load_model
    from logprobs import head_logprobs

    fixed_mmap_threshold()  # as train.py: freed activations go back to the OS
    cpu = torch.device("cpu")
    model = load_model(path, dtype=torch.float32).train()
    model.gradient_checkpointing = checkpointing
    if rank:
        lora.add_lora(model, rank, 2.0 * rank, lora.DECODER, seed=seed)
    params = lora.lora_parameters(model) if rank else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens + 1), generator=torch.Generator().manual_seed(seed))
    memory_peak(cpu)
    times, peaks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        hidden = model(ids[:, :-1], hidden=True)  # (rows, tokens, C)
        logp = head_logprobs(model, hidden, ids[:, 1:])[0]  # (rows, tokens) float32
        (-logp.mean()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        peaks.append(memory_peak(cpu))
        print(f"  step {len(times)}: {times[-1]:.1f} s, peak RSS {peaks[-1]:.2f} GiB", flush=True)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return dict(
        trainable=sum(p.numel() for p in params),
        params=sum(p.numel() for p in model.parameters()),
        optimizer_bytes=sum(t.nbytes for t in state),
        grad_bytes=sum(p.numel() * p.element_size() for p in params),
        step_s=times[-1],
        peak_gib=max(peaks),
    )


@torch.no_grad()
def merge_side(path: str, rank: int, seed: int, new_tokens: int) -> dict:
    """Merged versus unmerged at this shape: logit differences, greedy tokens, one refresh's time."""
    import lora
    from hf import load_model
    from sampler import generate

    model = lora.add_lora(load_model(path, dtype=torch.float32), rank, 2.0 * rank, lora.DECODER, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for m in lora.lora_layers(model).values():  # a trained-looking B: the adapters move the logits visibly
        m.lora_B.copy_(0.02 * torch.randn(m.lora_B.shape, generator=g))
    V = model.config.vocab_size
    ids = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    merged = lora.merged_copy(model)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    lora.copy_merged_(merged, model)
    refresh = time.perf_counter() - t0
    out = dict(merged_copy_s=first, refresh_s=refresh)
    un, me = model(ids), merged(ids)
    with lora.adapters_off(model):
        out["adapter_effect"] = (model(ids) - un).abs().max().item()
    out["fp32_max_diff"] = (un - me).abs().max().item()
    out["fp32_bit_equal"] = torch.equal(un, me)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["bf16_max_diff"] = (model(ids).float() - merged(ids).float()).abs().max().item()
    prompts = ids[:, :16].tolist()
    a = generate(model, prompts, max_new_tokens=new_tokens, n=2, temperature=0.0, seed=0)
    b = generate(merged, prompts, max_new_tokens=new_tokens, n=2, temperature=0.0, seed=0)
    out["greedy_rows_equal"], out["greedy_rows"] = sum(x == y for x, y in zip(a.tokens, b.tokens)), len(a.tokens)
    out["greedy_tokens"] = sum(len(t) for t in a.tokens)
    out["logprob_max_diff"] = max(abs(x - y) for la, lb in zip(a.logprobs, b.logprobs) for x, y in zip(la, lb))
    return out


def child(kind: str, args: argparse.Namespace, path: Path, rank: int) -> dict:
    """Run one side in a fresh process; its dict comes back as the last line of its output."""
    cmd = [sys.executable, __file__, "--child", kind, "--child-rank", str(rank), "--child-path", str(path)]
    for flag in ("rows", "tokens", "steps", "seed", "new_tokens"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    lines = p.stdout.rstrip().splitlines()
    for line in lines[:-1]:
        print(line, flush=True)
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rows", type=int, default=8, help="rows per step")
    p.add_argument("--tokens", type=int, default=256, help="tokens per row")
    p.add_argument("--steps", type=int, default=2, help="steps per side (the first allocates AdamW's state)")
    p.add_argument("--ranks", default="1,16", help="LoRA ranks to compare with full fine-tuning")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0 = all 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, adapters and batch")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per row in the merged check")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_scale"), help="checkpoint dir")
    p.add_argument("--child", choices=["step", "merge"], help=argparse.SUPPRESS)
    p.add_argument("--child-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "step":
        a = args
        r = step_side(a.child_path, a.child_rank, a.rows, a.tokens, a.steps, a.seed, a.gradient_checkpointing)
        print(json.dumps(r))
        return
    if args.child == "merge":
        print(json.dumps(merge_side(args.child_path, args.child_rank, args.seed, args.new_tokens)))
        return

    cache = Path(args.cache)
    if args.layers:
        tok, _ = random_checkpoint.tokenizer_dir(cache, SHAPE)
        path = cache / f"{SHAPE}-seed{args.seed}-{args.layers}layers"
        if not (path / "model.safetensors").is_file():
            random_checkpoint.build(SHAPE, path, tok, args.seed, args.layers)
    else:
        path, _ = random_checkpoint.checkpoint(cache, SHAPE, args.seed)
    ranks = [int(r) for r in args.ranks.split(",")]
    layers = args.layers or random_checkpoint.MODELS[SHAPE]["num_hidden_layers"]
    ckpt = "on" if args.gradient_checkpointing else "off"
    print(f"{SHAPE} shape ({layers} layers), random weights, float32, gradient checkpointing {ckpt}; ", end="")
    print(f"step: {args.rows} rows x {args.tokens} tokens")
    sides = {}
    for rank in [0, *ranks]:
        name = "full" if rank == 0 else f"lora r{rank}"
        print(f"{name}:", flush=True)
        sides[name] = child("step", args, path, rank)

    full = sides["full"]
    mib = 2**20
    head = f"{'side':<10} {'trainable':>12} {'optim MiB':>10} {'grads MiB':>10} {'peak GiB':>9} {'step s':>8}"
    print("\n" + head + f"   {'optim':>8} {'peak':>6} {'time':>6}  (ratios to full)")
    for name, s in sides.items():
        print(
            f"{name:<10} {s['trainable']:>12,} {s['optimizer_bytes'] / mib:>10.1f} {s['grad_bytes'] / mib:>10.1f} "
            f"{s['peak_gib']:>9.2f} {s['step_s']:>8.1f}   {s['optimizer_bytes'] / full['optimizer_bytes']:>8.5f} "
            f"{s['peak_gib'] / full['peak_gib']:>6.3f} {s['step_s'] / full['step_s']:>6.3f}"
        )

    rank = ranks[-1]
    print(f"\nmerged versus unmerged weights, lora r{rank}, B ~ N(0, 0.02^2), alpha = 2 x rank:", flush=True)
    m = child("merge", args, path, rank)
    print(f"  adapters' own effect on the logits (max |on - off|): {m['adapter_effect']:.3g}")
    bit = "bit-equal" if m["fp32_bit_equal"] else "not bit-equal"
    print(f"  float32 logits, max |unmerged - merged|: {m['fp32_max_diff']:.3g} ({bit})")
    print(f"  bf16 autocast logits, max |unmerged - merged|: {m['bf16_max_diff']:.3g}")
    rows = f"{m['greedy_rows_equal']} of {m['greedy_rows']} rows ({m['greedy_tokens']} tokens)"
    print(f"  greedy decoding, the same tokens in {rows}; log-probs max diff {m['logprob_max_diff']:.3g}")
    print(f"  merged_copy {m['merged_copy_s']:.2f} s, copy_merged_ refresh {m['refresh_s']:.2f} s")


if __name__ == "__main__":
    main()
