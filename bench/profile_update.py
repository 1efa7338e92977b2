"""profile_update.py: where one GRPO update's time goes, by operation, ours against TRL's compute, one process.

    python bench/profile_update.py --model DIR                       # 16 rows of a 256-token prompt + 64 tokens
    python bench/profile_update.py --model DIR --micro-batch-rows 16 --prompt-tokens 32 --new 128

Both sides run the same update on the same checkpoint (random weights from random_checkpoint.py, float32): one
prompt of --prompt-tokens, --rows completions of --new tokens, micro-batches of --micro-batch-rows, forward and
backward of every micro-batch, then AdamW (fused: train.py's and TRL's default). Ours is train.py's path (pack,
split_rows, step_prompts: the shared prompt once per step, token_stats with the head a slice of the vocabulary at a
time and the vocabulary tables' gradients summed per step, a clipped loss; ours_micro: the prompt per micro-batch,
the tables' gradients per micro-batch); TRL's: what its GRPOTrainer computes per micro-batch: transformers' model
on the rows' prompt + completion tokens (logits_to_keep = the completion), log-softmax at the targets, the clipped
loss. Each side runs a warm-up step, then --repeats timed steps (the sides in turns), then one under
torch.profiler (--no-profile: none), whose table groups the aten ops' self CPU time by kind (matmuls split by what
they multiply: the head's vocabulary, the MLP's width, the rest).
A profile to read, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf import load_model  # noqa: E402
from model import VocabGrads  # noqa: E402
from pack import Answer, Group, Thought, pack, select_rows, split_rows, step_prompts, token_stats  # noqa: E402

KINDS = {  # aten op name fragments -> kind (first match wins; matmuls are split by shape below)
    "solve_triangular": "DeltaNet triangular solves",
    "scaled_dot_product": "attention (sdpa)",
    "_flash_attention": "attention (sdpa)",
    "conv": "DeltaNet convolution",
    "gather": "gathers, index_select, scatter",
    "index": "gathers, index_select, scatter",
    "scatter": "gathers, index_select, scatter",
    "sort": "gathers, index_select, scatter",
    "cat": "copies, cat, layout",
    "copy_": "copies, cat, layout",
    "clone": "copies, cat, layout",
    "contiguous": "copies, cat, layout",
    "fill_": "copies, cat, layout",
    "zero_": "copies, cat, layout",
    "logsumexp": "log-softmax, softmax",
    "softmax": "log-softmax, softmax",
    "rsqrt": "norms and elementwise",
    "_foreach": "optimizer (AdamW)",
    "adam": "optimizer (AdamW)",
}
MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")


def kind_of(name: str, shapes, vocab: int, width: int) -> str:
    op = name.removeprefix("aten::")
    if op in MATMUL:
        dims = {d for s in shapes for d in (s or ())}
        if vocab in dims:
            return "matmuls: head (vocabulary)"
        if width in dims:
            return "matmuls: MLP"
        return "matmuls: projections, DeltaNet chunks"
    for frag, kind in KINDS.items():
        if frag in op:
            return kind
    return "norms and elementwise"


def table(prof, vocab: int, width: int) -> dict[str, float]:
    """Self CPU seconds per kind over the profiled step."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
            out[kind_of(e.key, e.input_shapes, vocab, width)] += e.self_cpu_time_total / 1e6
    return out


def make_batch(prompt_tokens: int, rows: int, new: int, vocab: int, pad: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
    thoughts = []
    for _ in range(rows):
        toks = torch.randint(0, vocab, (new,), generator=g).tolist()
        thoughts.append(Thought([], [], False, [Answer(toks, [-1.0] * new, "length")]))
    return [Group({}, prompt, thoughts)], prompt, thoughts


def ours_step(model, opt, groups, micro_rows: int, pad: int, adv: torch.Tensor, once: bool) -> None:
    batch = pack(groups, pad, torch.device("cpu"), share_prompt=True)
    micro = [(rows, select_rows(batch, rows)) for rows in split_rows(batch, micro_rows)]
    grads = VocabGrads() if once else None  # train.update's: the (V, C) tables' gradients summed over micro-batches
    shared = step_prompts(model, batch, micro, grads) if once else None  # train.update's: the prompt once per step
    for i, (rows, mb) in enumerate(micro):
        last = i == len(micro) - 1
        if grads:
            grads.last = last
        mask, a = mb.ids != pad, adv[rows, None]

        prompts = shared and (shared if last else shared.leaves)
        logp, _ = token_stats(model, mb, 1.0, prompts=prompts, vocab_grads=grads)
        ratio = (logp - logp.detach()).exp()  # the clipped surrogate
        loss = -(torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * mask).sum() / mask.sum() / len(adv)
        shared.backward(loss) if shared and last else loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def trl_step(hf, opt, prompt, thoughts, micro_rows: int, adv: torch.Tensor) -> None:
    ids = torch.tensor([prompt + t.answers[0].tokens for t in thoughts])
    new = len(thoughts[0].answers[0].tokens)
    for i in range(0, len(ids), micro_rows):
        x = ids[i : i + micro_rows]
        logits = hf(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=new + 1).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, -new:, None]).squeeze(-1)
        ratio = (logp - logp.detach()).exp()
        a = adv[i : i + micro_rows, None]
        loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).mean(1).sum() / len(adv)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--micro-batch-rows", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="a profiled round last")
    p.add_argument("--sides", default="ours,trl", help="any of ours, ours_micro (the prompt once per micro-batch), trl")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    ours = load_model(args.model, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cfg = ours.config
    vocab, width, pad = cfg.vocab_size, cfg.intermediate_size, 0
    groups, prompt, thoughts = make_batch(args.prompt_tokens, args.rows, args.new, vocab, pad)
    adv = torch.randn(args.rows, generator=torch.Generator().manual_seed(1))
    sides = {
        "ours": (ours, lambda m, o: ours_step(m, o, groups, args.micro_batch_rows, pad, adv, True)),
        "ours_micro": (ours, lambda m, o: ours_step(m, o, groups, args.micro_batch_rows, pad, adv, False)),
        "trl": (hf, lambda m, o: trl_step(m, o, prompt, thoughts, args.micro_batch_rows, adv)),
    }
    results, times = {}, defaultdict(list)
    chosen = args.sides.split(",")
    for name in chosen:
        model, _ = sides[name]
        sides[name] = (model, sides[name][1], torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True))  # train.py's
    for r in range(1 + args.repeats + args.profile):  # the sides in turns: a warm-up, timed rounds, a profiled one
        for name in chosen:
            model, step, opt = sides[name]
            if r <= args.repeats:
                t = time.perf_counter()
                step(model, opt)
                if r:
                    times[name].append(time.perf_counter() - t)
            else:
                with torch.profiler.profile(record_shapes=True) as prof:
                    step(model, opt)
                results[name] = table(prof, vocab, width)
    n_layers = cfg.num_hidden_layers
    print(
        f"one update: 1 prompt of {args.prompt_tokens} + {args.rows} x {args.new} tokens, micro-batch "
        f"{args.micro_batch_rows}, {n_layers} layers, float32, {args.threads} threads"
    )
    for name, ts in times.items():
        print(f"{name}: step {statistics.median(ts):.2f} s, median of {len(ts)} (range {min(ts):.2f}-{max(ts):.2f})")
    if not results:
        return
    kinds = sorted({k for r in results.values() for k in r}, key=lambda k: -max(r.get(k, 0) for r in results.values()))
    print(f"{'self CPU seconds / step':<40}" + "".join(f"{n:>10}" for n in chosen))
    for k in kinds:
        print(f"{k:<40}" + "".join(f"{results[n].get(k, 0):10.2f}" for n in chosen))
    print(f"{'total':<40}" + "".join(f"{sum(results[n].values()):10.2f}" for n in chosen))


if __name__ == "__main__":
    main()
