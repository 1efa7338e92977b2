"""config.py: train.py's flags. CoreFlags holds the core loop's flags, each with its default, help text (the trailing
comment) and range; TrainConfig gathers them with every method's (its Flags in methods/); the presets (--algo) fill
the flags the user did not type; check lists the combinations the core refuses (each method's are in its file);
RESUMABLE, the flags a resumed run may change. Nothing here runs a model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import ClassVar

import methods
from advantage import AGGREGATIONS
from checkpoint import resume_flags
from cli import FlagError, first_error, int_or_auto, out_of_range
from hf import BUNDLED
from lora import TARGETS, parse_targets
from losses import KL_ESTIMATORS
from tasks import TASK_NAMES

# -----------------------------------------------------------------------------
# Configuration: the dataclass defaults are plain GRPO; each preset lists what it changes.

ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "grpo_ma", "two_grpo", "agrae", "gtpo", "dagrpo", "cispo")
ALGOS += ("sapo", "gmpo", "clip_cov", "kl_cov", "dppo", "gpg", "dsv32", "rloo", "reinforce_pp", "reinforce_pp_baseline")
ALGOS += ("lite_ppo", "maxrl", "gdpo", "opd", "rlsd", "sdpo")


@dataclass
class CoreFlags:
    """The core loop's flags: plain GRPO with GRPO-MA's tree, the run, the optimiser and the checkpoints."""

    # -- run
    algo: str = "grpo_ma" if "grpo_ma" in methods.PRESETS else "grpo"  # preset of the flags below (yours win)
    model: str = BUNDLED  # HF checkpoint directory (Qwen2/2.5/3, Qwen3.5 hybrids, Llama 2/3.x)
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
    compile: bool = False  # torch.compile the decode step (inside the CUDA graphs on a GPU; on CPU it takes minutes)
    cuda_graphs: bool = True  # CUDA: CUDA-graph decode, small functions compiled (graphs.py); --no-cuda-graphs: eager
    rollout_dtype: str = "auto"  # sampler and eval weights: a cast copy of the masters; auto = bf16 on CUDA, else fp32
    # -- rewards
    reward_workers: int = 1  # threads scoring rewards in parallel (raise for --task code: sandboxed runs)
    # -- advantages
    advantage: str = "grpo"  # grpo = group normalisation (GRPO-MA when answers > 1)
    std_normalize: bool = True  # divide by the group std (off = Dr. GRPO / GTPO centring)
    # -- loss
    aggregation: str = "seq_mean_token_mean"  # token weights: GRPO | DAPO token mean | Dr. GRPO sum / max length
    thought_weight: float = 1.0  # GRPO-MA: weight of the mean thought loss
    answer_weight: float = 1.0  # GRPO-MA: weight of the mean answer loss
    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.2  # ratio clip above 1 + clip_high (DAPO clip-higher: 0.28)
    loss: str = "clip"  # policy objective (losses.LOSSES; the preset of the same name sets its paper's defaults)
    beta: float = 0.0  # KL penalty to the starting model; > 0 loads a reference copy
    kl_estimator: str = "k3"  # k3 (TRL's, unclamped) | k1 | k2 | low_var_kl (verl's k3, clamped) | unbiased (V3.2)
    mu: int = 1  # optimisation epochs over each batch (old log-probs from a scoring pass when > 1)
    # -- optimisation
    lr: float = 3e-4  # AdamW learning rate (tiny model; about 1e-6 for 0.5B-7B models)
    warmup_steps: int = 5  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "cosine"  # cosine decays to 10% of --lr at the last step
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this value
    micro_batch_rows: int | str = "auto"  # rows per forward/backward; auto: the most that fit a GPU, 64 on CPU
    micro_batch_tokens: int = 0  # and at most N padded tokens per forward/backward, shared prompts counted (0 = off)
    share_prompt: bool = True  # run each prompt once, its K rows attend to it (same gradient, less work)
    gradient_checkpointing: bool = False  # recompute layer activations in backward to save memory
    fsdp: bool = False  # under torchrun: shard weights, grads, optimizer state with FSDP2
    optimizer_offload: bool = False  # AdamW state and step in CPU memory (saves 8 bytes/param on GPU); same update
    max_bad_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient
    lora_rank: int = 0  # LoRA: train rank-R adapters on the frozen model, the KL reference (0 = full fine-tuning)
    lora_alpha: float = 16.0  # LoRA: the adapters' scaling is alpha / rank
    lora_targets: str = "q,k,v,o,gate,up,down"  # LoRA: the linear layers that get adapters (comma-separated)
    merge: bool = False  # LoRA: also write OUT/merged, a full HF checkpoint with the adapters merged in
    # -- logging and checkpoints
    eval_every: int = 20  # evaluate held-out accuracy every N steps (0 = only at the start and end)
    eval_examples: int = 200  # held-out prompts per evaluation
    eval_samples: int = 4  # samples per held-out prompt for mean@n and pass@k
    save_every: int = 0  # write OUT/step-N every N steps (0 = never; OUT/final is always written)
    save_optimizer: bool = True  # checkpoints carry the optimizer state (needed to resume; 2x the weights)
    save_dtype: str = "auto"  # dtype of saved weights; auto = the dtype the model was loaded in
    samples_every: int = 10  # append decoded rollouts to OUT/samples.jsonl every N steps
    wandb: str = ""  # wandb project name (empty = off; needs the wandb package)


# --algo's presets, each from its method's file, listed in this order by --help (a deleted method's is gone)
PRESETS: dict[str, dict] = {"grpo": {}} | {name: methods.PRESETS[name] for name in ALGOS if name in methods.PRESETS}
ALGOS = tuple(PRESETS)


@dataclass
class TrainConfig(*(m.Flags for m in reversed(methods.METHODS) if hasattr(m, "Flags")), CoreFlags):
    """train.py's flags: the core's (CoreFlags, whose fields come first) and each method's (its Flags in methods/),
    one dataclass; the presets (--algo) fill the flags the user did not type, and __post_init__ refuses impossible
    combinations."""

    # The values of every choice flag (shown by --help) and the range of every numeric one (cli.in_range).
    TYPES: ClassVar[dict[str, object]] = dict(micro_batch_rows=int_or_auto)  # cli: fields not typed by their default
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = dict(
        algo=ALGOS,
        task=TASK_NAMES,
        device=("auto", "cpu", "cuda", "cuda:N"),
        dtype=("auto", "float32", "bfloat16"),
        advantage=("grpo", *methods.ADVANTAGES),
        aggregation=AGGREGATIONS,
        loss=tuple(methods.LOSSES),
        kl_estimator=tuple(KL_ESTIMATORS),
        **methods.gathered("CHOICES"),
        lr_schedule=("cosine", "constant"),
        save_dtype=("auto", "float32", "bfloat16", "float16"),
        rollout_dtype=("auto", "float32", "bfloat16"),
    )
    RANGES: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("max_steps", "prompts_per_step", "thoughts", "answers", "max_answer_tokens"), ">= 1"),
        **dict.fromkeys(("reward_workers", "mu", "max_bad_steps", "eval_examples"), ">= 1"),
        **dict.fromkeys(("seed", "max_thought_tokens", "top_k", "thought_weight", "answer_weight", "beta"), ">= 0"),
        **dict.fromkeys(("warmup_steps", "weight_decay", "micro_batch_tokens", "eval_every", "lora_rank"), ">= 0"),
        **dict(lora_alpha="> 0"),
        **dict.fromkeys(("eval_samples", "save_every", "samples_every"), ">= 0"),
        **dict.fromkeys(("temperature", "top_p", "clip_high", "lr", "grad_clip"), "> 0"),
        **dict(clip_low="[0, 1)"),
    }

    def __post_init__(self) -> None:
        """Validate, never rewrite: each value in its range, then each combination; the first impossible
        one (with any other that fails the same way) is one clear sentence."""
        errors = [*out_of_range(self, self.RANGES), *check(self)]
        if errors:
            raise first_error(errors)

    @property
    def completion_limit(self) -> int:
        """Tokens of a completion, thought and answer (with answers = 1 the completion gets both limits)."""
        return self.max_thought_tokens + self.max_answer_tokens


def check(cfg: TrainConfig) -> Iterator[FlagError]:
    """The combinations of flags the trainer refuses: the core's, then each method's (its check in methods/)."""
    for name, allowed in cfg.CHOICES.items():
        value = getattr(cfg, name)
        if value not in allowed and not (name == "device" and value.startswith("cuda:")):
            yield FlagError((name,), f"must be one of {', '.join(allowed)}, got {value!r}")
    if cfg.top_p > 1:
        yield FlagError(("top_p",), f"must be in (0, 1] (1 = off), got {cfg.top_p}")
    if cfg.micro_batch_rows != "auto" and not (isinstance(cfg.micro_batch_rows, int) and cfg.micro_batch_rows >= 1):
        yield FlagError(("micro_batch_rows",), f"must be >= 1 or auto, got {cfg.micro_batch_rows!r}")
    if cfg.optimizer_offload and cfg.fsdp:
        why = "is for one process or DDP: --fsdp already shards the optimizer state over the ranks"
        yield FlagError(("optimizer_offload",), why, ("fsdp",))
    group = ("thoughts", "answers")
    if cfg.thoughts * cfg.answers < 2:
        yield FlagError((), "needs at least 2 samples: raise --thoughts or --answers", group, "a group")
    if cfg.answers > 1 and not cfg.end_of_thought:
        yield FlagError(
            ("answers",), "needs an --end-of-thought marker", ("end_of_thought",), f"--answers {cfg.answers}"
        )
    if cfg.answers > 1 and not cfg.enable_thinking:
        why = "pre-fills an empty thought, leaving none to sample answers from: it needs --answers 1"
        yield FlagError(("enable_thinking",), why, subject="--no-enable-thinking")
    if cfg.aggregation == "seq_mean_token_sum_norm" and cfg.answers > 1:
        subject = "--aggregation seq_mean_token_sum_norm"
        yield FlagError(("aggregation",), "needs --answers 1", ("answers",), subject)
    if cfg.kl_estimator != "k3" and cfg.beta == 0:
        subject = f"--kl-estimator {cfg.kl_estimator}"
        yield FlagError(("kl_estimator",), "is the KL penalty's estimator: it needs --beta > 0", subject=subject)
    if cfg.lora_rank:
        try:
            parse_targets(cfg.lora_targets)
        except ValueError:
            why = f"must be a comma-separated subset of {','.join(TARGETS)}, got {cfg.lora_targets!r}"
            yield FlagError(("lora_targets",), why)
    if cfg.merge and not cfg.lora_rank:
        yield FlagError(("merge",), "merges LoRA adapters: it needs --lora-rank R", ("lora_rank",))
    if cfg.resume and os.path.abspath(cfg.resume) == os.path.abspath(cfg.model):
        yield FlagError(("resume",), "and --model name the same directory", ("model",))
    yield from methods.check(cfg)


# Flags a resumed run may change: how long it runs, what it reports and where. Every other flag
# decides what the run computes and must equal the run's own (its checkpoint's train_config.json).
RESUMABLE = (
    *("resume", "out", "overwrite", "max_steps", "device", "reward_workers", "max_bad_steps", "wandb"),
    *("optimizer_offload", "merge"),
    *("eval_every", "eval_examples", "eval_samples", "save_every", "save_optimizer", "save_dtype", "samples_every"),
)


def score_pass_needs(cfg: TrainConfig) -> tuple[bool, bool]:
    """What the no-grad score pass before the update runs: (the policy, for old log-probs when mu > 1 and the token
    entropies and log-probs of GTPO's controls and the step's token selections; the reference, when beta > 0).
    The trainer's score pass and the memory estimate both ask here."""
    policy = cfg.mu > 1 or methods.needs(cfg, "needs_scores")
    return policy, cfg.beta > 0


def lr_factor(opt_step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then constant or a cosine decay to 10% at the last optimizer step."""
    warm = min(1.0, (opt_step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_schedule == "constant":
        return warm
    # --staleness K: the first K steps only sample, so the decay runs over max_steps - K updates
    progress = min(1.0, opt_step / max(1, (cfg.max_steps - getattr(cfg, "staleness", 0)) * cfg.mu - 1))
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def resume_config(cfg: TrainConfig, typed: set[str]) -> TrainConfig:
    """--resume on the command line: the run's own flags, replaced only by the flags typed now
    (setup's check_resume then refuses those that would change what the run computes)."""
    return TrainConfig(**resume_flags(asdict(cfg), typed, asdict(TrainConfig()))) if cfg.resume else cfg
