"""train.py: RL for LLM reasoning, one readable loop.

    python train.py                                   # bundled default: GRPO-MA, synthetic task, CPU
    python train.py --algo grpo --model PATH --task gsm8k --data gsm8k.jsonl --device cuda
    torchrun --nproc_per_node 8 train.py --algo dapo ...   # DDP over 8 GPUs (gloo on CPU)
    torchrun --nproc_per_node 8 train.py --fsdp ...        # FSDP2: weights, grads, optimizer state sharded

One step, in the order of the code below (the README's numbered algorithm):
  1. sample      K thoughts per prompt, then M answers from each thought (sampler.sample_tree)
  2. score       rewards [P, K, M] from the completion text (the task's reward function)
  3. pack        one row per thought: thought | answer_1 .. answer_M, each thought once (tree attention);
                 each prompt runs once and its K rows attend to it (--no-share-prompt: it heads every row)
  4. score pass  no-grad forward: old log-probs (mu > 1), reference log-probs (beta > 0), entropy
  5. advantages  thought [P, K] and answer [P, K, M] advantages, then per-token adv and weight
  6. update      mu epochs over micro-batches of policy_loss, grad clip, AdamW step
  7. log, eval, save

Every algorithm is a preset (--algo) of the same building blocks, and every block is a flag.
Deliberate simplifications: one optimizer step per epoch over the whole batch (mu = 1 is fully
on-policy); rows of a step are padded to the longest row; evaluation runs on rank 0 only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from advantage import (
    agrae_advantages,
    dynamic_sampling_keep,
    gradient_spike_score,
    grpo_ma_advantages,
    grpo_ma_token_advantages,
    grpo_ma_token_weights,
    gtpo_conflict_weights,
    gtpo_entropy_gate,
    gtpo_entropy_shift,
    overlong_penalty,
    policy_loss,
    token_weights,
    two_grpo_advantages,
)
from cli import parse_config
from eval import decode_completion, evaluate
from model import load_model, load_tokenizer, save_model, token_entropy, token_logprobs
from rewards import score_batch
from sampler import chunk_mask, sample_tree
from tasks import get_task, render_prompt

# -----------------------------------------------------------------------------
# Configuration: the dataclass defaults are plain GRPO; each preset lists what it changes.

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


@dataclass
class TrainConfig:
    algo: str = "grpo_ma"  # preset: grpo | dr_grpo | dapo | gspo | grpo_ma | two_grpo | agrae | gtpo
    model: str = "assets/tiny-model"  # HF checkpoint directory (Qwen2/2.5/3, Llama 2/3.x)
    task: str = "synthetic"  # synthetic | synthetic-hard | countdown | gsm8k | math | code | jsonl
    data: str = ""  # JSONL file for file-based tasks
    out: str = "runs/default"  # output directory: metrics.jsonl, samples.jsonl, step-N/, final/
    resume: str = ""  # run directory or step-N checkpoint to continue from exactly
    seed: int = 0  # seeds every rollout (with step and prompt index) and the data order
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 (bf16 = fp32 weights with bf16 autocast)
    max_steps: int = 200  # RL steps (one batch of prompts each)
    # -- rollouts
    prompts_per_step: int = 16  # P, global over all ranks
    thoughts: int = 16  # K, thoughts per prompt (the GRPO group size G when answers = 1)
    answers: int = 1  # M, answers sampled from each thought (1 = plain GRPO)
    end_of_thought: str = "</think>"  # text marker that ends a thought (used when answers > 1)
    max_thought_tokens: int = 64  # thought length limit; a cut-off thought gets the marker appended
    max_answer_tokens: int = 16  # answer length limit (answers = 1: the completion gets both limits)
    temperature: float = 1.0  # rollout temperature (the trainer divides logits by the same value)
    top_k: int = 0  # rollout top-k (0 = off); truncation makes rollouts slightly off-policy
    top_p: float = 1.0  # rollout nucleus (1 = off)
    # -- rewards and prompts
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens of the limit (0 = off)
    dynamic_sampling: bool = False  # DAPO: replace prompts whose rewards are all equal
    max_resample_rounds: int = 3  # dynamic sampling: top-up rounds before keeping a flat group
    reward_workers: int = 1  # threads scoring rewards in parallel (raise for --task code: sandboxed runs)
    # -- advantages
    advantage: str = "grpo"  # grpo (group normalisation; GRPO-MA when answers > 1) | two_grpo | agrae
    std_normalize: bool = True  # divide by the group std (off = Dr. GRPO / GTPO centring)
    agrae_alpha: float = 1.0  # A-GRAE: positive advantages times min(1, batch accuracy / alpha)
    gtpo_conflict: bool = False  # GTPO: reweight tokens shared by positive and negative completions
    gtpo_w_pos: float = 2.0  # GTPO weight on conflict tokens of positive completions
    gtpo_w_neg: float = 0.0  # GTPO weight on conflict tokens of negative completions
    entropy_gate: bool = False  # GTPO: drop completions whose mean entropy exceeds the threshold
    entropy_threshold: float = 0.6931471805599453  # GTPO gate threshold in nats (ln 2)
    entropy_gamma: float = 0.0  # GTPO: advantage minus gamma * mean token entropy (0 = off)
    # -- loss
    aggregation: str = (
        "seq_mean_token_mean"  # seq_mean_token_mean (GRPO) | token_mean (DAPO) | seq_mean_token_sum_norm (Dr. GRPO)
    )
    thought_weight: float = 1.0  # GRPO-MA: weight of the mean thought loss
    answer_weight: float = 1.0  # GRPO-MA: weight of the mean answer loss
    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.2  # ratio clip above 1 + clip_high (DAPO clip-higher: 0.28)
    sequence_ratio: bool = False  # GSPO: one length-normalised ratio per sequence
    beta: float = 0.0  # KL penalty to the starting model (k3 estimator); > 0 loads a reference copy
    mu: int = 1  # optimisation epochs over each batch (old log-probs from a scoring pass when > 1)
    # -- optimisation
    lr: float = 3e-4  # AdamW learning rate (tiny model; about 1e-6 for 0.5B-7B models)
    warmup_steps: int = 5  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "cosine"  # cosine (decay to 10% of --lr at the last step) | constant
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this value
    micro_batch_rows: int = 64  # rows (thoughts) per forward/backward; changes memory, not the gradient
    share_prompt: bool = (
        True  # run each prompt once; its K thought rows attend to its keys/values (same gradient, less work)
    )
    gradient_checkpointing: bool = False  # recompute layer activations in backward to save memory
    fsdp: bool = (
        False  # under torchrun: shard weights, grads, optimizer state with FSDP2 (sampling gathers whole weights)
    )
    max_bad_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient
    # -- logging, evaluation, checkpoints
    eval_every: int = 20  # evaluate held-out accuracy every N steps (0 = only at the start and end)
    eval_examples: int = 200  # held-out prompts per evaluation
    eval_samples: int = 4  # samples per held-out prompt for mean@n and pass@k
    save_every: int = 0  # write OUT/step-N every N steps (0 = never; OUT/final is always written)
    samples_every: int = 10  # append decoded rollouts to OUT/samples.jsonl every N steps
    wandb: str = ""  # wandb project name (empty = off; needs the wandb package)

    def __post_init__(self) -> None:
        """Validate, never rewrite: an impossible combination is one clear sentence."""
        checks = [
            (self.algo in PRESETS, f"--algo must be one of {', '.join(PRESETS)}"),
            (self.aggregation in AGGREGATIONS, f"--aggregation must be one of {', '.join(AGGREGATIONS)}"),
            (self.lr_schedule in ("cosine", "constant"), "--lr-schedule must be cosine or constant"),
            (self.advantage in ("grpo", "two_grpo", "agrae"), "--advantage must be grpo, two_grpo or agrae"),
            (
                self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
                "--device must be auto, cpu or cuda",
            ),
            (self.dtype in ("auto", "float32", "bfloat16"), "--dtype must be auto, float32 or bfloat16"),
            (
                self.prompts_per_step >= 1 and self.thoughts >= 1 and self.answers >= 1,
                "--prompts-per-step, --thoughts and --answers must be >= 1",
            ),
            (self.thoughts * self.answers >= 2, "a group needs at least 2 samples: raise --thoughts or --answers"),
            (self.temperature > 0, "--temperature must be > 0 for training (0 would make every group identical)"),
            (self.answers == 1 or self.end_of_thought, "--answers > 1 needs an --end-of-thought marker"),
            (
                self.advantage != "two_grpo" or (self.thoughts == 2 and self.answers == 1),
                "--advantage two_grpo needs --thoughts 2 --answers 1",
            ),
            (not self.sequence_ratio or self.answers == 1, "--sequence-ratio (GSPO) needs --answers 1"),
            (
                not (self.gtpo_conflict or self.entropy_gate or self.entropy_gamma) or self.answers == 1,
                "GTPO controls need --answers 1",
            ),
            (self.advantage != "agrae" or self.answers == 1, "--advantage agrae needs --answers 1"),
            (
                self.answers == 1 or self.aggregation != "seq_mean_token_sum_norm",
                "--aggregation seq_mean_token_sum_norm needs --answers 1",
            ),
            (self.clip_low > 0 and self.clip_high > 0, "--clip-low and --clip-high must be > 0"),
            (
                self.mu >= 1 and self.micro_batch_rows >= 1 and self.max_steps >= 0,
                "--mu and --micro-batch-rows must be >= 1",
            ),
            (self.lr > 0 and self.beta >= 0 and self.grad_clip > 0, "--lr and --grad-clip must be > 0 and --beta >= 0"),
            (
                self.overlong_buffer < self.max_thought_tokens + self.max_answer_tokens,
                "--overlong-buffer must be shorter than the completion limit",
            ),
            (
                not (self.resume and os.path.abspath(self.resume) == os.path.abspath(self.model)),
                "--resume and --model name the same directory",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


PRESETS: dict[str, dict] = {
    "grpo": {},
    "dr_grpo": dict(std_normalize=False, aggregation="seq_mean_token_sum_norm"),
    "dapo": dict(clip_high=0.28, aggregation="token_mean", dynamic_sampling=True, overlong_buffer=16),
    "gspo": dict(sequence_ratio=True, clip_low=3e-4, clip_high=4e-4, mu=2),
    "grpo_ma": dict(thoughts=4, answers=4),
    # 2-GRPO's recipe against 16-GRPO: same rollouts per step (prompts x8) and learning rate x8.
    "two_grpo": dict(
        thoughts=2,
        advantage="two_grpo",
        prompts_per_step=8 * TrainConfig.prompts_per_step,
        lr=8 * TrainConfig.lr,
        clip_high=0.28,
    ),
    "agrae": dict(advantage="agrae"),
    "gtpo": dict(std_normalize=False, gtpo_conflict=True, entropy_gate=True, entropy_gamma=0.1),
}

# -----------------------------------------------------------------------------
# Small helpers: seeds, data order, distributed setup


def derive_seed(*parts: int) -> int:
    """A seed from (seed, step, global prompt index, ...): the same global batch gives the same
    rollouts whatever the world size or batch composition."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def lr_factor(opt_step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then constant or a cosine decay to 10% at the last optimizer step."""
    warm = min(1.0, (opt_step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_schedule == "constant":
        return warm
    progress = min(1.0, opt_step / max(1, cfg.max_steps * cfg.mu - 1))
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    want_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device")
    device = torch.device("cpu")
    if want_cuda:
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else torch.cuda.current_device()
        )
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if want_cuda else "gloo")
        if cfg.prompts_per_step % world:
            raise SystemExit(f"--prompts-per-step {cfg.prompts_per_step} must divide evenly over {world} ranks")
    return rank, world, device


def all_sum(x: float | torch.Tensor, world: int) -> torch.Tensor:
    """Sum over ranks (a no-op in one process); used for every global normaliser."""
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    if world > 1:
        t = t.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
    return t.cpu()


@contextlib.contextmanager
def full_params(policy: torch.nn.Module, fsdp: bool):
    """FSDP: all-gather every parameter once, on every rank, and keep it whole until the block ends.

    Sampling runs a number of forwards that depends on each rank's data (rows stop at different
    steps, dynamic sampling redoes some prompts) and evaluation runs on rank 0 only, so FSDP's
    all-gather per forward would leave the ranks out of step and hang. Inside the block a forward
    does no collectives: FSDP2's pre-forward unshard is a no-op on an already unsharded group, and
    reshard-after-forward is off. Every rank must enter the block (the all-gathers happen here).
    Without FSDP it does nothing."""
    if not fsdp:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in policy.modules() if isinstance(m, FSDPModule)]  # each layer and the root
    for m in groups:
        m.unshard()  # not recursive: one call per fully_shard'ed module
    policy.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in groups:  # back to fully_shard's defaults: layers reshard after forward, the root does not
            m.set_reshard_after_forward(m is not policy, recurse=False)
            m.reshard()


def gather_full_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """FSDP: full (unsharded) model and optimizer state dicts, on CPU, on rank 0 (empty on the other
    ranks); the optimizer's is keyed by parameter name. Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# -----------------------------------------------------------------------------
# Step 3: pack a tree of rollouts into training rows


@dataclass
class Batch:
    """A step's rollouts in two layouts, both one row per thought.

    Logical: its completion tokens thought | answer_1 .. answer_M from column 0, right-padded to T.
    The advantages, weights and masks of the loss live here.
    Packed, what the model runs on: prompt | thought | answer_1 | ... | answer_M, the thought once,
    with tree attention (an answer sees the prompt, the thought and itself, not the other answers)
    and RoPE positions as if each answer's sequence stood alone. With --share-prompt the prompt is
    not in the row: each distinct prompt is run once (prompt_ids) and the rows of its K thoughts
    attend to its keys and values, so gradients still reach it. token_stats maps packed log-probs
    to logical positions.
    """

    ids: torch.Tensor  # (B, T) completion token ids, logical
    thought: torch.Tensor  # (B, T) bool: thought tokens (trained once, with the thought advantage)
    answer_id: torch.Tensor  # (B, T) long: j for tokens of answer j, -1 elsewhere
    sampler_logp: torch.Tensor  # (B, T) float32: log-probs reported by the sampler
    packed_ids: torch.Tensor  # (B, T') token ids
    packed_pos: torch.Tensor  # (B, T') RoPE positions
    packed_attn: torch.Tensor | None  # (B, 1, T', T') bool tree attention within the row; None = plain causal
    jumps: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (row, token, source slot) of segments not predicted
    # by the token before them: answer j > 0 (its thought's end), and with shared prompts a row's first
    # token (source -1: the prompt's last token, in the prompt pass)
    to_logical: torch.Tensor  # (B, T') long: b * T + t of the logical token at this slot, -1 = none (prompt, padding)
    prompt_ids: torch.Tensor | None = None  # (P, Lp) left-padded shared prompts (--share-prompt), else None
    prompt_valid: torch.Tensor | None = None  # (P, Lp) bool: not padding
    prompt_of: torch.Tensor | None = None  # (B,) long: the prompt_ids row each packed row continues


def pack(
    prompts: list[list[int]], tree, k: int, m: int, pad_id: int, device: torch.device, share_prompt: bool = False
) -> Batch:
    """Build the packed rows segment by segment (prompt unless shared, thought, each answer); each
    segment records its logical position and the slot that predicts its first token. The logical
    layout is then a scatter of the packed one."""
    B = len(tree.thoughts)
    T = max(len(tree.thoughts[b]) + sum(map(len, tree.answers[b * m : (b + 1) * m])) for b in range(B))
    packs = []  # per packed row: ids, positions, answer index (-1 none), sampler log-prob, logical index, jumps
    for b in range(B):
        prompt = prompts[b // k]
        lead = [] if share_prompt else list(prompt)  # the prompt tokens this row runs itself
        row = (lead, list(range(len(lead))), [-1] * len(lead), [0.0] * len(lead), [-1] * len(lead), [])

        def add(tokens: list[int], logprobs: list[float], start_pos: int, j: int, logical: int, source: int) -> None:
            ids, pos, ans, lp, to, jumps = row
            if tokens and (source != len(ids) - 1 or source < 0):  # predicted from elsewhere than the slot before
                jumps.append((len(ids), source))
            ids += tokens
            pos += range(start_pos, start_pos + len(tokens))
            ans += [j] * len(tokens)
            lp += logprobs
            to += range(logical, logical + len(tokens))

        thought, n = tree.thoughts[b], len(prompt)
        add(thought, list(tree.thought_logprobs[b]), n, -1, b * T, len(lead) - 1)
        source, col = len(row[0]) - 1, len(thought)  # the slot that predicts each answer's first token
        for j in range(m):
            a = tree.answers[b * m + j]
            add(a, list(tree.answer_logprobs[b * m + j]), n + len(thought), j, b * T + col, source)
            col += len(a)
        packs.append(row)
    Tp = max(len(p[0]) for p in packs)

    def packed(field: int, fill, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((B, Tp), fill, dtype=dtype)
        for r, p in enumerate(packs):
            out[r, : len(p[field])] = torch.tensor(p[field], dtype=dtype)
        return out

    ids, pos, ans = (packed(f, fill, torch.long) for f, fill in ((0, pad_id), (1, 0), (2, -1)))
    lp, to_logical = packed(3, 0.0, torch.float32), packed(4, -1, torch.long)
    used = to_logical >= 0

    def logical(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.full((B * T,), fill, dtype=x.dtype).index_put_((to_logical[used],), x[used]).view(B, T)

    attn = None
    if m > 1:  # tree attention: causal, and an answer token sees no other answer's tokens
        causal = torch.ones(Tp, Tp, dtype=torch.bool).tril()
        attn = (causal & ((ans[:, None, :] == -1) | (ans[:, None, :] == ans[:, :, None])))[:, None].to(device)
    jumps = tuple(
        torch.tensor([(r, t, src) for r, p in enumerate(packs) for t, src in p[5]], dtype=torch.long)
        .view(-1, 3)
        .T.to(device)
    )
    batch = Batch(
        logical(ids, pad_id).to(device),
        logical(used & (ans == -1), False).to(device),
        logical(ans, -1).to(device),
        logical(lp, 0.0).to(device),
        ids.to(device),
        pos.to(device),
        attn,
        jumps,
        to_logical.to(device),
    )
    if share_prompt:
        Lp = max(map(len, prompts))
        batch.prompt_ids = torch.tensor([[pad_id] * (Lp - len(p)) + p for p in prompts], device=device)
        batch.prompt_valid = (
            torch.arange(Lp, device=device) >= torch.tensor([Lp - len(p) for p in prompts], device=device)[:, None]
        )
        batch.prompt_of = torch.arange(B, device=device) // k
    return batch


def splice_tree(tree, i: int, new, j: int, k: int, m: int) -> None:
    """Put prompt j's rollouts of `new` in place of prompt i's rollouts of `tree` (dynamic sampling)."""
    for name, per_prompt in (
        ("thoughts", k),
        ("thought_logprobs", k),
        ("thought_truncated", k),
        ("answers", k * m),
        ("answer_logprobs", k * m),
        ("answer_finish", k * m),
    ):
        getattr(tree, name)[i * per_prompt : (i + 1) * per_prompt] = getattr(new, name)[
            j * per_prompt : (j + 1) * per_prompt
        ]


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """A micro-batch: the rows `rows` (long indices), trimmed to their longest packed row (and, with
    shared prompts, to the prompts they continue, trimmed to the longest); jumps and indices re-based."""
    B, T = batch.ids.shape
    new = torch.full((B,), -1, dtype=torch.long, device=rows.device).index_put_(
        (rows,), torch.arange(len(rows), device=rows.device)
    )
    width = int((batch.to_logical[rows] >= 0).nonzero()[:, 1].max()) + 1  # a packed row ends with a completion token
    jb, jt, js = batch.jumps
    keep = new[jb] >= 0
    to_logical = batch.to_logical[rows, :width]
    mb = Batch(
        batch.ids[rows],
        batch.thought[rows],
        batch.answer_id[rows],
        batch.sampler_logp[rows],
        batch.packed_ids[rows, :width],
        batch.packed_pos[rows, :width],
        None if batch.packed_attn is None else batch.packed_attn[rows, :, :width, :width],
        (new[jb[keep]], jt[keep], js[keep]),
        torch.where(to_logical >= 0, new[to_logical // T] * T + to_logical % T, -1),
    )
    if batch.prompt_ids is not None:
        prompts, mb.prompt_of = torch.unique(batch.prompt_of[rows], return_inverse=True)
        valid = batch.prompt_valid[prompts]
        Lp = int(valid.sum(1).max())  # left padding: keep the last Lp columns
        mb.prompt_ids, mb.prompt_valid = batch.prompt_ids[prompts, -Lp:], valid[:, -Lp:]
    return mb


def split_rows(batch: Batch, size: int) -> list[torch.Tensor]:
    """Rows sorted by packed length, cut into micro-batches of `size`: rows of similar length run
    together, so little compute goes to padding. The update is a sum over rows: order is free."""
    length = torch.where(
        batch.to_logical >= 0, torch.arange(batch.to_logical.shape[1], device=batch.ids.device) + 1, 0
    ).amax(1)
    order = torch.argsort(length, stable=True)
    return list(order.split(size))


class PromptKV:
    """KV-cache stand-in for the shared-prompt forward: records each layer's keys/values of the
    prompts (keeping their autograd graph); `rows(prompt_of)` then serves the completion rows,
    prepending their prompt's keys/values to their own."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v

    def rows(self, prompt_of: torch.Tensor) -> PromptRows:
        return PromptRows(self, prompt_of)


@dataclass
class PromptRows:
    prompts: PromptKV
    prompt_of: torch.Tensor

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pk, pv = self.prompts.k[layer_idx][self.prompt_of], self.prompts.v[layer_idx][self.prompt_of]
        return torch.cat([pk, k], 2), torch.cat([pv, v], 2)


def token_stats(
    model, batch: Batch, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and optionally entropy) of every completion token under `model`, (B, T) float32 in
    the logical layout (0 at prompt and padding positions).

    The model runs on the packed rows. Token t is predicted by the logits at t - 1, except the first
    token of a segment that does not follow its predecessor (the `jumps`: answer j > 0 is predicted
    from its thought's end, a row's first token from its shared prompt's end)."""
    ids, first = batch.packed_ids, None
    if batch.prompt_ids is None:
        logits = model(ids, positions=batch.packed_pos, attn_mask=batch.packed_attn)  # (B, T', V)
    else:  # 1. each prompt once, recording its keys/values  2. the rows, attending to their prompt's
        prompts, valid, of = PromptKV(), batch.prompt_valid, batch.prompt_of
        Lp, Tp = valid.shape[1], ids.shape[1]
        # DDP: the prompt pass runs on the wrapped module, so the wrapper sees one forward per backward.
        # Its logits predict each row's token 0; that use also keeps every layer's output in the
        # backward graph, which FSDP2 needs (it re-gathers a layer's weights when its output's gradient arrives).
        first = getattr(model, "module", model)(
            batch.prompt_ids,
            positions=(valid.cumsum(1) - 1).clamp(min=0),
            cache=prompts,
            attn_mask=chunk_mask(valid, Lp),
            logits_to_keep=1,
        )[of, 0]  # (B, V)
        own = (
            batch.packed_attn
            if batch.packed_attn is not None
            else torch.ones(Tp, Tp, dtype=torch.bool, device=ids.device).tril().expand(len(ids), 1, Tp, Tp)
        )
        mask = torch.cat([valid[of][:, None, None, :].expand(-1, 1, Tp, Lp), own], 3)  # (B, 1, T', Lp + T')
        logits = model(ids, positions=batch.packed_pos, cache=prompts.rows(of), attn_mask=mask)

    jb, jt, js = batch.jumps
    at_jumps = logits[jb, js.clamp(min=0)]  # the logits that predict each jump's token
    if first is not None:
        at_jumps = torch.where((js >= 0)[:, None], at_jumps, first[jb])
    logp = F.pad(token_logprobs(logits[:, :-1], ids[:, 1:], temperature), (1, 0))
    if len(jb):
        logp = logp.index_put((jb, jt), token_logprobs(at_jumps, ids[jb, jt], temperature))
    ent = None
    if entropy:
        with torch.no_grad():
            ent = F.pad(token_entropy(logits[:, :-1].detach(), temperature), (1, 0))
            if len(jb):
                ent[jb, jt] = token_entropy(at_jumps.detach(), temperature)
    used = batch.to_logical >= 0
    index, shape = (batch.to_logical[used],), batch.ids.shape

    def to_logical(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(shape.numel()).index_put(index, x[used]).view(shape)

    return to_logical(logp), None if ent is None else to_logical(ent)


# -----------------------------------------------------------------------------
# Checkpoints: HF layout (loadable by load_model and transformers) + trainer state, written atomically


def save_checkpoint(path: str, model, tokenizer_dir: str, state: dict, weights: dict | None = None) -> None:
    """weights: the full state dict when the model's own parameters are sharded (FSDP)."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp, tokenizer_dir=tokenizer_dir, state_dict=weights)
    torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)  # a run killed before this line leaves the previous checkpoint intact


def find_checkpoint(path: str) -> str:
    """`path` itself if it is a complete checkpoint, else its newest complete step-N."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    steps = (
        [d for d in os.listdir(path) if d.startswith("step-") and not d.endswith(".tmp")] if os.path.isdir(path) else []
    )
    steps = [d for d in steps if os.path.isfile(os.path.join(path, d, "trainer_state.pt"))]
    if not steps:
        raise SystemExit(f"--resume {path}: no complete checkpoint (a directory with trainer_state.pt) found")
    return os.path.join(path, max(steps, key=lambda d: int(d.split("-")[1])))


# -----------------------------------------------------------------------------
# The loop


def main(cfg: TrainConfig) -> dict:
    rank, world, device = setup_distributed(cfg)
    main_proc = rank == 0
    torch.manual_seed(cfg.seed)
    autocast_dtype = (
        torch.bfloat16 if (cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")) else None
    )

    resume_dir = find_checkpoint(cfg.resume) if cfg.resume else ""
    policy = load_model(resume_dir or cfg.model, dtype=torch.float32, device=device)
    policy.gradient_checkpointing = cfg.gradient_checkpointing
    tokenizer = load_tokenizer(cfg.model)
    reference = (
        load_model(cfg.model, dtype=torch.float32, device=device).requires_grad_(False) if cfg.beta > 0 else None
    )
    task = get_task(cfg.task, cfg.data or None)
    # The data order: a deterministic stream of training examples (prefix-stable in --max-steps),
    # and a second one for dynamic-sampling top-ups.
    pool = task.train(cfg.max_steps * cfg.prompts_per_step, cfg.seed)
    topups = (
        task.train(cfg.max_steps * cfg.prompts_per_step * cfg.max_resample_rounds, derive_seed(cfg.seed, 1))
        if cfg.dynamic_sampling
        else []
    )
    heldout = task.test(cfg.eval_examples, cfg.seed)
    marker = tokenizer.encode(cfg.end_of_thought) if cfg.answers > 1 else []

    model, fsdp = policy, world > 1 and cfg.fsdp
    if fsdp:  # each layer is one all-gather unit; the root holds the rest (embedding = tied lm_head, norm)
        from torch.distributed.fsdp import fully_shard

        for layer in policy.model.layers:
            fully_shard(layer)
        fully_shard(policy)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            policy, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    # Trainer state beyond weights and optimizer: everything the next step depends on.
    state = dict(step=0, grad_norms=[], bad_steps=0, skipped_steps=0, gate_on=None)
    if resume_dir:
        saved = torch.load(os.path.join(resume_dir, "trainer_state.pt"), weights_only=False)
        if fsdp != isinstance(saved["optimizer"]["param_groups"][0]["params"][0], str):
            raise SystemExit(
                f"--resume {resume_dir}: its optimizer state was saved {'without' if fsdp else 'with'} "
                f"--fsdp under torchrun; resume it the same way (with --fsdp any world size works)"
            )
        if fsdp:  # full, keyed by parameter name (gather_full_state); each rank keeps its own shard
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                policy, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True)
            )
        else:
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = saved["trainer"]
    if main_proc:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
    wandb_run = None
    if cfg.wandb and main_proc:
        import wandb  # optional extra

        wandb_run = wandb.init(project=cfg.wandb, config=asdict(cfg))

    def log(row: dict, file: str = "metrics.jsonl") -> None:
        """One logging call: metrics.jsonl (+ wandb) on rank 0."""
        if main_proc:
            with open(os.path.join(cfg.out, file), "a") as f:
                f.write(json.dumps(row) + "\n")
            if wandb_run is not None and file == "metrics.jsonl":
                wandb_run.log(row, step=row["step"])

    def run_eval(step: int) -> dict:
        with full_params(policy, fsdp):  # FSDP: every rank gathers, then rank 0 alone runs forwards
            if not main_proc:
                return {}
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                res = evaluate(
                    policy,
                    tokenizer,
                    task,
                    heldout,
                    n=cfg.eval_samples,
                    max_new_tokens=cfg.max_thought_tokens + cfg.max_answer_tokens,
                    temperature=cfg.temperature,
                    seed=derive_seed(cfg.seed, 10**9),
                )
        row = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
        log(row)
        return row

    def checkpoint(path: str) -> None:
        weights, optim = gather_full_state(policy, optimizer) if fsdp else (None, optimizer.state_dict())
        if main_proc:
            save_checkpoint(
                path,
                policy,
                cfg.model,
                dict(optimizer=optim, scheduler=scheduler.state_dict(), trainer=state, config=asdict(cfg)),
                weights=weights,
            )
        if world > 1:
            dist.barrier()

    P_local, K, M = cfg.prompts_per_step // world, cfg.thoughts, cfg.answers
    first_eval = run_eval(state["step"]) if state["step"] == 0 else {}
    bar = tqdm(range(state["step"], cfg.max_steps), disable=not main_proc, desc="train", dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        # ---- 1. sample: K thoughts x M answers for this rank's share of the global batch
        slots = [rank * P_local + i for i in range(P_local)]  # global prompt slots of this rank
        examples = [pool[step * cfg.prompts_per_step + s] for s in slots]

        def rollout(exs: list[dict], seeds: list[int]):
            prompts = [render_prompt(tokenizer, ex, task.system_prompt) for ex in exs]
            with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                tree = sample_tree(
                    policy,
                    prompts,
                    k=K,
                    m=M,
                    max_thought_tokens=cfg.max_thought_tokens if M > 1 else 0,
                    max_answer_tokens=cfg.max_answer_tokens + (0 if M > 1 else cfg.max_thought_tokens),
                    end_of_thought=marker,
                    temperature=cfg.temperature,
                    top_k=cfg.top_k,
                    top_p=cfg.top_p,
                    stop_ids=tokenizer.stop_ids,
                    seed=seeds,
                )
            return prompts, tree

        # ---- 2. score: rewards [P, K, M] from the text of thought + answer
        def score(exs: list[dict], tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            texts, lengths, exs_flat = [], [], []
            for a, ans in enumerate(tree.answers):
                thought = tree.thoughts[a // M]
                texts.append(decode_completion(tokenizer, thought + ans))
                lengths.append(len(thought) + len(ans))
                exs_flat.append(exs[a // (K * M)])
            reward = torch.tensor(
                score_batch(task.reward, texts, exs_flat, max_workers=cfg.reward_workers), dtype=torch.float32
            )
            correct = torch.tensor([task.correct(t, e) for t, e in zip(texts, exs_flat)], dtype=torch.float32)
            lengths = torch.tensor(lengths)
            if cfg.overlong_buffer:
                reward = reward + overlong_penalty(
                    lengths, cfg.max_thought_tokens + cfg.max_answer_tokens, cfg.overlong_buffer
                )
            return reward.view(-1, K, M), correct.view(-1, K, M), lengths.view(-1, K, M)

        with full_params(policy, fsdp):  # FSDP: whole weights while ranks run different numbers of forwards
            seeds = [derive_seed(cfg.seed, step, s) for s in slots]
            prompts, tree = rollout(examples, seeds)
            t_sample = time.perf_counter() - t0
            reward, correct, lengths = score(examples, tree)
            batch_accuracy = (
                all_sum(correct.mean(dim=(1, 2)).sum(), world) / cfg.prompts_per_step
            ).item()  # before any top-up
            n_resampled = 0
            if cfg.dynamic_sampling:  # DAPO: replace prompts whose K*M rewards are all equal, slot by slot
                for rnd in range(1, cfg.max_resample_rounds + 1):
                    flat = ~dynamic_sampling_keep(reward.view(P_local, -1))
                    if not flat.any():
                        break
                    redo = flat.nonzero().flatten().tolist()
                    new_ex = [
                        topups[(step * cfg.prompts_per_step + slots[i]) * cfg.max_resample_rounds + rnd - 1]
                        for i in redo
                    ]
                    new_prompts, new_tree = rollout(
                        new_ex, [derive_seed(cfg.seed, step, slots[i], rnd, 1) for i in redo]
                    )
                    new_r, new_c, new_l = score(new_ex, new_tree)
                    for j, i in enumerate(redo):
                        examples[i], prompts[i] = new_ex[j], new_prompts[j]
                        reward[i], correct[i], lengths[i] = new_r[j], new_c[j], new_l[j]
                        splice_tree(tree, i, new_tree, j, K, M)
                    n_resampled += len(redo)
        t_score = time.perf_counter() - t0 - t_sample

        # ---- 3. pack: one row per thought, its tokens once (answers share it by tree attention); prompts once with --share-prompt
        batch = pack(prompts, tree, K, M, tokenizer.pad_id, device, share_prompt=cfg.share_prompt)
        completion = batch.thought | (batch.answer_id >= 0)
        n_rows = batch.ids.shape[0]
        micro = split_rows(batch, cfg.micro_batch_rows)
        micro_batches = [select_rows(batch, rows) for rows in micro]  # built once: score pass and every epoch

        # ---- 4. score pass (no grad): old log-probs, reference log-probs, entropy
        need_old, need_ent = cfg.mu > 1, cfg.entropy_gate or cfg.entropy_gamma > 0
        old_logp = torch.zeros(batch.ids.shape, device=device)
        ref_logp = torch.zeros(batch.ids.shape, device=device) if reference is not None else None
        entropy = torch.zeros(batch.ids.shape, device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            for rows, mb in zip(micro, micro_batches):
                if need_old or need_ent:
                    old_logp[rows], entropy[rows] = token_stats(policy, mb, cfg.temperature, entropy=True)
                if reference is not None:
                    ref_logp[rows] = token_stats(reference, mb, cfg.temperature)[0]

        # ---- 5. advantages: per sequence, then per token adv and weight for the whole step
        group = reward.view(P_local, K * M)
        adv_thought, adv_answer = grpo_ma_advantages(reward, std_normalize=cfg.std_normalize)  # = GRPO when M == 1
        if cfg.advantage == "two_grpo":
            adv_answer = two_grpo_advantages(group).view(P_local, K, M)
        elif cfg.advantage == "agrae":
            adv_answer = agrae_advantages(
                group,
                correct=correct.view(P_local, -1),
                alpha=cfg.agrae_alpha,
                batch_accuracy=batch_accuracy,
                std_normalize=cfg.std_normalize,
            ).view(P_local, K, M)
        seq_adv = adv_answer.flatten()  # (P*K*M,) = one per row when M == 1
        seq_mask = completion.float()
        if need_ent:  # GTPO entropy control (rows are completions: M == 1)
            keep, mean_ent = gtpo_entropy_gate(
                entropy, seq_mask, threshold=cfg.entropy_threshold, enabled=cfg.entropy_gate
            )
            if state["gate_on"] is None:  # decided once: off if the starting policy is already above the threshold
                state["gate_on"] = bool(
                    all_sum(mean_ent.sum(), world) / all_sum(len(mean_ent), world) <= cfg.entropy_threshold
                )
            keep = keep | (not state["gate_on"])
            seq_adv = torch.where(keep.cpu(), gtpo_entropy_shift(seq_adv, mean_ent.cpu(), gamma=cfg.entropy_gamma), 0.0)
        if cfg.dynamic_sampling:  # groups still flat after the top-ups are dropped from the loss
            kept_rows = dynamic_sampling_keep(group).repeat_interleave(K).to(device)
            completion = completion & kept_rows[:, None]
        # Thought tokens carry their thought's advantage, answer tokens their own answer's.
        adv = grpo_ma_token_advantages(
            adv_thought.to(device), seq_adv.view(P_local, K, M).to(device), batch.thought, batch.answer_id
        )
        # The loss normaliser covers the WHOLE global step, so micro-batches and ranks cannot change it.
        comp = completion.float()
        if M > 1 and cfg.aggregation == "seq_mean_token_mean":
            weight = grpo_ma_token_weights(
                batch.thought & completion,
                torch.where(completion, batch.answer_id, -1),
                thought_weight=cfg.thought_weight,
                answer_weight=cfg.answer_weight,
                num_thoughts=all_sum(n_rows, world).item(),
                num_answers=all_sum(n_rows * M, world).item(),
            )
        else:
            weight = token_weights(
                comp,
                cfg.aggregation,
                max_len=cfg.max_thought_tokens + cfg.max_answer_tokens,
                num_seqs=all_sum(n_rows, world).item(),
                num_tokens=all_sum(comp.sum(), world).item(),
            )
        if cfg.gtpo_conflict:  # logical rows are the completions (M == 1), compared position by position
            weight = weight * gtpo_conflict_weights(
                batch.ids, comp, seq_adv.to(device), K, w_pos=cfg.gtpo_w_pos, w_neg=cfg.gtpo_w_neg
            )

        # ---- 6. update: mu epochs, each one optimizer step over all micro-batches
        t1 = time.perf_counter()
        sums = dict(loss=0.0, clip_frac=0.0, kl=0.0, logp_gap=0.0, entropy=0.0)
        for epoch in range(cfg.mu):
            for i, (rows, mb) in enumerate(zip(micro, micro_batches)):
                sync = i == len(micro) - 1
                ctx = model.no_sync() if (world > 1 and not cfg.fsdp and not sync) else contextlib.nullcontext()
                if fsdp:
                    policy.set_requires_gradient_sync(sync)
                with ctx, torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logp, ent = token_stats(
                        model, mb, cfg.temperature, entropy=(epoch == 0 and not (need_old or need_ent))
                    )
                    old = old_logp[rows] if need_old else logp.detach()
                    loss, metrics = policy_loss(
                        logp,
                        old,
                        adv[rows],
                        weight[rows],
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        ref_logp=None if ref_logp is None else ref_logp[rows],
                        beta=cfg.beta,
                        sequence_ratio=cfg.sequence_ratio,
                    )
                    (loss * world).backward()  # DDP/FSDP average over ranks; our loss is already the global sum
                if epoch == 0:  # diagnostics on the sampling-time parameters, token-weighted
                    mask = completion[rows].float()
                    sums["loss"] += loss.item()
                    sums["clip_frac"] += metrics["clip_frac"] * mask.sum().item()
                    sums["kl"] += metrics.get("kl", 0.0) * mask.sum().item()
                    sums["logp_gap"] += ((logp.detach() - mb.sampler_logp).abs() * mask).sum().item()
                    sums["entropy"] += ((ent if ent is not None else entropy[rows]) * mask).sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            if torch.isfinite(grad_norm) and math.isfinite(sums["loss"]):
                optimizer.step()
                scheduler.step()
                state["bad_steps"] = 0
            else:  # never apply a non-finite update; several in a row end the run
                state["bad_steps"] += 1
                state["skipped_steps"] += 1
                warnings.warn(f"step {step}: non-finite loss or gradient, update skipped")
                if state["bad_steps"] >= cfg.max_bad_steps:
                    raise SystemExit(
                        f"{cfg.max_bad_steps} consecutive non-finite steps at step {step}: lower --lr or check the rewards"
                    )
            optimizer.zero_grad(set_to_none=True)
        t_update = time.perf_counter() - t1
        t_step = time.perf_counter() - t0  # the whole step: sample .. update (eval and save excluded)

        # ---- 7. log, eval, save
        state["step"] = step + 1
        state["grad_norms"].append(grad_norm.item())
        gss, gss10 = gradient_spike_score(state["grad_norms"])
        n_tok = all_sum(completion.sum(), world).item()
        gen_tokens = all_sum(sum(map(len, tree.thoughts)) + sum(map(len, tree.answers)), world).item()
        row = {
            "step": step + 1,
            "reward/mean": (all_sum(reward.sum(), world) / all_sum(reward.numel(), world)).item(),
            "reward/std": reward.std().item(),  # this rank's (rank 0's) rollouts
            "accuracy": (all_sum(correct.sum(), world) / all_sum(correct.numel(), world)).item(),
            "batch_accuracy": batch_accuracy,
            "frac_zero_std_groups": (~dynamic_sampling_keep(group)).float().mean().item(),
            "loss": all_sum(sums["loss"], world).item(),
            "grad_norm": grad_norm.item(),
            "gss": gss[-1].item(),
            "gss10_frac": gss10,
            "clip_frac": all_sum(sums["clip_frac"], world).item() / max(n_tok, 1),
            "kl": all_sum(sums["kl"], world).item() / max(n_tok, 1) if reference is not None else None,
            "entropy": all_sum(sums["entropy"], world).item() / max(n_tok, 1),
            "len/completion_mean": lengths.float().mean().item(),
            "truncated_frac": sum(f == "length" for f in tree.answer_finish) / len(tree.answer_finish),
            "thought_truncated_frac": sum(tree.thought_truncated) / max(len(tree.thought_truncated), 1)
            if M > 1
            else 0.0,
            "logp_gap": all_sum(sums["logp_gap"], world).item() / max(n_tok, 1),
            "resampled": n_resampled,
            "skipped_steps": state["skipped_steps"],
            "lr": scheduler.get_last_lr()[0],
            "time/sample_s": t_sample,
            "time/score_s": t_score,
            "time/update_s": t_update,
            "time/step_s": t_step,
            "tokens/generated": gen_tokens,
            "tokens_per_s": gen_tokens / max(t_sample, 1e-9),
        }
        log(row)
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", acc=f"{row['accuracy']:.3f}", gss=f"{row['gss']:.2f}")
        if cfg.samples_every and (step + 1) % cfg.samples_every == 0:
            for a in range(min(4, len(tree.answers))):
                log(
                    {
                        "step": step + 1,
                        "prompt": examples[a // (K * M)]["prompt"],
                        "completion": decode_completion(tokenizer, tree.thoughts[a // M] + tree.answers[a]),
                        "reward": reward.flatten()[a].item(),
                    },
                    file="samples.jsonl",
                )
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
            run_eval(step + 1)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            checkpoint(os.path.join(cfg.out, f"step-{step + 1}"))
    last_eval = run_eval(cfg.max_steps)
    checkpoint(os.path.join(cfg.out, "final"))
    if world > 1:
        dist.destroy_process_group()
    return {"first_eval": first_eval, "last_eval": last_eval}


if __name__ == "__main__":
    config, _ = parse_config(TrainConfig, description=__doc__.split("\n\n")[0], presets=PRESETS, preset_field="algo")
    main(config)
