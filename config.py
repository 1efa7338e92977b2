"""config.py: train.py's flags. TrainConfig holds every flag with its default, help text (the trailing
comment) and range; the presets (--algo) fill the flags the user did not type; check lists the combinations
the trainer refuses (the core's here, each method's in its file in methods/); RESUMABLE, the flags a resumed run may
change. Nothing here runs a model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import ClassVar

from advantage import AGGREGATIONS
from checkpoint import resume_flags
from cli import FlagError, first_error, out_of_range
from hf import BUNDLED
from losses import KL_ESTIMATORS, LOSSES, ROLLOUT_IS_MODES, loss_name
from methods import dagrpo, dapo, gtpo, hard_examples, noise, token_select
from tasks import TASK_NAMES

# -----------------------------------------------------------------------------
# Configuration: the dataclass defaults are plain GRPO; each preset lists what it changes.

ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "grpo_ma", "two_grpo", "agrae", "gtpo", "dagrpo", "cispo")
ALGOS += ("sapo", "gmpo", "clip_cov", "kl_cov", "dppo", "gpg", "dsv32")


@dataclass
class CoreFlags:
    """The core loop's flags: plain GRPO with GRPO-MA's tree, the run, the optimiser and the checkpoints."""

    # -- run
    algo: str = "grpo_ma"  # preset of the flags below (the flags you type win)
    model: str = BUNDLED  # HF checkpoint directory (Qwen2/2.5/3, Llama 2/3.x)
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
    # -- rewards
    reward_workers: int = 1  # threads scoring rewards in parallel (raise for --task code: sandboxed runs)
    # -- advantages
    advantage: str = "grpo"  # grpo = group normalisation (GRPO-MA when answers > 1)
    std_normalize: bool = True  # divide by the group std (off = Dr. GRPO / GTPO centring)
    agrae_alpha: float = 1.0  # A-GRAE: positive advantages times min(1, batch accuracy / alpha)
    # -- loss
    aggregation: str = "seq_mean_token_mean"  # token weights: GRPO | DAPO token mean | Dr. GRPO sum / max length
    thought_weight: float = 1.0  # GRPO-MA: weight of the mean thought loss
    answer_weight: float = 1.0  # GRPO-MA: weight of the mean answer loss
    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.2  # ratio clip above 1 + clip_high (DAPO clip-higher: 0.28)
    loss: str = "clip"  # policy objective (losses.LOSSES; the preset of the same name sets its paper's defaults)
    sequence_ratio: bool = False  # GSPO's sequence ratio: the same as --loss gspo (kept for existing commands)
    sapo_tau_pos: float = 1.0  # SAPO: gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # SAPO: gate temperature for negative advantages (steeper)
    dppo_mask_low: float = 0.2  # DPPO: mask a negative-advantage token whose probability fell by more than this
    dppo_mask_high: float = 0.2  # DPPO: mask a positive-advantage token whose probability rose by more than this
    dppo_kl_tau: float = 1e-3  # DPPO: coefficient of the squared log-ratio on every token
    gpg_alpha: bool = False  # GPG: token weights times groups / groups whose rewards differ
    opsm_delta: float = -1.0  # DeepSeek-V3.2: drop negative-advantage sequences with KL(sampler||pi) > DELTA (-1 off)
    beta: float = 0.0  # KL penalty to the starting model; > 0 loads a reference copy
    kl_estimator: str = "k3"  # the penalty's estimator: k3, or unbiased (DeepSeek-V3.2: k3 times pi / pi_old)
    mu: int = 1  # optimisation epochs over each batch (old log-probs from a scoring pass when > 1)
    tis_cap: float = 2.0  # with a --rollout-dtype copy: token losses times min(pi_train / pi_sampler, CAP) (0 = off)
    rollout_is: str = "token_truncate"  # the --tis-cap correction: per token or sequence, truncate or mask (0 weight)
    tis_floor: float = 0.0  # lower bound of the correction's ratio (IcePop: --rollout-is token_mask, 0.5 and 5)
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


METHODS = (hard_examples, noise, dapo, dagrpo, gtpo, token_select)  # each method's flags, presets and checks

CORE_PRESETS: dict[str, dict] = {  # each method file adds its own (its PRESETS)
    "grpo": {},
    "dr_grpo": dict(std_normalize=False, aggregation="seq_mean_token_sum_norm"),
    "gspo": dict(loss="gspo", clip_low=3e-4, clip_high=4e-4, mu=2),
    "grpo_ma": dict(thoughts=4, answers=4),
    # 2-GRPO's recipe against 16-GRPO: same rollouts per step (prompts x8) and learning rate x8.
    "two_grpo": dict(
        thoughts=2,
        advantage="two_grpo",
        prompts_per_step=8 * CoreFlags.prompts_per_step,
        lr=8 * CoreFlags.lr,
        clip_high=0.28,
    ),
    "agrae": dict(advantage="agrae"),
    # CISPO: TRL's recommended cap of 5 on the importance weight, its token mean; mu = 2, or every weight is 1
    "cispo": dict(loss="cispo", clip_high=4.0, aggregation="token_mean", mu=2),
    # The field's newer losses at their papers' or reference code's defaults (losses.py says which). With mu = 1 the
    # ratio is 1 and SAPO, KL-Cov and DPPO are the plain policy gradient: their presets take a second epoch.
    "sapo": dict(loss="sapo", mu=2),  # tau 1.0 / 1.05 (the flags' defaults)
    "gmpo": dict(loss="gmpo", clip_low=0.4, clip_high=0.4, mu=2),  # the clip in log space: (e^-0.4, e^0.4)
    "dppo": dict(loss="dppo", aggregation="token_mean", mu=2),  # prime-rl's defaults 0.2, 0.2, 1e-3
    "gpg": dict(loss="gpg", std_normalize=False, aggregation="token_mean", gpg_alpha=True),
    # DeepSeek-V3.2: the off-policy sequence mask at slime's delta and the unbiased KL
    "dsv32": dict(opsm_delta=1e-4, kl_estimator="unbiased", beta=1e-3, mu=2),
}
METHOD_PRESETS = {name: flags for m in METHODS for name, flags in getattr(m, "PRESETS", {}).items()}
PRESETS = {name: (CORE_PRESETS | METHOD_PRESETS)[name] for name in ALGOS}  # in ALGOS' order (--help's)
assert set(PRESETS) == set(CORE_PRESETS) | set(METHOD_PRESETS)


@dataclass
class TrainConfig(*(m.Flags for m in reversed(METHODS)), CoreFlags):  # fields: the core's first, then METHODS'.
    """train.py's flags: the core's (CoreFlags) and each method's (its Flags in methods/), one dataclass; the
    presets (--algo) fill the flags the user did not type, and __post_init__ refuses impossible combinations."""

    # The values of every choice flag (shown by --help) and the range of every numeric one (cli.in_range).
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = dict(
        algo=ALGOS,
        task=TASK_NAMES,
        device=("auto", "cpu", "cuda", "cuda:N"),
        dtype=("auto", "float32", "bfloat16"),
        advantage=("grpo", "two_grpo", "agrae"),
        aggregation=AGGREGATIONS,
        loss=tuple(LOSSES),
        kl_estimator=KL_ESTIMATORS,
        rollout_is=ROLLOUT_IS_MODES,
        lr_schedule=("cosine", "constant"),
        save_dtype=("auto", "float32", "bfloat16", "float16"),
        rollout_dtype=("auto", "float32", "bfloat16"),
    )
    RANGES: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("max_steps", "prompts_per_step", "thoughts", "answers", "max_answer_tokens"), ">= 1"),
        **dict.fromkeys(("reward_workers", "mu", "micro_batch_rows", "max_bad_steps", "eval_examples"), ">= 1"),
        **dict.fromkeys(("seed", "max_thought_tokens", "top_k", "thought_weight", "answer_weight", "beta"), ">= 0"),
        **dict.fromkeys(("tis_cap", "warmup_steps", "weight_decay", "micro_batch_tokens", "eval_every"), ">= 0"),
        **dict.fromkeys(("eval_samples", "save_every", "samples_every"), ">= 0"),
        **dict.fromkeys(("temperature", "top_p", "agrae_alpha", "clip_high", "lr", "grad_clip"), "> 0"),
        **dict(clip_low="[0, 1)"),
        **dict.fromkeys(("sapo_tau_pos", "sapo_tau_neg"), "> 0"),
        **dict.fromkeys(("dppo_mask_low", "dppo_mask_high", "dppo_kl_tau", "tis_floor"), ">= 0"),
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
    if cfg.advantage == "two_grpo" and (cfg.thoughts, cfg.answers) != (2, 1):
        yield FlagError(("advantage",), "needs --thoughts 2 --answers 1", group, "--advantage two_grpo")
    if cfg.sequence_ratio and cfg.loss not in ("clip", "gspo"):
        why = f"is GSPO's ratio (--loss gspo); it contradicts --loss {cfg.loss}"
        yield FlagError(("sequence_ratio",), why, ("loss",))
    one_answer = [  # (fields, how the sentence names them, in use): each needs whole completions as rows
        (("loss",), "--loss gspo", loss_name(cfg) == "gspo" and not cfg.sequence_ratio),
        (("sequence_ratio",), "--sequence-ratio (GSPO)", cfg.sequence_ratio),
        (("advantage",), "--advantage agrae", cfg.advantage == "agrae"),
        (("aggregation",), "--aggregation seq_mean_token_sum_norm", cfg.aggregation == "seq_mean_token_sum_norm"),
    ]
    one_answer += [
        (("loss",), f"--loss {cfg.loss} (one ratio per sequence)", cfg.loss == "gmpo"),
        (("opsm_delta",), "--opsm-delta (one KL per sequence)", cfg.opsm_delta >= 0),
        (("rollout_is",), f"--rollout-is {cfg.rollout_is}", cfg.rollout_is.startswith("sequence")),
    ]
    if cfg.opsm_delta != -1 and not (math.isfinite(cfg.opsm_delta) and cfg.opsm_delta >= 0):
        yield FlagError(("opsm_delta",), f"must be >= 0, or -1 (off), got {cfg.opsm_delta}")
    if cfg.kl_estimator == "unbiased" and cfg.beta == 0:
        yield FlagError(
            ("kl_estimator",), "is the KL penalty's estimator: it needs --beta > 0", subject="--kl-estimator unbiased"
        )
    if cfg.kl_estimator == "unbiased" and cfg.anchors:
        why = "needs pi_old on every token; anchor tokens were not sampled by it"
        yield FlagError(("kl_estimator",), why, ("anchors",), "--kl-estimator unbiased")
    if cfg.tis_cap > 0 and cfg.tis_floor >= cfg.tis_cap:
        yield FlagError(("tis_floor",), f"must be below --tis-cap, got {cfg.tis_floor} and {cfg.tis_cap}")
    for fields, subject, used in one_answer:
        if used and cfg.answers > 1:
            yield FlagError(fields, "needs --answers 1", ("answers",), subject)
    if cfg.resume and os.path.abspath(cfg.resume) == os.path.abspath(cfg.model):
        yield FlagError(("resume",), "and --model name the same directory", ("model",))
    for method in METHODS:
        yield from method.check(cfg)


# Flags a resumed run may change: how long it runs, what it reports and where. Every other flag
# decides what the run computes and must equal the run's own (its checkpoint's train_config.json).
RESUMABLE = (
    *("resume", "out", "overwrite", "max_steps", "device", "reward_workers", "max_bad_steps", "wandb"),
    *("optimizer_offload",),
    *("eval_every", "eval_examples", "eval_samples", "save_every", "save_optimizer", "save_dtype", "samples_every"),
)


def score_pass_needs(cfg: TrainConfig) -> tuple[bool, bool]:
    """What the no-grad score pass before the update runs: (the policy, for old log-probs when mu > 1 and the token
    entropies and log-probs of GTPO's controls and the step's token selections; the reference, when beta > 0).
    The trainer's score pass and the memory estimate both ask here."""
    policy = cfg.mu > 1 or gtpo.needs_entropy(cfg) or token_select.needs_scores(cfg)
    return policy, cfg.beta > 0


def lr_factor(opt_step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then constant or a cosine decay to 10% at the last optimizer step."""
    warm = min(1.0, (opt_step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_schedule == "constant":
        return warm
    progress = min(1.0, opt_step / max(1, cfg.max_steps * cfg.mu - 1))
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def resume_config(cfg: TrainConfig, typed: set[str]) -> TrainConfig:
    """--resume on the command line: the run's own flags, replaced only by the flags typed now
    (setup's check_resume then refuses those that would change what the run computes)."""
    return TrainConfig(**resume_flags(asdict(cfg), typed, asdict(TrainConfig()))) if cfg.resume else cfg
