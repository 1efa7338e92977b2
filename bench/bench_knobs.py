"""bench_knobs.py: what each memory knob saves in one training forward and backward, at a real shape.

    python bench/bench_knobs.py                          # Qwen2.5-0.5B's shape, 4 of its 24 layers: ~3 min
    python bench/bench_knobs.py --model qwen3-0.6b --layers 28 --rows 2 --tokens 1024

Builds the published configuration (random_checkpoint.MODELS) with --layers layers, random weights, and runs
the update's forward and backward as train.py does: hidden states, then `model.head_logprobs` (one
chunk of logits at a time) and a loss on the log-probs, under each combination of
`--gradient-checkpointing` and bf16 autocast (`--dtype bfloat16`). For each it reports
- the activations autograd saves for backward, counted with saved-tensor hooks (parameters and
  their bf16 casts excluded): exact, and the same on any machine;
- the peak RSS of the forward + backward above the RSS before it (Linux VmHWM, reset first), with
  the gradients already allocated by a warm-up step, as in a run's later steps: activations,
  recomputation buffers, bf16 weight copies and temporaries. At Qwen2.5-0.5B's shape most of it is
  the tied head's and embedding's two (V, C) float32 gradients, made before being added in;
- the time of the forward + backward, and the largest gradient difference from plain float32,
  relative to the largest gradient.
`--optimizer-offload` is not a row: it moves AdamW's two float32 moments (8 bytes per parameter) and
the step from the accelerator to CPU memory, so on a CPU it saves nothing; on a GPU it saves those
8 bytes per parameter of GPU memory. Run it with nothing else on the machine for the times and RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_trl import rss_gib  # noqa: E402
from random_checkpoint import MODELS  # noqa: E402

from distributed import fixed_mmap_threshold, memory_peak  # noqa: E402
from hf import config_from_hf  # noqa: E402
from logprobs import head_logprobs  # noqa: E402
from model import Transformer  # noqa: E402


def step(model: Transformer, ids: torch.Tensor, autocast: bool) -> dict:
    """One forward + backward of sum(log-probs of the next tokens); its saved bytes, peak RSS, time."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    n = ids.shape[0] * (ids.shape[1] - 1)  # tokens in the forward
    saved: dict[int, int] = {}  # storage -> bytes: a tensor saved twice counts once

    def pack(t: torch.Tensor) -> torch.Tensor:
        weight_cast = t.dim() == 2 and t.shape[0] != n  # autocast's bf16 copy of a (out, in) weight
        if t.untyped_storage().data_ptr() not in params and not weight_cast:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=False)  # the gradients stay allocated: the RSS column is the step's own memory
    base = rss_gib()
    memory_peak(torch.device("cpu"))  # reset the high-water mark to the current RSS
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model(ids[:, :-1], hidden=True)  # (B, T-1, C)
            logp, _ = head_logprobs(model.lm_head, hidden.flatten(0, 1), ids[:, 1:].flatten())
    logp.sum().backward()
    seconds = time.perf_counter() - t0
    return dict(saved=sum(saved.values()) / 2**30, rss=memory_peak(torch.device("cpu")) - base, seconds=seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=list(MODELS), help="published configuration")
    p.add_argument("--layers", type=int, default=4, help="layers built (the published count: all of them)")
    p.add_argument("--rows", type=int, default=2, help="sequences per forward")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = p.parse_args()
    if min(args.layers, args.rows, args.tokens, args.threads) < 1:
        p.error("--layers, --rows, --tokens and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    fixed_mmap_threshold()  # the heap setting train.py makes (otherwise RSS measures glibc's fragmentation)
    torch.manual_seed(0)
    config = dataclasses.replace(config_from_hf(MODELS[args.model]), num_hidden_layers=args.layers)
    model = Transformer(config).train()
    ids = torch.randint(config.vocab_size, (args.rows, args.tokens + 1))
    print(
        f"bench_knobs: {args.model} shape, {args.layers} of {MODELS[args.model]['num_hidden_layers']} layers, "
        f"{args.rows} x {args.tokens} = {args.rows * args.tokens} tokens, float32 weights, {args.threads} threads, "
        f"torch {torch.__version__}"
    )
    print(f"{'':<40}{'saved activations':>18}{'peak RSS above start':>22}{'seconds':>9}{'grad diff':>11}")
    step(model, ids, autocast=False)  # warm-up: allocates the gradients, as a run's first step does
    ref = None
    for checkpointing in (False, True):
        for autocast in (False, True):
            model.gradient_checkpointing = checkpointing
            r = step(model, ids, autocast)
            grads = torch.cat([q.grad.flatten() for q in model.parameters()])
            ref = grads if ref is None else ref
            diff = ((grads - ref).abs().max() / ref.abs().max()).item()  # relative to the largest gradient
            name = "--gradient-checkpointing" if checkpointing else "float32"
            name += ", bf16 autocast" if autocast else ""
            print(f"{name:<40}{r['saved']:>14.3f} GiB{r['rss']:>18.2f} GiB{r['seconds']:>9.1f}{diff:>11.1e}")
    print("(saved: what autograd keeps for backward after the forward, counted with saved-tensor hooks)")


if __name__ == "__main__":
    main()
