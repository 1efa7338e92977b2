"""run.py: a training run's long-lived objects (Run) and setup(cfg), which builds them.

setup checks everything a user can get wrong before any model is loaded (the data, the output directory, a
checkpoint to resume, whether the step fits in memory), then loads the policy (with --lora-rank: adapters on the
frozen base), the KL's reference, the tokenizer, the data streams, the optimizer and its schedule, and with
--resume their saved state. train.py's step functions take the Run it returns. With --optimizer-offload the
optimizer is an OffloadedAdamW, AdamW on CPU copies of the weights.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from dataclasses import asdict, dataclass, field, replace

import torch

import checkpoint
import distributed
import lora
import methods
from cli import UserError, changed_flags, start_line
from config import RESUMABLE, TrainConfig, lr_factor
from fused import fuse_for_sampling
from graphs import StaticDecode, can_compile, check_torch, decode_runner
from hf import config_from_hf, load_model, read_model_config
from losses import Objective
from memory import check_memory
from model import Transformer, cast_copy
from sampler import StopText
from tasks import Task, check_prompt_lengths, check_sizes, get_task
from tokenizer import load_tokenizer


@dataclass
class Run:
    """Everything a step needs that outlives the step, passed to each step function."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    task: Task
    pool: list[dict]  # training examples in order: step s, global slot i uses pool[s * P + i]
    streams: dict[str, list[dict]]  # the methods' prompt streams of their own (dapo's top-ups), by name
    heldout: list[dict]
    policy: Transformer  # the trained model (its parameters are sharded in place under FSDP)
    model: torch.nn.Module  # what the update runs: the policy, or its DDP wrapper
    sampler: Transformer  # what sampling and evaluation run: the policy, or its --rollout-dtype copy
    reference: Transformer | None  # frozen starting model for the KL penalty (beta > 0; None under LoRA: the policy)
    tokenizer: object
    # Set by setup after the constructor: the end-of-thought marker (used when answers > 1), the optimizer
    # (--optimizer-offload: it steps CPU float32 copies of the parameters), its schedule, and the trainer state
    # saved with each checkpoint: step, grad_norms, bad_steps, skipped_steps, and the extensions' state.
    marker: StopText = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    scheduler: torch.optim.lr_scheduler.LRScheduler = field(init=False)
    state: dict = field(init=False)
    wandb: object | None = None
    micro_batch_rows: int = 64  # rows per micro-batch: --micro-batch-rows, or what auto chose (memory.check_memory)
    static_step: StaticDecode | None = None  # CUDA graphs (and --compile's step) sampling and evaluation run
    guard: distributed.WeightGuard | None = None  # refuses weights an update broke (set by setup)
    teacher: Transformer | None = None  # --teacher, or a self-teacher's initial copy (methods/teacher.py)

    @property
    def fsdp(self) -> bool:
        return self.world > 1 and self.cfg.fsdp

    @property
    def autocast(self) -> torch.dtype | None:
        """bf16 autocast (None = plain float32)."""
        bf16 = self.cfg.dtype == "bfloat16" or (self.cfg.dtype == "auto" and self.device.type == "cuda")
        return torch.bfloat16 if bf16 else None

    @functools.cached_property
    def objective(self) -> Objective:
        """--loss's entry of the loss table (methods.LOSSES) as the methods modify it, built once per run."""
        return methods.objective(self.cfg)

    @contextlib.contextmanager
    def reference_model(self):
        """The KL's reference: the frozen copy, or under LoRA the policy with its adapters off (no second copy)."""
        if self.reference is not None:
            yield self.reference
        else:
            with lora.adapters_off(self.policy):
                yield self.policy

    def precision(self):
        """The autocast context of every forward (bf16 autocast, or a no-op in float32)."""
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def skip_update(self, step: int) -> None:
        """A non-finite loss or gradient: the update is skipped with a warning; --max-bad-steps in a row end the run."""
        self.state["bad_steps"] += 1
        self.state["skipped_steps"] += 1
        warnings.warn(f"step {step}: non-finite loss or gradient, update skipped", stacklevel=3)
        if self.state["bad_steps"] >= self.cfg.max_bad_steps:
            n = self.cfg.max_bad_steps
            raise SystemExit(f"{n} consecutive non-finite steps at step {step}: lower --lr or check the rewards")

    def rollout_weights(self):
        """Around sampling and evaluation. FSDP: whole weights while ranks run different numbers of
        forwards (full_params); not needed when the sampler is its own --rollout-dtype copy."""
        return distributed.full_params(self.policy, self.fsdp and self.sampler is self.policy)


def setup(cfg: TrainConfig) -> Run:
    """Distributed init; then data, output directory and checkpoint are checked before any model is
    loaded; then models, tokenizer, data streams, optimizer and, with --resume, their saved state."""
    check_torch()  # a torch older than the floor: one sentence now
    rank, world, device = distributed.setup_distributed(cfg)
    rollout = distributed.rollout_dtype(cfg)  # float32: the policy samples itself; else a cast copy does
    methods.check_rollout_dtype(cfg, rollout)
    distributed.fixed_mmap_threshold()  # CPU: freed activations go back to the OS (heap fragments cost GiBs at 0.5B)
    task = methods.choose_data(get_task(cfg.task, cfg.data or None, cfg.test_data or None), cfg)
    check_sizes(task, train=cfg.prompts_per_step, test=cfg.eval_examples)
    task = task if cfg.system_prompt is None else replace(task, system_prompt=cfg.system_prompt)
    check_completion_fits(cfg.completion_limit, model_context(cfg.model))  # before the memory estimate blames memory
    # a step that cannot fit is refused here, before the data pool; --micro-batch-rows auto is settled here
    memory = check_memory(cfg, task, device, world)
    # The data order: a deterministic stream of training examples (prefix-stable in --max-steps); a method may draw
    # prompts from streams of its own (dapo's top-ups)
    pool, streams = task.train(cfg.max_steps * cfg.prompts_per_step, cfg.seed), methods.streams(task, cfg)
    heldout = task.test(cfg.eval_examples, cfg.seed)
    extra = [ex for stream in streams.values() for ex in stream]
    methods.check_data(task, cfg, pool + extra)  # DaGRPO's anchors need reference solutions
    resume_dir = checkpoint.find_checkpoint(cfg.resume) if cfg.resume else ""
    if resume_dir:
        checkpoint.check_resume(asdict(cfg), resume_dir, asdict(TrainConfig()), RESUMABLE)
        done = checkpoint.read_trainer_step(resume_dir)  # a finished run (final/ written): say how to extend it
        if done >= cfg.max_steps and os.path.isdir(os.path.join(os.path.dirname(resume_dir), "final")):
            if rank == 0:
                print(f"--resume {resume_dir}: already at its last step ({done}); to extend it, --max-steps N > {done}")
            raise SystemExit(0)
    if rank == 0:
        checkpoint.lock_run_dir(cfg.out)  # one writer per run directory: a second train.py on it is refused
        checkpoint.check_out_dir(cfg.out, resume_dir, cfg.overwrite)
        checkpoint.prepare_out(cfg.out, checkpoint.read_trainer_step(resume_dir) if resume_dir else 0)
    torch.manual_seed(cfg.seed)
    # LoRA: adapters on the frozen starting model (a LoRA checkpoint holds the adapters only)
    policy = load_model(cfg.model if cfg.lora_rank else resume_dir or cfg.model, dtype=torch.float32, device=device)
    if cfg.lora_rank:
        lora.add_lora(policy, cfg.lora_rank, cfg.lora_alpha, lora.parse_targets(cfg.lora_targets), seed=cfg.seed)
        if resume_dir:
            lora.load_adapters(policy, resume_dir)
    policy.gradient_checkpointing = memory.gradient_checkpointing  # the flag, or what --micro-batch-rows auto chose
    # a checkpoint carries its run's tokenizer files
    tokenizer = load_tokenizer(resume_dir or cfg.model, enable_thinking=cfg.enable_thinking)
    # the KL's frozen starting model: a copy, or under LoRA the policy itself with its adapters off (no copy)
    own = cfg.beta and not cfg.lora_rank
    reference = load_model(cfg.model, dtype=torch.float32, device=device).requires_grad_(False) if own else None
    # A thought ends when its text contains the marker, whatever tokens spell it (sampler.StopText).
    marker = StopText(cfg.end_of_thought, tokenizer.encode(cfg.end_of_thought), tokenizer.decode, tokenizer.vocab_size)
    new, context = cfg.completion_limit + len(marker.ids) * (cfg.answers > 1), policy.config.max_position_embeddings
    check_completion_fits(new, context)  # now with the end-of-thought marker's tokens
    limit = f"the model's context of {context} tokens minus the completion limit of {new}"
    check_prompt_lengths(tokenizer, pool + extra + heldout, task.system_prompt, context - new, limit)
    fsdp = world > 1 and cfg.fsdp
    model = distributed.wrap(policy, world, device, fsdp)
    # fused: one kernel over all parameters (7.6x the per-tensor loop on this CPU, as TRL's default
    # adamw_torch_fused); FSDP's DTensors keep the default. --optimizer-offload: AdamW on CPU copies (OffloadedAdamW).
    names, trainable = zip(*[(n, p) for n, p in policy.named_parameters() if p.requires_grad])  # LoRA: adapters
    kw = dict(lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, fused=not fsdp)
    optimizer = OffloadedAdamW(trainable, device, **kw) if cfg.optimizer_offload else torch.optim.AdamW(trainable, **kw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    state = dict(step=0, grad_norms=[], bad_steps=0, skipped_steps=0)
    if resume_dir:
        state = checkpoint.load_trainer_state(resume_dir, policy, optimizer, scheduler, fsdp)
        if cfg.optimizer_offload:  # the resumed masters
            optimizer.copy_from_params()
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    guard = distributed.WeightGuard(list(names), masters, world, f"lower --lr (now {cfg.lr:g})")
    # On CUDA decode replays CUDA graphs (graphs.py), which hold the weights' addresses: not when FSDP gathers
    # the policy's weights anew for each rollout. --compile compiles the step they capture.
    graphs = cfg.cuda_graphs and not (fsdp and rollout == "float32")
    copy = lora.merged_copy if cfg.lora_rank else cast_copy  # LoRA: the sampler runs the merged weights
    # a copy runs fused projections and norms (fused.py: fewer kernels per decode step, its small functions
    # compiled on CUDA with graphs); the policy never does
    small = can_compile(device, graphs)
    sampler = policy if rollout == "float32" else fuse_for_sampling(copy(policy, getattr(torch, rollout)), small)
    run = Run(cfg, rank, world, device, task, pool, streams, heldout, policy, model, sampler, reference, tokenizer)
    run.micro_batch_rows = memory.micro_batch_rows
    run.marker, run.optimizer, run.scheduler, run.state, run.guard = marker, optimizer, scheduler, state, guard
    run.static_step = decode_runner(device, graphs=graphs, compile=cfg.compile)
    methods.start(run)  # the methods' checks and state (a resumed run keeps its own)
    if rank == 0:
        with checkpoint.writing(path := os.path.join(cfg.out, "config.json")), open(path, "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        if cfg.wandb:
            import wandb  # optional extra

            run.wandb = wandb.init(project=cfg.wandb, config=asdict(cfg))
        # what will run: every flag that differs from its default (the preset's too), and the rollouts' dtype
        flags = changed_flags(cfg, skip=("algo", "model", "task", "out", "resume", "device", "dtype", "rollout_dtype"))
        where = f"{device}, {'bf16 autocast' if run.autocast else 'float32'}"
        where += f", a {rollout} rollout copy" if rollout != "float32" else ""
        kw = dict(algo=cfg.algo, flags=flags, model=cfg.model, task=cfg.task, out=cfg.out, step=run.state["step"])
        line = start_line(max_steps=cfg.max_steps, resumed_from=resume_dir, device=where, memory=memory.phrase, **kw)
        print(line + (f"\n{memory.warning}" if memory.warning else ""))  # an estimate above memory.AUTO_MARGIN
    return run


def model_context(path: str) -> int | None:
    """The context length config.json gives the model at `path`, read without its weights; None when it cannot be
    read (load_model says why, after the output directory's checks)."""
    try:
        return config_from_hf(read_model_config(path), path).max_position_embeddings
    except (OSError, ValueError):
        return None


def check_completion_fits(new: int, context: int | None) -> None:
    """Refuse completions of `new` tokens that leave no room for a prompt in the model's context (None: unknown)."""
    if context is not None and new >= context:
        room = f"leave no room for a prompt in the model's context of {context} tokens"
        raise UserError(f"--max-thought-tokens + --max-answer-tokens ({new}) {room}")


class OffloadedAdamW(torch.optim.AdamW):
    """--optimizer-offload: AdamW over CPU float32 copies of the parameters, its state there too (8 bytes per
    parameter off the GPU). step() copies the gradients to the copies, steps them, and copies the new weights back:
    the same update as AdamW on the parameters."""

    def __init__(self, params, device: torch.device, **kw) -> None:
        self.params = list(params)
        super().__init__([host_copy(p, device) for p in self.params], **kw)

    def copy_from_params(self) -> None:
        """The copies from the parameters (a resumed run's float32 masters were loaded into them)."""
        with torch.no_grad():
            for h, p in zip(self.param_groups[0]["params"], self.params, strict=True):
                h.copy_(p)

    def step(self, closure=None):
        host = self.param_groups[0]["params"]
        for h, p in zip(host, self.params, strict=True):
            h.grad = p.grad.to("cpu", torch.float32)
        loss = super().step(closure)
        with torch.no_grad():
            for h, p in zip(host, self.params, strict=True):
                p.copy_(h, non_blocking=True)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.params:
            p.grad = None


def host_copy(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """--optimizer-offload: a CPU float32 copy of parameter p (pinned, for fast copies, when p is on a GPU)."""
    h = p.detach().to("cpu", torch.float32, copy=True)
    return h.pin_memory() if device.type == "cuda" else h
