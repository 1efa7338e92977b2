"""train.py: RL for LLM reasoning, one readable loop.

    python train.py                                   # bundled default: GRPO-MA, synthetic task, CPU
    python train.py --algo grpo --model PATH --task gsm8k --data gsm8k.jsonl --device cuda
    torchrun --nproc_per_node 8 train.py --algo dapo ...   # DDP over 8 GPUs (gloo on CPU)
    torchrun --nproc_per_node 8 train.py --fsdp ...        # FSDP2: weights, grads, optimizer state sharded

One step is the README's numbered algorithm, one function each, called in this order by main():
  1. sample      K thoughts per prompt, then M answers from each thought (sampler.sample_tree)
  2. score       rewards [P, K, M] from the completion text (the task's reward function);
                 dynamic_sampling (DAPO) re-draws prompts whose rewards are all equal;
                 splice_anchors (DaGRPO, a reconstruction) trains on the reference solution in place of
                 one rollout of each group with no correct one, off-policy
  3. pack        one row per thought: thought | answer_1 .. answer_M, each thought once (tree attention);
                 each prompt runs once and its K rows attend to it (pack.py)
  4. score_pass  no-grad forward: old log-probs (mu > 1), reference log-probs (beta > 0), entropy
  5. advantages  thought [P, K] and answer [P, K, M] advantages, then per-token adv and weight
  6. update      mu epochs over micro-batches of policy_loss, grad clip, AdamW step
  7. log, evaluate, save

Every algorithm is a preset (--algo) of the same building blocks, and every block is a flag.
Deliberate simplifications: one optimizer step per epoch over the whole batch (mu = 1 is fully
on-policy); rows of a micro-batch are padded to its longest row; evaluation runs on rank 0 only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from advantage import (
    AGGREGATIONS,
    SELECTIONS,
    agrae_advantages,
    dynamic_sampling_keep,
    flip_rewards,
    gradient_spike_score,
    grpo_ma_advantages,
    grpo_ma_token_advantages,
    grpo_ma_token_weights,
    gtpo_conflict_weights,
    gtpo_entropy_gate,
    gtpo_entropy_shift,
    noise_corrected_rewards,
    overlong_penalty,
    pairwise_distinct_advantages,
    policy_loss,
    splice_anchor_rewards,
    token_weights,
    truncated_is_weights,
    two_grpo_advantages,
)
from checkpoint import (
    append_row,
    check_out_dir,
    check_resume,
    eval_rows,
    find_checkpoint,
    load_trainer_state,
    lock_run_dir,
    prepare_out,
    read_trainer_step,
    release_run_dir,
    resume_flags,
    save_checkpoint,
    writing,
)
from cli import Stopped, UserError, end_summary, parse_config, start_line, stop_signals, user_errors
from distributed import (
    all_sum,
    check_update,
    fixed_mmap_threshold,
    full_params,
    gather_full_state,
    memory_peak,
    setup_distributed,
    weight_norms,
)
from eval import calibrate_noise, evaluate, select_examples
from hf import load_model
from memory import check_memory
from model import Transformer, cast_copy, copy_weights_
from pack import Batch, pack, select_rows, split_rows, token_stats
from rewards import noise_rates, score_batch
from sampler import StopText, Tree, decode_step_static, sample_tree, splice_tree
from tasks import TASK_NAMES, Task, check_prompt_lengths, check_sizes, get_task, render_prompt
from tokenizer import decode_completion, load_tokenizer

# -----------------------------------------------------------------------------
# Configuration: the dataclass defaults are plain GRPO; each preset lists what it changes.

ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "grpo_ma", "two_grpo", "agrae", "gtpo", "dagrpo")


@dataclass
class TrainConfig:
    # -- run
    algo: str = "grpo_ma"  # preset of the flags below (the flags you type win)
    model: str = "assets/tiny-model"  # HF checkpoint directory (Qwen2/2.5/3, Llama 2/3.x)
    task: str = "synthetic"  # built-in generator or file format (file tasks read --data)
    data: str = ""  # JSONL file for file-based tasks
    test_data: str = ""  # JSONL file of held-out examples (file tasks; default: every 10th example of --data)
    out: str = "runs/default"  # output directory: metrics.jsonl, samples.jsonl, step-N/, final/
    resume: str = ""  # run directory or step-N checkpoint to continue from exactly (its flags are the run's)
    overwrite: bool = False  # replace the run already in --out (otherwise a non-empty --out is refused)
    seed: int = 0  # seeds every rollout (with step and prompt index) and the data order
    device: str = "auto"  # where to run (cuda:N picks a GPU)
    dtype: str = "auto"  # bfloat16 = fp32 weights with bf16 autocast; auto = bf16 on CUDA, fp32 on CPU
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
    system_prompt: str | None = None  # system turn of every prompt, replacing the task's ("" = no system turn)
    enable_thinking: bool = True  # Qwen3 chat template's thinking switch (off: an empty thought is pre-filled)
    compile: bool = False  # decode through torch.compile (CUDA graphs on a GPU; on CPU it takes minutes to compile)
    rollout_dtype: str = "auto"  # sampler and eval weights: a cast copy of the masters; auto = bf16 on CUDA, else fp32
    select: str = ""  # Hard Examples: draw prompts only from the hardest|medium|easiest|random --pass-rates ("" = off)
    select_fraction: float = 0.1  # fraction of the rated examples that --select keeps, in (0, 1] (the paper: 0.1)
    pass_rates: str = ""  # JSONL of the starting model's per-example pass rates (eval.py --pass-rates --out FILE)
    # -- rewards
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens of the limit (0 = off)
    dynamic_sampling: bool = False  # DAPO: replace prompts whose rewards are all equal
    max_resample_rounds: int = 3  # dynamic sampling: top-up rounds before keeping a flat group
    reward_workers: int = 1  # threads scoring rewards in parallel (raise for --task code: sandboxed runs)
    reward_noise: str = ""  # RHO_PLUS,RHO_MINUS: flip 0/1 rewards (wrong->1, right->0) at these rates ("" = off)
    noise_correct: str = ""  # RHO+,RHO-|auto: unbias rewards (with --no-std-normalize: adv. x 1/(1-RHO+-RHO-))
    # -- advantages
    advantage: str = "grpo"  # grpo = group normalisation (GRPO-MA when answers > 1)
    std_normalize: bool = True  # divide by the group std (off = Dr. GRPO / GTPO centring)
    agrae_alpha: float = 1.0  # A-GRAE: positive advantages times min(1, batch accuracy / alpha)
    gtpo_conflict: bool = False  # GTPO: reweight tokens shared by positive and negative completions
    gtpo_w_pos: float = 2.0  # GTPO weight on conflict tokens of positive completions
    gtpo_w_neg: float = 0.0  # GTPO weight on conflict tokens of negative completions
    entropy_gate: bool = False  # GTPO: drop completions whose mean entropy (at --temperature) exceeds the threshold
    entropy_threshold: float = 0.6931471805599453  # GTPO gate threshold in nats (ln 2)
    entropy_gamma: float = 0.0  # GTPO: advantage minus gamma * mean token entropy (0 = off)
    pair_delta: float = -1.0  # DaGRPO pair mask, a RECONSTRUCTION: drop pairs with |credit gap| < DELTA (-1 = off)
    # DaGRPO anchors: the last rollout of a group with no correct one is replaced by the example's reference solution
    # (task.reference; reward 1, top credit), trained off-policy: f(p) * A with f(p) = p / (p + GAMMA), no ratio clip
    anchors: bool = False  # DaGRPO anchors, a RECONSTRUCTION: all-wrong groups train on the reference solution
    anchor_gamma: float = 0.1  # anchor tokens' objective f(p) * A, f(p) = p / (p + GAMMA), unclipped (LUFFY's 0.1)
    # -- loss
    aggregation: str = "seq_mean_token_mean"  # token weights: GRPO | DAPO token mean | Dr. GRPO sum / max length
    thought_weight: float = 1.0  # GRPO-MA: weight of the mean thought loss
    answer_weight: float = 1.0  # GRPO-MA: weight of the mean answer loss
    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.2  # ratio clip above 1 + clip_high (DAPO clip-higher: 0.28)
    sequence_ratio: bool = False  # GSPO: one length-normalised ratio per sequence
    beta: float = 0.0  # KL penalty to the starting model (k3 estimator); > 0 loads a reference copy
    mu: int = 1  # optimisation epochs over each batch (old log-probs from a scoring pass when > 1)
    tis_cap: float = 2.0  # with a --rollout-dtype copy: token losses times min(pi_train / pi_sampler, CAP) (0 = off)
    # -- optimisation
    lr: float = 3e-4  # AdamW learning rate (tiny model; about 1e-6 for 0.5B-7B models)
    warmup_steps: int = 5  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "cosine"  # cosine decays to 10% of --lr at the last step
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this value
    micro_batch_rows: int = 64  # rows (thoughts) per forward/backward; changes memory, not the gradient
    micro_batch_tokens: int = 0  # and at most N padded tokens per forward/backward, shared prompts counted (0 = off)
    share_prompt: bool = True  # run each prompt once, its K rows attend to it (same gradient, less work)
    gradient_checkpointing: bool = False  # recompute layer activations in backward to save memory
    fsdp: bool = False  # under torchrun: shard weights, grads, optimizer state with FSDP2
    optimizer_offload: bool = False  # AdamW state and step in CPU memory (saves 8 bytes/param on GPU); same update
    max_bad_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient
    # -- logging and checkpoints
    eval_every: int = 20  # evaluate held-out accuracy every N steps (0 = only at the start and end)
    eval_examples: int = 200  # held-out prompts per evaluation
    eval_samples: int = 4  # samples per held-out prompt for mean@n and pass@k
    save_every: int = 0  # write OUT/step-N every N steps (0 = never; OUT/final is always written)
    save_optimizer: bool = True  # checkpoints carry the optimizer state (needed to resume; 2x the weights)
    save_dtype: str = "auto"  # dtype of saved weights; auto = the dtype the model was loaded in
    samples_every: int = 10  # append decoded rollouts to OUT/samples.jsonl every N steps
    wandb: str = ""  # wandb project name (empty = off; needs the wandb package)

    # The allowed values of every choice flag (shown by --help) and the bounds of numeric flags.
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = dict(
        algo=ALGOS,
        task=TASK_NAMES,
        device=("auto", "cpu", "cuda", "cuda:N"),
        dtype=("auto", "float32", "bfloat16"),
        advantage=("grpo", "two_grpo", "agrae"),
        aggregation=AGGREGATIONS,
        lr_schedule=("cosine", "constant"),
        save_dtype=("auto", "float32", "bfloat16", "float16"),
        rollout_dtype=("auto", "float32", "bfloat16"),
    )
    AT_LEAST: ClassVar[dict[str, int]] = dict(
        max_steps=1, prompts_per_step=1, thoughts=1, answers=1, max_answer_tokens=1, mu=1, micro_batch_rows=1,
        eval_examples=1, max_resample_rounds=1, reward_workers=1, max_bad_steps=1, max_thought_tokens=0, top_k=0,
        overlong_buffer=0, warmup_steps=0, eval_every=0, eval_samples=0, save_every=0, samples_every=0,
        micro_batch_tokens=0,
    )  # fmt: skip
    POSITIVE: ClassVar[tuple[str, ...]] = (
        "lr", "temperature", "top_p", "clip_low", "clip_high", "grad_clip", "anchor_gamma",
    )  # fmt: skip

    def __post_init__(self) -> None:
        """Validate, never rewrite: an impossible combination is one clear sentence."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        for name, allowed in self.CHOICES.items():
            v = getattr(self, name)
            ok = v in allowed or (name == "device" and v.startswith("cuda:"))
            need(ok, f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {v!r}")
        for name, low in self.AT_LEAST.items():
            need(getattr(self, name) >= low, f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        for name in self.POSITIVE:  # also refuses inf and nan
            need(0 < getattr(self, name) < math.inf, f"--{name.replace('_', '-')} must be > 0 and finite")
        need(self.top_p <= 1, f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")
        need(0 <= self.beta < math.inf and 0 <= self.weight_decay < math.inf, "--beta and --weight-decay must be >= 0")
        need(0 <= self.tis_cap < math.inf, f"--tis-cap must be >= 0 and finite (0 = off), got {self.tis_cap}")
        need(not (self.optimizer_offload and self.fsdp), "--optimizer-offload is for one process or DDP: --fsdp "
             "already shards the optimizer state over the ranks")  # fmt: skip
        need(self.thoughts * self.answers >= 2, "a group needs at least 2 samples: raise --thoughts or --answers")
        need(self.answers == 1 or bool(self.end_of_thought), "--answers > 1 needs an --end-of-thought marker")
        no_thought = "--no-enable-thinking pre-fills an empty thought, leaving none to sample answers from"
        need(self.enable_thinking or self.answers == 1, f"{no_thought}: it needs --answers 1")
        two = self.advantage != "two_grpo" or (self.thoughts, self.answers) == (2, 1)
        need(two, "--advantage two_grpo needs --thoughts 2 --answers 1")
        need(self.select in ("", *SELECTIONS), f"--select must be one of {', '.join(SELECTIONS)} or empty (off)")
        need(0 < self.select_fraction <= 1, f"--select-fraction must be in (0, 1], got {self.select_fraction}")
        need(bool(self.select) == bool(self.pass_rates), "--select and --pass-rates FILE go together")
        noise_rates(self.reward_noise, "--reward-noise")  # a bad RHO_PLUS,RHO_MINUS is a one-sentence ValueError
        noise_rates(self.noise_correct, "--noise-correct", auto=True)
        need(not (self.noise_correct and self.std_normalize), "--noise-correct needs --no-std-normalize (or --algo "
             "dr_grpo): a std normalisation cancels the correction exactly")  # fmt: skip
        pair = 0 <= self.pair_delta < math.inf and self.advantage == "grpo" and self.answers == 1
        need(self.pair_delta == -1 or pair, "--pair-delta must be >= 0 (-1 = off), with --advantage grpo --answers 1")
        one_answer = {
            "--anchors (an anchor is a whole reference completion, not a thought and its answers)": self.anchors,
            "--sequence-ratio (GSPO)": self.sequence_ratio,
            "GTPO controls": self.gtpo_conflict or self.entropy_gate or self.entropy_gamma,
            "--advantage agrae": self.advantage == "agrae",
            "--aggregation seq_mean_token_sum_norm": self.aggregation == "seq_mean_token_sum_norm",
        }
        for what, used in one_answer.items():
            need(not used or self.answers == 1, f"{what} needs --answers 1")
        limit = self.max_thought_tokens + self.max_answer_tokens
        need(self.overlong_buffer < limit, "--overlong-buffer must be shorter than the completion limit")
        same = self.resume and os.path.abspath(self.resume) == os.path.abspath(self.model)
        need(not same, "--resume and --model name the same directory")


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
    ),  # fmt: skip
    "agrae": dict(advantage="agrae"),
    "gtpo": dict(std_normalize=False, gtpo_conflict=True, entropy_gate=True, entropy_gamma=0.1),
    # DaGRPO, a RECONSTRUCTION: Dr. GRPO + the pair mask at the third-party delta 0.1 + reference-solution anchors
    # on groups with no correct rollout, trained with LUFFY's off-policy shaping (gamma 0.1)
    "dagrpo": dict(std_normalize=False, aggregation="seq_mean_token_sum_norm", pair_delta=0.1, anchors=True),
}
assert tuple(PRESETS) == ALGOS


# -----------------------------------------------------------------------------
# Small helpers: seeds and the learning-rate schedule


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


# -----------------------------------------------------------------------------
# Setup: the long-lived objects of a run


@dataclass
class Run:
    """Everything a step needs that outlives the step: a bag of state, passed to each step function."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    autocast: torch.dtype | None  # bf16 autocast (None = plain float32)
    policy: Transformer  # the trained model (its parameters are sharded in place under FSDP)
    model: torch.nn.Module  # what the update runs: the policy, or its DDP wrapper
    fsdp: bool
    reference: Transformer | None  # frozen starting model for the KL penalty (beta > 0)
    tokenizer: object
    task: Task
    pool: list[dict]  # training examples in order: step s, global slot i uses pool[s * P + i]
    topups: list[dict]  # dynamic sampling's replacement prompts, a stream of their own
    heldout: list[dict]
    marker: StopText  # the end-of-thought marker (used when answers > 1)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: dict  # saved with each checkpoint: step, grad_norms, bad_steps, skipped_steps, gate_on
    wandb: object | None = None
    sampler: Transformer | None = None  # what sampling and evaluation run: the policy, or its --rollout-dtype copy
    static_step: Callable | None = None  # --compile: the compiled decode step sampling and evaluation run
    host_params: list[torch.Tensor] | None = None  # --optimizer-offload: the CPU float32 copies AdamW steps
    master_norms: torch.Tensor | None = None  # weight_norms after the last update (weights change only there)


def setup(cfg: TrainConfig) -> Run:
    """Distributed init; then data, output directory and checkpoint are checked before any model is
    loaded; then models, tokenizer, data streams, optimizer and, with --resume, their saved state."""
    rank, world, device = setup_distributed(cfg)
    fixed_mmap_threshold()  # CPU: freed activations go back to the OS (a fragmenting heap cost GiBs at 0.5B)
    task = get_task(cfg.task, cfg.data or None, cfg.test_data or None)
    task = select_examples(task, cfg.pass_rates, cfg.select, cfg.select_fraction, cfg.seed) if cfg.select else task
    check_sizes(task, train=cfg.prompts_per_step, test=cfg.eval_examples)
    task = task if cfg.system_prompt is None else replace(task, system_prompt=cfg.system_prompt)
    memory = check_memory(cfg, task, device, world)  # a step that cannot fit is refused here, before the data pool
    # The data order: a deterministic stream of training examples (prefix-stable in --max-steps),
    # and a second one for dynamic-sampling top-ups.
    n = cfg.max_steps * cfg.prompts_per_step
    pool = task.train(n, cfg.seed)
    topups = task.train(n * cfg.max_resample_rounds, derive_seed(cfg.seed, 1)) if cfg.dynamic_sampling else []
    heldout = task.test(cfg.eval_examples, cfg.seed)
    if cfg.anchors and all(task.reference(ex) is None for ex in pool + topups):  # some may lack one: no anchor there
        raise UserError(
            f"--anchors needs reference solutions but no training example of task '{task.name}' has one "
            "(synthetic: the SFT completion; gsm8k, math: the 'solution' field); drop --anchors (or pass --no-anchors)"
        )
    resume_dir = find_checkpoint(cfg.resume) if cfg.resume else ""
    if resume_dir:
        check_resume(asdict(cfg), resume_dir, asdict(TrainConfig()), RESUMABLE)
    if rank == 0:
        lock_run_dir(cfg.out)  # one writer per run directory: a second train.py on it is refused
        check_out_dir(cfg.out, resume_dir, cfg.overwrite)
        prepare_out(cfg.out, read_trainer_step(resume_dir) if resume_dir else 0)
    torch.manual_seed(cfg.seed)
    policy = load_model(resume_dir or cfg.model, dtype=torch.float32, device=device)
    policy.gradient_checkpointing = cfg.gradient_checkpointing
    # a checkpoint carries its run's tokenizer files
    tokenizer = load_tokenizer(resume_dir or cfg.model, enable_thinking=cfg.enable_thinking)
    reference = load_model(cfg.model, dtype=torch.float32, device=device).requires_grad_(False) if cfg.beta else None
    # A thought ends when its text contains the marker, whatever tokens spell it (sampler.StopText).
    marker = StopText(cfg.end_of_thought, tokenizer.encode(cfg.end_of_thought), tokenizer.decode, tokenizer.vocab_size)
    new = cfg.max_thought_tokens + cfg.max_answer_tokens + (len(marker.ids) if cfg.answers > 1 else 0)
    context = policy.config.max_position_embeddings
    if new >= context:
        raise UserError(f"--max-thought-tokens + --max-answer-tokens ({new}) leave no room for a prompt in the "
                        f"model's context of {context} tokens")  # fmt: skip
    limit = f"the model's context of {context} tokens minus the completion limit of {new}"
    check_prompt_lengths(tokenizer, pool + topups + heldout, task.system_prompt, context - new, limit)
    model, fsdp = policy, world > 1 and cfg.fsdp
    if fsdp:  # each layer is one all-gather unit; the root holds the rest (embedding = tied lm_head, norm)
        from torch.distributed.fsdp import fully_shard

        for layer in policy.model.layers:
            fully_shard(layer)
        fully_shard(policy)
    elif world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(policy, device_ids=ids)
    # --optimizer-offload: AdamW steps CPU float32 copies of the parameters (its state lives there too),
    # which optimizer_step copies the gradients to and the new weights back from.
    host = [host_copy(p, device) for p in policy.parameters()] if cfg.optimizer_offload else None
    # fused: one kernel over all parameters (7.6x the default per-tensor loop on this CPU, as TRL's default
    # adamw_torch_fused); FSDP's sharded DTensor parameters keep the default implementation.
    optimizer = torch.optim.AdamW(host or policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=cfg.weight_decay, fused=not fsdp)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    state = dict(step=0, grad_norms=[], bad_steps=0, skipped_steps=0, gate_on=None)
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    run = Run(cfg, rank, world, device, torch.bfloat16 if bf16 else None, policy, model, fsdp, reference, tokenizer,
              task, pool, topups, heldout, marker, optimizer, scheduler, state)  # fmt: skip
    if resume_dir:
        run.state = load_trainer_state(resume_dir, policy, optimizer, scheduler, fsdp)
    run.host_params = host
    if host and resume_dir:  # the resumed masters
        with torch.no_grad():
            for h, p in zip(host, policy.parameters(), strict=True):
                h.copy_(p)
    rollout = cfg.rollout_dtype if cfg.rollout_dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32"
    run.sampler = policy if rollout == "float32" else cast_copy(policy, getattr(torch, rollout))
    if cfg.compile:  # the caller compiles the small decode step; the sampler replays it as a CUDA graph
        run.static_step = torch.compile(decode_step_static, mode="reduce-overhead", fullgraph=True)
    if cfg.noise_correct and "noise_rates" not in run.state:  # fixed, or "auto": fit at the start (resume keeps it)
        with rollout_weights(run), precision(run):
            run.state["noise_rates"] = noise_rates(cfg.noise_correct, "--noise-correct", auto=True) or calibrate_noise(
                run.sampler, tokenizer, task, noise_rates(cfg.reward_noise, ""), n=cfg.thoughts * cfg.answers,
                max_new_tokens=new, temperature=cfg.temperature, seed=derive_seed(cfg.seed, 3))  # fmt: skip
    if rank == 0:
        with writing(os.path.join(cfg.out, "config.json")), open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        if cfg.wandb:
            import wandb  # optional extra

            run.wandb = wandb.init(project=cfg.wandb, config=asdict(cfg))
        preset = {k: v for k, v in PRESETS[cfg.algo].items() if getattr(cfg, k) == v}
        print(
            start_line(
                algo=cfg.algo,
                preset=preset,
                model=cfg.model,
                task=cfg.task,
                out=cfg.out,
                step=run.state["step"],
                max_steps=cfg.max_steps,
                resumed_from=resume_dir,
                device=f"{device}, {'bf16 autocast' if run.autocast else 'float32'}",
                memory=memory,
            )
        )
    return run


# Flags a resumed run may change: how long it runs, what it reports and where. Every other flag
# decides what the run computes and must equal the run's own (its checkpoint's train_config.json).
RESUMABLE = (
    *("resume", "out", "overwrite", "max_steps", "device", "reward_workers", "max_bad_steps", "wandb"),
    *("optimizer_offload",),
    *("eval_every", "eval_examples", "eval_samples", "save_every", "save_optimizer", "save_dtype", "samples_every"),
)


def resume_config(cfg: TrainConfig, typed: set[str]) -> TrainConfig:
    """--resume on the command line: the run's own flags, replaced only by the flags typed now
    (setup's check_resume then refuses those that would change what the run computes)."""
    return TrainConfig(**resume_flags(asdict(cfg), typed, asdict(TrainConfig()))) if cfg.resume else cfg


def precision(run: Run):
    """The autocast context of every forward (bf16 autocast, or a no-op in float32)."""
    return torch.autocast(run.device.type, dtype=run.autocast, enabled=run.autocast is not None)


def rollout_weights(run: Run):
    """Around sampling and evaluation. FSDP: whole weights while ranks run different numbers of
    forwards (full_params); not needed when the sampler is its own --rollout-dtype copy."""
    return full_params(run.policy, run.fsdp and run.sampler is run.policy)


def host_copy(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """--optimizer-offload: a CPU float32 copy of parameter p (pinned, for fast copies, when p is on a GPU)."""
    h = p.detach().to("cpu", torch.float32, copy=True)
    return h.pin_memory() if device.type == "cuda" else h


# -----------------------------------------------------------------------------
# Steps 1-2: sample and score


@dataclass
class Rollouts:
    """One rank's share of a step: P prompts, K thoughts each, M answers per thought."""

    examples: list[dict]  # (P,)
    prompts: list[list[int]]  # (P,) prompt token ids
    tree: Tree  # thoughts (P*K) and answers (P*K*M), with the sampler's log-probs
    reward: torch.Tensor  # (P, K, M) float32
    correct: torch.Tensor  # (P, K, M) float32 0/1: the task's own correctness (rewards may add shaping)
    lengths: torch.Tensor  # (P, K, M) long: thought + answer tokens
    credit: torch.Tensor  # (P, K, M) float32: the task's partial credit with --pair-delta (else the reward)
    anchor: torch.Tensor | None = None  # (P, K, M) bool: the rollout is the example's reference solution (--anchors)


def sample(run: Run, examples: list[dict], seeds: list[int]) -> tuple[list[list[int]], Tree]:
    """1. Render P prompts and sample K thoughts x M answers each (M = 1: K plain completions)."""
    cfg, M = run.cfg, run.cfg.answers
    prompts = [render_prompt(run.tokenizer, ex, run.task.system_prompt) for ex in examples]
    with torch.no_grad(), precision(run):
        tree = sample_tree(
            run.sampler, prompts, k=cfg.thoughts, m=M, max_thought_tokens=cfg.max_thought_tokens if M > 1 else 0,
            max_answer_tokens=cfg.max_answer_tokens + (0 if M > 1 else cfg.max_thought_tokens),
            end_of_thought=run.marker if M > 1 else (), temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
            stop_ids=run.tokenizer.stop_ids, seed=seeds, static_step=run.static_step,
        )  # fmt: skip
    return prompts, tree


def score(run: Run, examples: list[dict], tree: Tree, seeds: list[int]) -> tuple[torch.Tensor, ...]:
    """2. Rewards (--reward-noise: flipped by each prompt's rollout seed), correctness, lengths, credit (P, K, M)."""
    cfg, K, M = run.cfg, run.cfg.thoughts, run.cfg.answers
    texts, lengths, exs = [], [], []
    for a, ans in enumerate(tree.answers):
        thought = tree.thoughts[a // M]
        texts.append(decode_completion(run.tokenizer, thought + ans))
        lengths.append(len(thought) + len(ans))
        exs.append(examples[a // (K * M)])
    reward = torch.tensor(score_batch(run.task.reward, texts, exs, max_workers=cfg.reward_workers), dtype=torch.float32)
    if cfg.reward_noise:  # one generator per prompt: batching and world size cannot change the flips
        gens = [torch.Generator().manual_seed(derive_seed(s, 2)) for s in seeds]
        reward = flip_rewards(reward.view(len(seeds), -1), *noise_rates(cfg.reward_noise, ""), gens).flatten()
    fine = run.task.partial_credit if cfg.pair_delta >= 0 else None  # DaGRPO's score; a task without one: the reward
    credit = reward if fine is None else torch.tensor(score_batch(fine, texts, exs, max_workers=cfg.reward_workers))
    correct = torch.tensor([run.task.correct(t, e) for t, e in zip(texts, exs)], dtype=torch.float32)
    lengths = torch.tensor(lengths)
    if cfg.overlong_buffer:
        reward = reward + overlong_penalty(lengths, cfg.max_thought_tokens + cfg.max_answer_tokens, cfg.overlong_buffer)
    return reward.view(-1, K, M), correct.view(-1, K, M), lengths.view(-1, K, M), credit.view(-1, K, M)


def dynamic_sampling(run: Run, step: int, slots: list[int], ro: Rollouts) -> int:
    """2b. DAPO: replace prompts whose K*M rewards are all equal with fresh ones, slot by slot, for
    up to --max-resample-rounds rounds (in place). Returns how many prompts were replaced."""
    cfg, K, M = run.cfg, run.cfg.thoughts, run.cfg.answers
    n_resampled = 0
    for rnd in range(1, cfg.max_resample_rounds + 1):
        flat = ~dynamic_sampling_keep(ro.reward.view(len(slots), -1))
        if not flat.any():
            break
        redo = flat.nonzero().flatten().tolist()
        new_ex = [
            run.topups[(step * cfg.prompts_per_step + slots[i]) * cfg.max_resample_rounds + rnd - 1] for i in redo
        ]
        seeds = [derive_seed(cfg.seed, step, slots[i], rnd, 1) for i in redo]
        new_prompts, new_tree = sample(run, new_ex, seeds)
        new_r, new_c, new_l, new_s = score(run, new_ex, new_tree, seeds)
        for j, i in enumerate(redo):
            ro.examples[i], ro.prompts[i] = new_ex[j], new_prompts[j]
            ro.reward[i], ro.correct[i], ro.lengths[i], ro.credit[i] = new_r[j], new_c[j], new_l[j], new_s[j]
            splice_tree(ro.tree, i, new_tree, j, K, M)
        n_resampled += len(redo)
    return n_resampled


def splice_anchors(run: Run, ro: Rollouts) -> tuple[Rollouts, dict[str, int]]:
    """2c. DaGRPO's anchors (a RECONSTRUCTION; M = 1): in each group with no correct rollout, the last rollout is
    replaced by the example's reference solution, task.reference(example) tokenised and ended by the end-of-turn
    token, with reward 1 (advantage.splice_anchor_rewards), correct 1 and the top credit 1 (the pair mask then
    compares every wrong rollout with it). A group gets no anchor when its example has no reference, when the
    reference's tokens fail the task's own check or exceed the completion limit (never truncated). Packing, the
    score pass and the update then see the reference's tokens; the update trains them off-policy (policy_loss's
    off_policy shaping), so they need no sampler log-probs (0 here) and no old log-probs.

    ro: the policy's own rollouts (P, K, 1), left unchanged (the step's metrics describe them). Returns the
    rollouts to train on, with .anchor (P, K, 1) bool, and counts: anchors (groups that got one),
    anchors/too_long and anchors/no_reference (groups that needed one but could not get it)."""
    cfg, tok, K = run.cfg, run.tokenizer, run.cfg.thoughts
    P, limit = len(ro.examples), cfg.max_thought_tokens + cfg.max_answer_tokens  # M = 1: one completion limit
    spliced, anchor = splice_anchor_rewards(ro.reward.view(P, K), ro.correct.view(P, K))  # (P, K) x2
    answers, logprobs, finish = list(ro.tree.answers), list(ro.tree.answer_logprobs), list(ro.tree.answer_finish)
    tree = replace(ro.tree, answers=answers, answer_logprobs=logprobs, answer_finish=finish)  # ro.tree stays as sampled
    lengths = ro.lengths.view(P, K).clone()
    counts = {"anchors": 0, "anchors/too_long": 0, "anchors/no_reference": 0}
    for p in anchor[:, -1].nonzero().flatten().tolist():
        text = run.task.reference(ro.examples[p])
        ids = [] if text is None else tok.encode(text) + ([] if tok.end_id is None else [tok.end_id])
        if not ids or run.task.correct(decode_completion(tok, ids), ro.examples[p]) != 1:
            outcome = "anchors/no_reference"
        elif len(ids) > limit:
            outcome = "anchors/too_long"
        else:
            outcome = "anchors"
            b = p * K + K - 1  # the group's last rollout (M = 1: the thought is empty, the answer is the completion)
            tree.answers[b], tree.answer_logprobs[b], tree.answer_finish[b] = ids, [0.0] * len(ids), "stop"
            lengths[p, -1] = len(ids)
        counts[outcome] += 1
        anchor[p, -1] = outcome == "anchors"
    trained = replace(
        ro, tree=tree, reward=torch.where(anchor, spliced, ro.reward.view(P, K)).view(P, K, 1),
        correct=ro.correct.view(P, K).masked_fill(anchor, 1.0).view(P, K, 1), lengths=lengths.view(P, K, 1),
        credit=ro.credit.view(P, K).masked_fill(anchor, 1.0).view(P, K, 1), anchor=anchor.view(P, K, 1),
    )  # fmt: skip
    return trained, counts


# -----------------------------------------------------------------------------
# Steps 4-6: score pass, advantages, update

MicroBatches = list[tuple[torch.Tensor, Batch]]  # (row indices into the step's batch, that micro-batch)


def score_pass(
    run: Run, micro: MicroBatches, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """4. No-grad forwards before the update: old log-probs (needed when mu > 1) and token entropy
    (GTPO) under the policy, log-probs under the reference (beta > 0). Each (B, T) in the logical layout."""
    cfg = run.cfg
    need_policy = cfg.mu > 1 or cfg.entropy_gate or cfg.entropy_gamma > 0
    old_logp, entropy = torch.zeros(shape, device=run.device), torch.zeros(shape, device=run.device)
    ref_logp = torch.zeros(shape, device=run.device) if run.reference is not None else None
    with torch.no_grad(), precision(run):
        for rows, mb in micro:
            if need_policy:
                old_logp[rows], entropy[rows] = token_stats(run.policy, mb, cfg.temperature, entropy=True)
            if run.reference is not None:
                ref_logp[rows] = token_stats(run.reference, mb, cfg.temperature)[0]
    return old_logp, ref_logp, entropy


def sequence_advantages(run: Run, ro: Rollouts, batch_accuracy: float) -> tuple[torch.Tensor, torch.Tensor]:
    """5a. Thought advantages (P, K) and answer advantages (P, K, M) (M = 1: one per completion)."""
    cfg, P, K, M = run.cfg, *ro.reward.shape
    reward = noise_corrected_rewards(ro.reward, *run.state["noise_rates"]) if cfg.noise_correct else ro.reward
    adv_thought, adv_answer = grpo_ma_advantages(reward, std_normalize=cfg.std_normalize)  # = GRPO when M == 1
    group = reward.view(P, K * M)
    if cfg.advantage == "two_grpo":
        adv_answer = two_grpo_advantages(group).view(P, K, M)
    elif cfg.advantage == "agrae":
        adv_answer = agrae_advantages(
            group, correct=ro.correct.view(P, -1), alpha=cfg.agrae_alpha, batch_accuracy=batch_accuracy,
            std_normalize=cfg.std_normalize,
        ).view(P, K, M)  # fmt: skip
    elif cfg.pair_delta >= 0:  # DaGRPO's mask (a reconstruction): pairs whose credits differ by < delta cancel
        credit, std = ro.credit.view(P, K * M), cfg.std_normalize
        adv_answer = pairwise_distinct_advantages(group, credit, cfg.pair_delta, std_normalize=std).view(P, K, M)
    return adv_thought, adv_answer


def entropy_control(run: Run, seq_adv: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """5b. GTPO: drop completions whose mean entropy exceeds the threshold (unless the starting policy
    is already above it: decided once, at the first step) and shift the rest by -gamma * mean entropy.
    seq_adv (B,), entropy and mask (B, T) -> (B,)."""
    cfg, world = run.cfg, run.world
    keep, mean_ent = gtpo_entropy_gate(entropy, mask, threshold=cfg.entropy_threshold, enabled=cfg.entropy_gate)
    if run.state["gate_on"] is None:
        run.state["gate_on"] = bool(
            all_sum(mean_ent.sum(), world) / all_sum(len(mean_ent), world) <= cfg.entropy_threshold
        )
    keep = keep | (not run.state["gate_on"])
    return torch.where(keep.cpu(), gtpo_entropy_shift(seq_adv, mean_ent.cpu(), gamma=cfg.entropy_gamma), 0.0)


def advantages(run: Run, ro: Rollouts, batch: Batch, entropy: torch.Tensor, batch_accuracy: float):
    """5. Per-token advantage and weight (B, T) for the whole global step, and the trained-token mask (B, T).

    The weight carries the loss normaliser of the WHOLE step (summed over ranks), so neither the
    micro-batch split nor the world size can change the gradient."""
    cfg, world, dev = run.cfg, run.world, run.device
    P, K, M = ro.reward.shape
    adv_thought, adv_answer = sequence_advantages(run, ro, batch_accuracy)
    completion = batch.thought | (batch.answer_id >= 0)
    raw = adv_answer.flatten()  # (P*K*M,) = one per row when M == 1: the group advantage
    seq_adv = raw
    if cfg.entropy_gate or cfg.entropy_gamma > 0:  # rows are completions (M == 1)
        seq_adv = entropy_control(run, seq_adv, entropy, completion.float())
    if cfg.dynamic_sampling:  # groups still flat after the top-ups are dropped from the loss
        completion = completion & dynamic_sampling_keep(ro.reward.view(P, -1)).repeat_interleave(K).to(dev)[:, None]
    # Thought tokens carry their thought's advantage, answer tokens their own answer's.
    adv = grpo_ma_token_advantages(adv_thought.to(dev), seq_adv.view(P, K, M).to(dev), batch.thought, batch.answer_id)
    comp, n_rows = completion.float(), batch.ids.shape[0]
    if M > 1 and cfg.aggregation == "seq_mean_token_mean":
        weight = grpo_ma_token_weights(
            batch.thought & completion, torch.where(completion, batch.answer_id, -1), thought_weight=cfg.thought_weight,
            answer_weight=cfg.answer_weight, num_thoughts=all_sum(n_rows, world).item(),
            num_answers=all_sum(n_rows * M, world).item(),
        )  # fmt: skip
    else:
        weight = token_weights(
            comp, cfg.aggregation, max_len=cfg.max_thought_tokens + cfg.max_answer_tokens,
            num_seqs=all_sum(n_rows, world).item(), num_tokens=all_sum(comp.sum(), world).item(),
        )  # fmt: skip
    # GTPO's conflict tokens: positive vs negative by the sign of the raw group advantage, as its paper
    # and code, not of the entropy-shaped one. Logical rows are the completions, compared position by position.
    if cfg.gtpo_conflict:
        conflict = gtpo_conflict_weights(batch.ids, comp, raw.to(dev), K, w_pos=cfg.gtpo_w_pos, w_neg=cfg.gtpo_w_neg)
        weight = weight * conflict
    return adv, weight, completion


def update(run: Run, step: int, micro: MicroBatches, adv: torch.Tensor, weight: torch.Tensor,
           old_logp: torch.Tensor, ref_logp: torch.Tensor | None, entropy: torch.Tensor,
           completion: torch.Tensor, off_policy: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """6. mu epochs; each accumulates policy_loss over every micro-batch, then one clipped AdamW step.
    adv, weight, old_logp, ref_logp, entropy, completion, off_policy: (B, T); off_policy (--anchors) marks
    the tokens not sampled from the policy, trained with policy_loss's off-policy shaping. Returns the first
    epoch's sums of loss and token-weighted diagnostics, and the last epoch's gradient norm."""
    cfg, world = run.cfg, run.world
    need_old, have_ent = cfg.mu > 1, cfg.mu > 1 or cfg.entropy_gate or cfg.entropy_gamma > 0
    tis = cfg.tis_cap > 0 and run.sampler is not run.policy
    sums = dict(loss=0.0, clip_frac=0.0, kl=0.0, logp_gap=0.0, entropy=0.0, anchor_tokens=0.0, anchor_p=0.0)
    sums |= dict(tis=0.0, tis_capped=0.0) if tis else {}
    for epoch in range(cfg.mu):
        for i, (rows, mb) in enumerate(micro):
            sync = i == len(micro) - 1  # DDP/FSDP: reduce gradients once, after the last micro-batch
            no_sync = world > 1 and not cfg.fsdp and not sync
            if run.fsdp:
                run.policy.set_requires_gradient_sync(sync)
            with run.model.no_sync() if no_sync else contextlib.nullcontext(), precision(run):
                logp, ent = token_stats(run.model, mb, cfg.temperature, entropy=epoch == 0 and not have_ent)
                off = None if off_policy is None else off_policy[rows]
                sampled = completion[rows] if off is None else completion[rows] & ~off  # anchors: no sampler logp
                old, w = old_logp[rows] if need_old else logp.detach(), weight[rows]
                if tis:  # rollouts from a cast copy: reweight tokens by min(pi_old / pi_sampler, cap)
                    w_is = truncated_is_weights(old, mb.sampler_logp, sampled, cfg.tis_cap)
                    w = w * w_is
                loss, metrics = policy_loss(
                    logp, old, adv[rows], w,
                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, beta=cfg.beta, sequence_ratio=cfg.sequence_ratio,
                    ref_logp=None if ref_logp is None else ref_logp[rows], off_policy=off,
                    off_policy_gamma=cfg.anchor_gamma,
                )  # fmt: skip
                (loss * world).backward()  # DDP/FSDP average over ranks; our loss is already the global sum
            if epoch == 0:  # diagnostics on the sampling-time parameters, token-weighted
                mask = completion[rows].float()
                sums["loss"] += loss.item()
                sums["clip_frac"] += metrics["clip_frac"] * mask.sum().item()
                sums["kl"] += metrics.get("kl", 0.0) * mask.sum().item()
                sums["logp_gap"] += ((logp.detach() - mb.sampler_logp).abs() * sampled).sum().item()
                sums["entropy"] += ((ent if ent is not None else entropy[rows]) * mask).sum().item()
                if tis:
                    sums["tis"] += (w_is * sampled).sum().item()
                    sums["tis_capped"] += ((w_is >= cfg.tis_cap) & sampled).sum().item()
                if off is not None:  # off_policy is a subset of completion
                    sums["anchor_tokens"] += off.sum().item()
                    sums["anchor_p"] += (logp.detach().exp() * off).sum().item()
        grad_norm = optimizer_step(run, step, math.isfinite(sums["loss"]))
    return sums, grad_norm


def optimizer_step(run: Run, step: int, loss_finite: bool) -> torch.Tensor:
    """Clip the global gradient norm and step AdamW and the schedule; a non-finite loss or gradient
    skips the update, and --max-bad-steps of them in a row end the run. Returns the gradient norm."""
    cfg, state = run.cfg, run.state
    grad_norm = torch.nn.utils.clip_grad_norm_(run.policy.parameters(), cfg.grad_clip)
    if torch.isfinite(grad_norm) and loss_finite:
        if run.host_params:  # --optimizer-offload: gradients to the CPU copies, AdamW there, weights back
            for h, p in zip(run.host_params, run.policy.parameters(), strict=True):
                h.grad = p.grad.to("cpu", torch.float32)
        masters = run.host_params or list(run.policy.parameters())
        before = run.master_norms if run.master_norms is not None else weight_norms(masters)
        run.optimizer.step()
        run.scheduler.step()
        # broken weights (NaN, inf, or a 1000-fold jump) stop the run before anything uses or saves them
        names = [n for n, _ in run.policy.named_parameters()]
        run.master_norms = weight_norms(masters)  # the next update's "before": one norm pass per update
        check_update(names, before, run.master_norms, run.world, step + 1, f"lower --lr (now {cfg.lr:g})")
        if run.host_params:
            with torch.no_grad():
                for h, p in zip(run.host_params, run.policy.parameters(), strict=True):
                    p.copy_(h, non_blocking=True)
        if run.sampler is not run.policy:  # the rollout copy follows the new weights
            copy_weights_(run.sampler, run.policy)
        state["bad_steps"] = 0
    else:
        state["bad_steps"] += 1
        state["skipped_steps"] += 1
        warnings.warn(f"step {step}: non-finite loss or gradient, update skipped", stacklevel=2)
        if state["bad_steps"] >= cfg.max_bad_steps:
            raise SystemExit(
                f"{cfg.max_bad_steps} consecutive non-finite steps at step {step}: lower --lr or check the rewards"
            )
    run.optimizer.zero_grad(set_to_none=True)
    if run.host_params:  # AdamW steps the CPU copies: the model's own gradients are cleared here
        run.policy.zero_grad(set_to_none=True)
    return grad_norm


# -----------------------------------------------------------------------------
# Step 7: log, evaluate, save


def log(run: Run, row: dict, file: str = "metrics.jsonl") -> None:
    """The one logging call: a line of OUT/file (+ wandb for metrics), on rank 0."""
    if run.rank == 0:
        append_row(os.path.join(run.cfg.out, file), row)
        if run.wandb is not None and file == "metrics.jsonl":
            run.wandb.log(row, step=row["step"])


def step_metrics(run: Run, ro: Rollouts, completion: torch.Tensor, sums: dict, grad_norm: torch.Tensor,
                 batch_accuracy: float, n_resampled: int, anchors: dict, times: dict) -> dict:  # fmt: skip
    """The metrics row of a step (global over ranks unless noted); also records the gradient norm. Rewards,
    accuracy, lengths and tokens are those of the policy's own rollouts `ro` (before any anchor); the loss
    diagnostics cover every trained token of `completion`, anchors included (logp_gap: the sampled ones)."""
    world, tree, state, M = run.world, ro.tree, run.state, run.cfg.answers
    state["grad_norms"].append(grad_norm.item())
    gss, gss10 = gradient_spike_score(state["grad_norms"])
    n_tok = max(all_sum(completion.sum(), world).item(), 1)
    n_anchor_tok = all_sum(sums["anchor_tokens"], world).item()
    gen_tokens = all_sum(sum(map(len, tree.thoughts)) + sum(map(len, tree.answers)), world).item()
    group = ro.reward.view(ro.reward.shape[0], -1)
    return {
        "step": state["step"],
        "reward/mean": (all_sum(ro.reward.sum(), world) / all_sum(ro.reward.numel(), world)).item(),
        "reward/std": ro.reward.std().item(),  # this rank's (rank 0's) rollouts
        "accuracy": (all_sum(ro.correct.sum(), world) / all_sum(ro.correct.numel(), world)).item(),
        "batch_accuracy": batch_accuracy,
        "frac_zero_std_groups": (~dynamic_sampling_keep(group)).float().mean().item(),
        "loss": all_sum(sums["loss"], world).item(),
        "grad_norm": grad_norm.item(),
        "gss": gss[-1].item(),
        "gss10_frac": gss10,
        "clip_frac": all_sum(sums["clip_frac"], world).item() / n_tok,
        "kl": all_sum(sums["kl"], world).item() / n_tok if run.reference is not None else None,
        "entropy": all_sum(sums["entropy"], world).item() / n_tok,
        "len/completion_mean": ro.lengths.float().mean().item(),
        "truncated_frac": sum(f == "length" for f in tree.answer_finish) / len(tree.answer_finish),
        "thought_truncated_frac": sum(tree.thought_truncated) / len(tree.thought_truncated) if M > 1 else 0.0,
        "logp_gap": all_sum(sums["logp_gap"], world).item() / max(n_tok - n_anchor_tok, 1),
        **(
            {
                "tis/mean": all_sum(sums["tis"], world).item() / max(n_tok - n_anchor_tok, 1),
                "tis/capped_frac": all_sum(sums["tis_capped"], world).item() / max(n_tok - n_anchor_tok, 1),
            }
            if "tis" in sums
            else {}
        ),  # fmt: skip
        "resampled": n_resampled,
        "skipped_steps": state["skipped_steps"],
        "lr": run.scheduler.get_last_lr()[0],
        **dict(zip(("noise/rho_plus", "noise/rho_minus"), state.get("noise_rates") or ())),
        **{k: int(all_sum(v, world).item()) for k, v in anchors.items()},  # --anchors: per-step group counts
        **({"anchors/p_mean": all_sum(sums["anchor_p"], world).item() / max(n_anchor_tok, 1)} if anchors else {}),
        **{f"time/{k}_s": v for k, v in times.items()},
        "tokens/generated": gen_tokens,
        "tokens_per_s": gen_tokens / max(times["sample"], 1e-9),
    }


def log_samples(run: Run, ro: Rollouts) -> None:
    """A few decoded rollouts of the step to OUT/samples.jsonl."""
    K, M = run.cfg.thoughts, run.cfg.answers
    for a in range(min(4, len(ro.tree.answers))):
        completion = decode_completion(run.tokenizer, ro.tree.thoughts[a // M] + ro.tree.answers[a])
        row = dict(step=run.state["step"], prompt=ro.examples[a // (K * M)]["prompt"], completion=completion,
                   reward=ro.reward.flatten()[a].item())  # fmt: skip
        log(run, row, file="samples.jsonl")


def evaluate_heldout(run: Run, step: int) -> dict:
    """Held-out greedy accuracy, mean@n and pass@k (eval.evaluate) on rank 0, logged as eval/..."""
    cfg = run.cfg
    with rollout_weights(run):  # FSDP: every rank gathers, then rank 0 alone runs forwards
        if run.rank != 0:
            return {}
        with precision(run):
            res = evaluate(
                run.sampler, run.tokenizer, run.task, run.heldout, n=cfg.eval_samples, temperature=cfg.temperature,
                max_new_tokens=cfg.max_thought_tokens + cfg.max_answer_tokens, seed=derive_seed(cfg.seed, 10**9),
                static_step=run.static_step,
            )  # fmt: skip
    row = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
    log(run, row)
    return row


def save(run: Run, path: str) -> None:
    """A checkpoint at `path`: HF weights in --save-dtype, tokenizer files and trainer state (with
    --save-optimizer: the optimizer, and float32 masters when the weights are written in less)."""
    cfg = run.cfg
    weights, optim = gather_full_state(run.policy, run.optimizer) if run.fsdp else (None, run.optimizer.state_dict())
    if run.rank == 0:
        dtype = None if cfg.save_dtype == "auto" else getattr(torch, cfg.save_dtype)
        lossy = (dtype or getattr(torch, run.policy.config.torch_dtype)) != torch.float32
        masters = (
            (weights if weights is not None else run.policy.state_dict()) if cfg.save_optimizer and lossy else None
        )
        state = dict(optimizer=optim if cfg.save_optimizer else None, scheduler=run.scheduler.state_dict(),
                     trainer=run.state, config=asdict(cfg), master_weights=masters)  # fmt: skip
        save_checkpoint(path, run.policy, cfg.model, state, asdict(cfg), weights=weights, dtype=dtype)
    if run.world > 1:
        dist.barrier()


# -----------------------------------------------------------------------------
# The loop


def main(cfg: TrainConfig) -> dict:
    run, t_start = setup(cfg), time.perf_counter()
    P_local = cfg.prompts_per_step // run.world
    if run.state["step"] == 0:
        evaluate_heldout(run, 0)
    bar = tqdm(range(run.state["step"], cfg.max_steps), disable=run.rank != 0, desc="train", dynamic_ncols=True)
    resume = ("python" if run.world == 1 else "torchrun ...") + f" train.py --resume {cfg.out}"
    with stop_signals(resume) as stop:  # SIGINT, SIGTERM: stop at the next step boundary, with a checkpoint
        for step in bar:
            t0, _ = time.perf_counter(), memory_peak(run.device)  # each phase's peak memory is measured from here
            slots = [run.rank * P_local + i for i in range(P_local)]  # global prompt slots of this rank
            examples = [run.pool[step * cfg.prompts_per_step + s] for s in slots]
            with rollout_weights(run):  # FSDP: whole weights while ranks run different numbers of forwards
                # 1. sample: K thoughts x M answers for this rank's share of the global batch
                seeds = [derive_seed(cfg.seed, step, s) for s in slots]
                prompts, tree = sample(run, examples, seeds)
                t_sample = time.perf_counter() - t0
                # 2. score: rewards [P, K, M]; DAPO replaces prompts whose rewards are all equal
                ro = Rollouts(examples, prompts, tree, *score(run, examples, tree, seeds))
                batch_accuracy = (all_sum(ro.correct.mean(dim=(1, 2)).sum(), run.world) / cfg.prompts_per_step).item()
                n_resampled = dynamic_sampling(run, step, slots, ro) if cfg.dynamic_sampling else 0
            # 2c. DaGRPO anchors: the reference solution replaces the last rollout of each group with no correct one
            trained, anchors = splice_anchors(run, ro) if cfg.anchors else (ro, {})
            t_score, mem = time.perf_counter() - t0 - t_sample, dict(sample=memory_peak(run.device))

            # 3. pack: one row per thought; micro-batches cut once, for the score pass and every epoch
            batch = pack(trained.prompts, trained.tree, cfg.thoughts, cfg.answers, run.tokenizer.pad_id, run.device,
                         cfg.share_prompt)  # fmt: skip
            micro = [
                (rows, select_rows(batch, rows))
                for rows in split_rows(batch, cfg.micro_batch_rows, cfg.micro_batch_tokens)
            ]
            # 4. score pass (no grad): old log-probs, reference log-probs, entropy
            old_logp, ref_logp, entropy = score_pass(run, micro, batch.ids.shape)
            mem["score_pass"] = memory_peak(run.device)
            # 5. advantages: per sequence, then per-token adv and weight for the whole step
            adv, weight, completion = advantages(run, trained, batch, entropy, batch_accuracy)
            off_policy = None if trained.anchor is None else completion & trained.anchor.view(-1, 1).to(run.device)
            # 6. update: mu epochs, each one optimizer step over all micro-batches (anchor tokens off-policy)
            t1 = time.perf_counter()
            sums, grad_norm = update(run, step, micro, adv, weight, old_logp, ref_logp, entropy, completion, off_policy)
            t_update, mem["update"] = time.perf_counter() - t1, memory_peak(run.device)

            # 7. log, evaluate, save
            run.state["step"] = step + 1
            times = dict(sample=t_sample, score=t_score, update=t_update, step=time.perf_counter() - t0)
            row = step_metrics(run, ro, completion, sums, grad_norm, batch_accuracy, n_resampled, anchors, times)
            row.update({f"mem/{k}_gib": v for k, v in mem.items()})  # peak RSS (CPU) or allocated (CUDA) per phase
            log(run, row)
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}", acc=f"{row['accuracy']:.3f}", gss=f"{row['gss']:.2f}")
            if cfg.samples_every and (step + 1) % cfg.samples_every == 0:
                log_samples(run, ro)
            # the last step's evaluation too: every row of a step is logged before its checkpoint is written
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.max_steps:
                evaluate_heldout(run, step + 1)
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                save(run, os.path.join(cfg.out, f"step-{step + 1}"))
            if all_sum(stop.signum, run.world).item() and step + 1 < cfg.max_steps:  # a SIGINT or SIGTERM came
                stop_at_boundary(run, step + 1, stop.signum, stop.resume)
    save(run, os.path.join(cfg.out, "final"))
    if run.world > 1:
        dist.destroy_process_group()
    return finish(run, time.perf_counter() - t_start)


def stop_at_boundary(run: Run, step: int, signum: int, resume: str) -> None:
    """A signal asked the run to stop: a checkpoint of this step (unless --save-every just wrote it), one
    line with the command that resumes it, then cli.Stopped (exit status 128 + signum)."""
    cfg, path = run.cfg, os.path.join(run.cfg.out, f"step-{step}")
    if not (cfg.save_every and step % cfg.save_every == 0):
        save(run, path)
    how = resume if cfg.save_optimizer else "it has no optimizer state (--no-save-optimizer): start a run from it"
    message = f"stopped at step {step} of {cfg.max_steps} by {signal.Signals(signum).name}; {path} holds it: {how}"
    if run.rank == 0:
        print(f"\n{message}", file=sys.stderr)  # below the progress bar's line
        release_run_dir(cfg.out)
    raise Stopped(signum, message)


def finish(run: Run, seconds: float) -> dict:
    """The end of a run on rank 0: the summary (held-out accuracy at the first and last evaluation, time,
    outputs, the commands to run next) printed and the run directory released. Returns the first and
    last evaluation rows of the run's log ({} on other ranks)."""
    cfg = run.cfg
    if run.rank != 0:
        return {"first_eval": {}, "last_eval": {}}
    evals = eval_rows(cfg.out)
    files = [f for f in ("metrics.jsonl", "samples.jsonl", "config.json") if os.path.isfile(os.path.join(cfg.out, f))]
    data = [("--task", cfg.task), ("--data", cfg.data), ("--test-data", cfg.test_data)]
    flags = (
        "".join(f"{k} {v} " for k, v in data if v)
        + f"--max-new-tokens {cfg.max_thought_tokens + cfg.max_answer_tokens} "
    )
    print(end_summary(evals, seconds, cfg.out, files, flags, cfg.max_steps))
    release_run_dir(cfg.out)
    return {"first_eval": evals[0] if evals else {}, "last_eval": evals[-1] if evals else {}}


if __name__ == "__main__":
    with user_errors():
        config, typed = parse_config(
            TrainConfig, description=__doc__.split("\n\n")[0], presets=PRESETS, preset_field="algo"
        )
        main(resume_config(config, typed))
