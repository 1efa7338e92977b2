"""sft.py: supervised warm start, and the recipe that builds the bundled tiny model.

    python sft.py                      # rebuild assets/tiny-model from scratch (make tiny-model)
    python sft.py --steps 2000 --out /tmp/better-tiny
    python sft.py --task synthetic-mul --tool-demos 0.3 --steps 600 --out assets/tiny-tool-model  # the tool model

RL needs a policy that is sometimes right: a random model never earns a reward. This script
builds a character-level tokenizer for the synthetic task, a small Qwen2-architecture model, and
trains it on the task's reference completions (`<think>` scratchpad, then the answer) with plain
next-token cross-entropy on the completion tokens. It stops early on purpose, at a moderate
held-out accuracy, so that RL has room to improve it. Fixed seed and step count: rerunning it on
the same machine gives the same weights. With --tool-demos (synthetic-mul) a share of the demonstrations call
the Python tool in ToRL's form; the tool's output in them is context, not trained on, as in RL (methods/tools.py).
"""

from __future__ import annotations

import cli

if __name__ == "__main__":  # a mistyped flag fails here, in a fraction of a second, before torch loads
    cli.check_flag_names("sft.py:SFTConfig")

import json
import os
import time
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from cli import parse_config, user_errors
from hf import BUNDLED, BUNDLED_DIR, save_model
from logprobs import token_logprobs
from model import ModelConfig, Transformer
from tasks import SYNTHETIC_CHARS, get_task, render_prompt, sft_completion
from tokenizer import load_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ChatML, as Qwen
THINK = ["<think>", "</think>"]  # added but not special, as in Qwen3 (decode keeps them)
TOOL_CHARS = "*`()pythonrintu"  # synthetic-mul's tool calls: ```python, print(a*b), ```output
TOOL_CALL_END = "```output"  # ToRL's marker: the Python tool's output follows it (envs.PythonTool)


@dataclass
class SFTConfig:
    # -- run
    out: str = BUNDLED  # where the checkpoint (HF layout + tokenizer) is written
    task: str = "synthetic"  # task whose reference completions are the training data
    tool_demos: float = 0.0  # synthetic-mul: share of demonstrations that call the Python tool (the rest by hand)
    # -- optimisation
    steps: int = 200  # optimizer steps (fixed, not time-based, so the result is reproducible)
    batch_size: int = 64  # examples per step
    lr: float = 3e-3  # AdamW learning rate (linear warm-up, then constant)
    warmup: int = 50  # warm-up steps
    seed: int = 0  # initialisation and data seed
    # -- model shape
    hidden_size: int = 128  # model width
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads (head_dim = hidden / heads)
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 352  # SwiGLU hidden size
    # -- evaluation
    eval_examples: int = 200  # held-out prompts for the final greedy accuracy

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = dict(task=("synthetic", "synthetic-hard", "synthetic-mul"))

    def __post_init__(self) -> None:
        if self.task not in self.CHOICES["task"]:
            raise ValueError(
                f"--task must be one of {', '.join(self.CHOICES['task'])} (tasks with reference completions)"
            )
        if not 0 <= self.tool_demos <= 1 or (self.tool_demos and self.task != "synthetic-mul"):
            raise ValueError(f"--tool-demos must be in [0, 1] and needs --task synthetic-mul, got {self.tool_demos}")
        changed = [cli.flag(f.name) for f in fields(self) if f.name != "out" and getattr(self, f.name) != f.default]
        if os.path.realpath(self.out) == os.path.realpath(BUNDLED_DIR) and changed:
            raise ValueError(
                f"--out {self.out} is the bundled model, which only the default recipe rebuilds (make tiny-model); "
                f"with {', '.join(changed)} pass --out DIR for a model of your own"
            )


def build_char_tokenizer(chars: str) -> Tokenizer:
    """One token per character (the task's and the chat template's role names), plus ChatML
    specials and the think markers as atomic tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + THINK + sorted(set(chars + "system\nuser\nassistant\n")))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    return tok


def write_tokenizer(tok: Tokenizer, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    end, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=None, eos_token="<|im_end|>")
    config |= dict(pad_token="<|endoftext|>", add_bos_token=False)
    generation = dict(eos_token_id=[end, pad], pad_token_id=pad)
    for name, content in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=2)


def completion_ids(tokenizer, text: str) -> tuple[list[int], list[float]]:
    """A demonstration's ids and their loss mask: a tool's output (after each ```output marker, through its closing
    fence) is encoded alone and masked, as RL appends and masks it (multiturn.py); the rest is trained."""
    ids, trained = [], []
    while (i := text.find(TOOL_CALL_END)) >= 0:
        i += len(TOOL_CALL_END)
        j = text.find("```\n", i) + 4
        for piece, on in ((text[:i], 1.0), (text[i:j], 0.0)):
            ids += tokenizer.encode(piece)
            trained += [on] * (len(ids) - len(trained))
        text = text[j:]
    ids += tokenizer.encode(text)
    return ids, trained + [1.0] * (len(ids) - len(trained))


def make_batch(
    tokenizer, examples: list[dict], system_prompt: str | None, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion ids (B, T) and a mask (B, T) of the trained completion tokens."""
    end = tokenizer.token_to_id("<|im_end|>")
    rows = []
    for ex in examples:
        prompt = render_prompt(tokenizer, ex, system_prompt)
        completion, trained = completion_ids(tokenizer, sft_completion(ex))
        rows.append((prompt + completion + [end], [0.0] * len(prompt) + trained + [1.0]))
    T = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for b, (r, m) in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = torch.tensor(m)
    return ids.to(device), mask.to(device)


def build_model(cfg: SFTConfig, tokenizer) -> Transformer:
    """A freshly initialised Qwen2-architecture model of cfg's shape for `tokenizer` (tokenizer.Tokenizer);
    draws from torch's global generator."""
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden_size // cfg.heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=True,
        model_type="qwen2",
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=[tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")],
    )
    model = Transformer(config)
    for name, p in model.named_parameters():  # GPT-2 style init; norms start at 1, biases at 0
        torch.nn.init.normal_(p, std=0.02) if p.dim() == 2 else torch.nn.init.constant_(p, 0 if "bias" in name else 1)
    return model


def main(cfg: SFTConfig) -> float:
    from heldout import evaluate  # the same held-out evaluation the trainer reports

    torch.manual_seed(cfg.seed)
    task = get_task(cfg.task)
    tok_dir = cfg.out + ".tokenizer.tmp"
    chars = SYNTHETIC_CHARS + (TOOL_CHARS if cfg.task == "synthetic-mul" else "")
    write_tokenizer(build_char_tokenizer(chars), tok_dir)
    tokenizer = load_tokenizer(tok_dir)
    model = build_model(cfg, tokenizer)
    config = model.config
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    # Warm-up, then constant: ending at a full learning rate (no decay to 0) leaves a model that RL
    # can still move without first undoing a sharp, fully annealed fit.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    pool = task.train(20000, cfg.seed)
    if cfg.tool_demos:  # which demonstrations call the tool: a draw of their own, so the rest stays as without
        draw = torch.rand(len(pool), generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()
        pool = [{**ex, "tool": u < cfg.tool_demos} for ex, u in zip(pool, draw)]
    g = torch.Generator().manual_seed(cfg.seed)
    print(f"sft: {n_params / 1e6:.2f}M parameters, vocab {config.vocab_size}, {cfg.steps} steps of {cfg.batch_size}")
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(pool), (cfg.batch_size,), generator=g).tolist()
        ids, mask = make_batch(tokenizer, [pool[i] for i in idx], task.system_prompt, "cpu")
        logits = model(ids)  # (B, T, V)
        logp = token_logprobs(logits[:, :-1], ids[:, 1:])  # (B, T-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == cfg.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f}s")
    model.eval()
    res = evaluate(model, tokenizer, task, task.test(cfg.eval_examples, cfg.seed), n=4, seed=cfg.seed)
    print("held-out: " + "  ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float)))
    if cfg.tool_demos:  # and with the tool's output appended, as RL samples (methods/tools.py)
        from methods.tools import Flags, evaluator

        rollout, examples = evaluator(Flags(tools="python"), tokenizer, task), task.test(cfg.eval_examples, cfg.seed)
        res = evaluate(model, tokenizer, task, examples, n=4, seed=cfg.seed, rollout=rollout)
        print("held-out with the tool: " + "  ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float)))
    save_model(model, cfg.out, tokenizer_dir=tok_dir)
    for f in os.listdir(tok_dir):
        os.remove(os.path.join(tok_dir, f))
    os.rmdir(tok_dir)
    print(f"wrote {cfg.out} ({time.perf_counter() - t0:.0f}s)")
    return res["greedy_accuracy"]


if __name__ == "__main__":
    with user_errors():
        main(parse_config(SFTConfig, description=__doc__.split("\n\n")[0])[0])
