"""grpo_minimal.py: plain GRPO in one file, top to bottom, on the project's model, sampler, tasks and rewards.

    python grpo_minimal.py                                    # the bundled tiny model, synthetic addition, CPU
    python grpo_minimal.py --beta 0.04 --max-steps 20         # with the k3 KL penalty to the starting model

One step (step() below), the GRPO paper's algorithm (arXiv 2402.03300):
  1. sample      K completions per prompt (sampler.generate): the group
  2. score       a reward per completion, from its text (the task's reward function)
  3. advantages  A = (r - mean_group r) / (std_group r + eps), one per completion
  4. rows        prompt | completion per row, right-padded; each completion token gets its A and a loss weight
  5. loss        -(clipped surrogate - beta * k3 KL), a token mean per completion, a mean over completions
                 (it prints 0.0000 without --beta: ratio 1 on-policy and a group's A sum to 0; its gradient is not 0)
  6. update      clip the gradient norm, one AdamW step

It computes `train.py --algo grpo --no-share-prompt --lr-schedule constant --warmup-steps 0`'s numbers, bit for bit
(tests/test_grpo_minimal.py), and `make tour` prints one step of it with its tensors (docs/tour.md).

Left out, and the train.py flag that puts each back:
  GRPO-MA's tree, M answers per thought in packed rows   --algo grpo_ma, --answers M
  each prompt run once for its K rows                    --share-prompt (train.py's default)
  mu > 1 epochs per batch (a scoring pass for old logp)  --mu
  micro-batches (memory, not the gradient)               --micro-batch-rows, --micro-batch-tokens
  warm-up and cosine learning-rate decay                 --warmup-steps, --lr-schedule cosine
  top-k / top-p sampling; other losses and advantages    --top-k, --top-p, --loss, --advantage, --algo dapo ...
  evaluation, checkpoints, resume, logging to a file     --eval-every, --save-every, --resume (metrics.jsonl)
  bf16, LoRA, distributed runs, optimizer offload        --dtype, --lora-rank, torchrun (--fsdp), --optimizer-offload
"""

from __future__ import annotations

import cli

if __name__ == "__main__":  # a mistyped flag fails here, in a fraction of a second, before torch loads
    cli.check_flag_names("grpo_minimal.py:Config")

import hashlib
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from cli import parse_config, user_errors
from hf import BUNDLED, bundled, load_model, save_model
from logprobs import head_logprobs
from model import Transformer
from rewards import score_batch
from sampler import generate
from tasks import get_task, render_prompt
from tokenizer import decode_completion, load_tokenizer


@dataclass
class Config:
    """grpo_minimal.py's flags (cli.parse_config makes each field a --flag, its comment the help)."""

    # -- run
    model: str = BUNDLED  # HF checkpoint directory (Qwen2/2.5/3, Qwen3.5 hybrids, Llama 2/3.x)
    task: str = "synthetic"  # built-in task (synthetic, countdown) or file format (reads --data)
    data: str = ""  # JSONL file for file-based tasks
    seed: int = 0  # seeds the data order and every rollout
    device: str = "cpu"  # where to run (cuda for a GPU)
    max_steps: int = 30  # RL steps, one batch of prompts each (about 10 s each on 2 CPU cores)
    out: str = ""  # write the final weights here, an HF directory (empty: not saved)
    # -- GRPO
    prompts_per_step: int = 16  # P, prompts per step
    group_size: int = 16  # K, completions sampled per prompt: GRPO's group
    max_new_tokens: int = 80  # completion length limit, in tokens
    temperature: float = 1.0  # sampling temperature (the trained log-probs divide the logits by it too)
    lr: float = 3e-4  # AdamW learning rate, constant (tiny model; about 1e-6 for 0.5B-7B models)
    beta: float = 0.0  # weight of the k3 KL penalty to the starting model; > 0 loads a frozen reference copy
    clip: float = 0.2  # PPO's clip range: the ratio's gradient stops outside [1 - clip, 1 + clip]
    grad_clip: float = 1.0  # clip the global gradient norm to this

    def __post_init__(self) -> None:
        if self.group_size < 2:  # one completion is its own group's mean: its advantage would always be 0
            raise ValueError(
                f"--group-size must be at least 2 (GRPO compares a group's completions), got {self.group_size}"
            )


def derive_seed(*parts: int) -> int:
    """A seed from (seed, step, prompt index): a prompt's rollouts do not depend on the batch around it. The same
    hash as distributed.derive_seed, so this file samples what train.py samples."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# -----------------------------------------------------------------------------
# Steps 1-3: sample, score, advantages


def sample(policy: Transformer, tokenizer, prompts: list[list[int]], seeds: list[int], cfg: Config) -> list:
    """1. K completions per prompt, prompt-major (prompt p's at p*K .. p*K + K-1): token ids, ending with a stop
    token when one was sampled. Each prompt's randomness comes from its own seed."""
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_ids=tokenizer.stop_ids)
    return generate(policy, prompts, n=cfg.group_size, seed=seeds, **kw).tokens


def score(tokenizer, task, completions: list[list[int]], examples: list[dict], K: int) -> tuple[Tensor, list[str]]:
    """2. Rewards (P, K) from each completion's text, the text the task's checker reads (up to the stop token)."""
    texts = [decode_completion(tokenizer, c) for c in completions]
    per_completion = [ex for ex in examples for _ in range(K)]  # prompt-major, like the completions
    rewards = torch.tensor(score_batch(task.reward, texts, per_completion), dtype=torch.float32)
    return rewards.view(len(examples), K), texts


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """3. GRPO's advantage, rewards (P, K) -> (P, K): each reward against its own group's mean, in units of the
    group's (unbiased) std. A group whose rewards are all equal carries no signal: its advantages are exactly 0."""
    adv = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + eps)
    flat = rewards.amax(-1, keepdim=True) == rewards.amin(-1, keepdim=True)  # (P, 1)
    return adv.masked_fill(flat, 0.0)


# -----------------------------------------------------------------------------
# Steps 4-5: rows, log-probs, loss


@dataclass
class Rows:
    """The step's training rows, one per completion. The model runs `ids`; the loss lives in (B, T) tensors whose
    row b holds completion b's tokens from column 0 (T = the longest completion)."""

    ids: Tensor  # (B, L) prompt | completion, right-padded: what the model runs
    start: Tensor  # (B,) each completion's first column in ids (its prompt's length)
    tokens: Tensor  # (B, T) the completion tokens, right-padded
    mask: Tensor  # (B, T) bool: a completion token, not padding
    adv: Tensor  # (B, T) float: the completion's advantage, on each of its tokens (0 on padding)
    weight: Tensor  # (B, T) float: the loss weight, 1 / (B * the completion's length) (0 on padding)


def make_rows(prompts: list[list[int]], completions: list[list[int]], adv: Tensor, pad_id: int, device) -> Rows:
    """4. Rows (prompt | completion) for the B = P*K completions, with the per-token advantage and weight.

    The rows run shortest first, the order train.py's micro-batches run them in (pack.split_rows sorts by length,
    stably): float sums then add in the same order, which makes the two trainers' numbers equal to the bit. The
    weight makes the loss a plain sum: mean over completions of each completion's token mean (the GRPO paper's)."""
    K = len(completions) // len(prompts)
    pairs = [(prompts[i // K], c, a) for i, (c, a) in enumerate(zip(completions, adv.flatten().tolist()))]
    pairs.sort(key=lambda pair: len(pair[0]) + len(pair[1]))  # Python's sort is stable, as split_rows' argsort
    B, L, T = len(pairs), max(len(p) + len(c) for p, c, _ in pairs), max(len(c) for _, c, _ in pairs)
    ids, tokens = torch.full((B, L), pad_id), torch.full((B, T), pad_id)
    for b, (p, c, _) in enumerate(pairs):
        ids[b, : len(p) + len(c)] = torch.tensor(p + c)
        tokens[b, : len(c)] = torch.tensor(c)
    lengths = torch.tensor([len(c) for _, c, _ in pairs])
    mask = torch.arange(T) < lengths[:, None]  # (B, T)
    m = mask.float()
    adv_tok = torch.tensor([a for _, _, a in pairs])[:, None] * m  # (B, T)
    weight = m / (m.sum(-1, keepdim=True) * float(B))  # (B, T): sums to 1 over the step
    start = torch.tensor([len(p) for p, _, _ in pairs])
    return Rows(*(x.to(device) for x in (ids, start, tokens, mask, adv_tok, weight)))


def token_logprobs(model: Transformer, rows: Rows, temperature: float) -> Tensor:
    """log pi(token | everything before it) of every completion token, (B, T) float32, 0 on padding. The model
    returns hidden states; only the completion tokens' go through lm_head, so no (B, L, V) logits exist."""
    hidden = model(rows.ids, hidden=True)  # (B, L, C): a plain causal forward
    b, t = rows.mask.nonzero(as_tuple=True)  # (N,) each: every completion token, row-major
    h = hidden[b, rows.start[b] + t - 1]  # (N, C): token t of a completion is predicted by the position before it
    logp, _ = head_logprobs(model, h, rows.tokens[b, t], temperature)  # (N,) log_softmax(lm_head(h) / temp)[token]
    return torch.zeros_like(rows.weight).index_put((b, t), logp)  # (B, T)


def grpo_loss(logp: Tensor, ref_logp: Tensor | None, rows: Rows, cfg: Config) -> tuple[Tensor, Tensor, Tensor]:
    """5. The loss to minimise, and the ratio and k3 KL per token (B, T). Per token, GRPO maximises
    min(rho * A, clip(rho, 1 - clip, 1 + clip) * A) - beta * KL, weighted by rows.weight.

    rho = pi / pi_old. Here one AdamW step per batch, so pi_old is the policy as it is now: rho is exactly 1 and the
    clip never binds, but rho's gradient is grad log pi, the policy gradient (train.py --mu 2 makes the clip bind).
    k3 = exp(d) - d - 1 with d = log ref - log pi: >= 0, and an unbiased estimate of KL(pi || ref) under pi."""
    ratio = torch.exp(logp - logp.detach())  # (B, T) rho, 1 in value
    surrogate = torch.minimum(ratio * rows.adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * rows.adv)
    loss = -(rows.weight * surrogate).sum()
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # (B, T), 0 on padding (both log-probs are 0 there)
        loss = loss + cfg.beta * (rows.weight * kl).sum()
    return loss, ratio.detach(), kl.detach()


# -----------------------------------------------------------------------------
# One step, and the loop


def step(policy, reference, optimizer, tokenizer, task, examples: list[dict], seeds: list[int], cfg: Config) -> dict:
    """Steps 1-6 on one batch of prompts; returns everything the step made (the tour prints it)."""
    prompts = [render_prompt(tokenizer, ex, task.system_prompt) for ex in examples]  # chat template -> ids
    completions = sample(policy, tokenizer, prompts, seeds, cfg)  # 1. P*K token lists
    rewards, texts = score(tokenizer, task, completions, examples, cfg.group_size)  # 2. (P, K)
    adv = group_advantages(rewards)  # 3. (P, K)
    rows = make_rows(prompts, completions, adv, tokenizer.pad_id, cfg.device)  # 4. (B, T) tensors
    logp = token_logprobs(policy, rows, cfg.temperature)  # (B, T), with gradient
    ref_logp = None
    if reference is not None:
        with torch.no_grad():
            ref_logp = token_logprobs(reference, rows, cfg.temperature)  # (B, T) under the starting model
    loss, ratio, kl = grpo_loss(logp, ref_logp, rows, cfg)  # 5. a scalar
    loss.backward()
    params = [p for p in policy.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)  # 6. the norm before clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    made = dict(prompts=prompts, completions=completions, texts=texts, rewards=rewards, adv=adv, rows=rows)
    return made | dict(logp=logp.detach(), ratio=ratio, kl=kl, loss=loss.item(), grad_norm=grad_norm.item())


def setup(cfg: Config) -> tuple:
    """The policy (and with beta > 0 its frozen starting copy, the reference), the tokenizer, the task, AdamW."""
    policy = load_model(cfg.model, dtype=torch.float32, device=cfg.device)
    reference = load_model(cfg.model, device=cfg.device).requires_grad_(False) if cfg.beta > 0 else None
    tokenizer, task = load_tokenizer(cfg.model), get_task(cfg.task, cfg.data or None)
    # betas (0.9, 0.99), no weight decay, fused: train.py's AdamW (fused = one kernel over all parameters)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    return policy, reference, tokenizer, task, optimizer


def main(cfg: Config) -> tuple[list[dict], Transformer]:
    """cfg.max_steps steps; prints one line per step. Returns each step's loss, mean reward, accuracy and gradient
    norm, and the trained policy."""
    policy, reference, tokenizer, task, optimizer = setup(cfg)
    P, K = cfg.prompts_per_step, cfg.group_size
    pool = task.train(cfg.max_steps * P, cfg.seed)  # the data order: step s uses pool[s*P .. s*P + P-1]
    log = []
    for s in range(cfg.max_steps):
        examples, seeds = pool[s * P : (s + 1) * P], [derive_seed(cfg.seed, s, i) for i in range(P)]
        made = step(policy, reference, optimizer, tokenizer, task, examples, seeds, cfg)
        correct = [task.correct(text, examples[i // K]) for i, text in enumerate(made["texts"])]
        reward, kl = made["rewards"], (made["rows"].weight * made["kl"]).sum().item()  # kl: the loss's mean
        row = dict(step=s + 1, loss=made["loss"], reward=float(reward.sum()) / reward.numel())
        row |= dict(accuracy=sum(correct) / len(correct), kl=kl, grad_norm=made["grad_norm"])
        log.append(row)
        print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if cfg.out:
        save_model(policy, cfg.out, tokenizer_dir=cfg.model)
    return log, policy


if __name__ == "__main__":
    with user_errors():
        config, _ = parse_config(Config, description=__doc__.split("\n\n")[0])
        main(replace(config, model=bundled(config.model)))
