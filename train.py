"""train.py: RL for LLM reasoning, one readable loop: plain GRPO with GRPO-MA's tree.

    python train.py                                   # bundled default: GRPO-MA, synthetic task, CPU
    python train.py --algo grpo --model PATH --task gsm8k --data gsm8k.jsonl --device cuda
    torchrun --nproc_per_node 8 train.py --algo dapo ...   # DDP over 8 GPUs (gloo on CPU)
    torchrun --nproc_per_node 8 train.py --fsdp ...        # FSDP2: weights, grads, optimizer state sharded

One step is the README's numbered algorithm, one function each, called in this order by main():
  1. sample      K thoughts per prompt, then M answers from each thought (sampler.sample_tree)
  2. score       the step's record (pack.Group): rewards [P, K, M] from the completion text
  3. pack        one row per thought: thought | answer_1 .. answer_M, each thought once (tree attention);
                 each prompt runs once and its K rows attend to it (pack.py)
  4. score_pass  no-grad forward: old log-probs (mu > 1), reference log-probs (beta > 0), entropy
  5. advantages  thought [P, K] and answer [P, K, M] advantages, then per-token adv and weight
  6. update      mu epochs over micro-batches of losses.policy_loss (--loss picks the objective), AdamW step
  7. log, evaluate, save

Each paper's extension enters at one seam, one call into its file in methods/ (skip the file, skip the paper):
choose the data (hard_examples), sample (tools: completions that call a tool), transform rewards (noise, dapo),
transform rollouts (dapo's dynamic sampling, dagrpo's anchors), advantages and weights (noise, dagrpo, gtpo), the
policy loss (methods.LOSSES). config.py
gathers the core's flags and the methods'; setup(cfg) in run.py builds the run's long-lived objects.
Left out on purpose: one optimizer step per epoch over the whole batch (mu = 1 is fully on-policy, no
mini-batches); rows of a micro-batch are padded to its longest row; evaluation runs on rank 0 only.
"""

from __future__ import annotations

import cli

if __name__ == "__main__":  # a mistyped flag fails here, in a fraction of a second, before torch loads
    cli.check_flag_names("config.py:CoreFlags", "methods/*.py:Flags")

import contextlib
import copy
import functools
import itertools
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, replace
from typing import NoReturn

import torch
import torch.distributed as dist
from tqdm import tqdm

import advantage
import checkpoint
import distributed
import lora
import methods
from cli import Stopped, UserError, end_summary, eval_size, parse_config, stop_signals, user_errors
from config import PRESETS, TrainConfig, resume_config, score_pass_needs
from distributed import all_sum, derive_seed
from graphs import decode_path
from heldout import evaluate
from hf import bundled, save_model
from losses import Tokens, policy_loss
from metrics import SUMS, StepClock, add_micro_batch, rollout_metrics, update_metrics
from model import VocabGrads, copy_weights_
from pack import (
    Batch,
    Group,
    completions,
    pack,
    per_completion,
    rollouts,
    select_rows,
    split_rows,
    step_prompts,
    token_stats,
)
from rewards import score_batch
from run import Run, setup
from sampler import Tree, sample_tree
from tasks import render_prompt
from tokenizer import decode_completion

# -----------------------------------------------------------------------------
# Steps 1-2: sample and score


def sample(run: Run, examples: list[dict], seeds: list[int]) -> tuple[list[list[int]], Tree]:
    """1. Render P prompts and sample K thoughts x M answers each (M = 1: K plain completions)."""
    cfg, M = run.cfg, run.cfg.answers
    prompts = [render_prompt(run.tokenizer, ex, run.task.system_prompt) for ex in examples]
    thought, answer, marker = cfg.max_thought_tokens, cfg.max_answer_tokens, run.marker
    if M == 1:  # no thought: the completion is the answer and gets both limits
        thought, answer, marker = 0, cfg.completion_limit, ()
    kw = dict(
        max_thought_tokens=thought, max_answer_tokens=answer, end_of_thought=marker, stop_ids=run.tokenizer.stop_ids
    )
    kw |= dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seeds, static_step=run.static_step)
    with torch.no_grad(), run.precision():
        own = methods.sample(run, examples, seeds)  # a method's own rollouts: with a tool (methods/tools.py)
        return own or (prompts, sample_tree(run.sampler, prompts, k=cfg.thoughts, m=M, **kw))


def score(run: Run, examples: list[dict], prompts: list[list[int]], tree: Tree, seeds: list[int]) -> list[Group]:
    """2. The step's record: every completion's text, reward and the task's own correctness. Transform rewards:
    the methods' rewards seam (reward noise, DaGRPO's credit, DAPO's overlong penalty)."""
    groups = rollouts(examples, prompts, tree, run.cfg.thoughts, run.cfg.answers)
    done = list(completions(groups))
    context = [[False] * len(t.tokens) + a.context for _, t, a in done]  # a tool's output: its stop ids end nothing
    texts = [decode_completion(run.tokenizer, t.tokens + a.tokens, c) for (_, t, a), c in zip(done, context)]
    exs = [g.example for g, _, _ in done]
    reward = torch.tensor(score_batch(run.task.reward, texts, exs, run.cfg.reward_workers), dtype=torch.float32)
    for (_, _, a), text, ex in zip(done, texts, exs):
        a.text, a.correct = text, float(run.task.correct(text, ex))
    lengths = torch.tensor([len(t.tokens) + len(a.tokens) for _, t, a in done])
    step = methods.Scored([a for _, _, a in done], texts, exs, lengths, seeds, len(groups))
    reward = methods.chain(run, "rewards", reward, step)
    for (_, _, a), r in zip(done, reward.tolist()):
        a.reward = r
    return groups


def draw(run: Run, examples: list[dict], seeds: list[int]) -> list[Group]:
    """1-2 for fresh prompts: sample, then score."""
    return score(run, examples, *sample(run, examples, seeds), seeds)


def log_samples(run: Run, step: int, groups: list[Group]) -> None:
    """A few of the step's completions, as sampled, to OUT/samples.jsonl: the text the reward read and, with a tool,
    the whole transcript (the policy's turns and the observations)."""
    for g, t, a in itertools.islice(completions(groups), 4):
        row = dict(step=step, prompt=g.example["prompt"], completion=a.text, reward=a.reward)
        if any(a.context):
            row["transcript"] = run.tokenizer.decode(t.tokens + a.tokens)
        log(run, row, file="samples.jsonl")


# -----------------------------------------------------------------------------
# Steps 4-6: score pass, advantages, update


def score_pass(run: Run, micro: list[tuple[torch.Tensor, Batch]], shape: torch.Size) -> tuple[torch.Tensor | None, ...]:
    """4. No-grad forwards before the update, each (B, T) in the logical layout or None when not needed: the
    policy's log-probs and token entropy (mu > 1: the old log-probs; GTPO; the step's token selections), the
    reference's log-probs (beta > 0)."""
    cfg = run.cfg
    need_policy, need_reference = score_pass_needs(cfg)  # mu > 1 or a method's (GTPO, the selections); beta > 0
    old_logp, entropy = torch.zeros(shape, device=run.device), torch.zeros(shape, device=run.device)
    ref_logp = torch.zeros(shape, device=run.device) if need_reference else None
    with torch.no_grad(), run.precision():
        for rows, mb in micro:
            if need_policy:
                old_logp[rows], entropy[rows] = token_stats(run.policy, mb, cfg.temperature, entropy=True)
            if need_reference:
                with run.reference_model() as reference:
                    ref_logp[rows] = token_stats(reference, mb, cfg.temperature)[0]
    return (old_logp, ref_logp, entropy) if need_policy else (None, ref_logp, None)


def sequence_advantages(run: Run, groups: list[Group], reward: torch.Tensor, batch_accuracy: float) -> tuple:
    """5a. Thought advantages (P, K) and answer advantages (P, K, M) (M = 1: one per completion) of the rewards
    [P, K, M]: GRPO-MA's (GRPO's when M = 1), or those of --advantage's method or of another method's (RLOO,
    2-GRPO, A-GRAE, the step's std, DaGRPO's pair mask)."""
    adv_thought, adv_answer = advantage.grpo_ma_advantages(reward, std_normalize=run.cfg.std_normalize)
    thought, answer = methods.advantages(run, groups, reward, batch_accuracy)
    return adv_thought if thought is None else thought, adv_answer if answer is None else answer


def advantages(run: Run, groups: list[Group], batch: Batch, batch_accuracy: float) -> tuple:
    """5. Per-token advantage and weight (B, T) for the whole global step, the trained-token mask (B, T), and the
    methods' metrics (their token selections are the batch's to carry to the update).

    The weight carries the loss normaliser of the WHOLE step (summed over ranks), so neither the
    micro-batch split nor the world size can change the gradient."""
    cfg, world, dev = run.cfg, run.world, run.device
    # the rewards the advantages see: noise-corrected, the KL in the reward (methods' advantage_rewards)
    reward = methods.chain(run, "advantage_rewards", per_completion(groups, "reward"), batch)
    adv_thought, adv_answer = sequence_advantages(run, groups, reward, batch_accuracy)
    mask = batch.thought | (batch.answer_id >= 0)
    raw = adv_answer.flatten()  # (P*K*M,) = one per row when M == 1: the group advantage
    seq_adv = methods.chain(run, "sequence_advantages", raw, batch, mask)  # GTPO's entropy control
    mask = methods.chain(run, "trained_mask", mask, groups, batch)  # DAPO: groups still flat after the top-ups drop out
    # Thought tokens carry their thought's advantage, answer tokens their own answer's.
    seq_adv = seq_adv.view(adv_answer.shape).to(dev)
    adv = advantage.grpo_ma_token_advantages(adv_thought.to(dev), seq_adv, batch.thought, batch.answer_id)
    metrics = {}
    adv = methods.chain(run, "token_advantages", adv, groups, batch, mask, reward, metrics)  # REINFORCE++, OPD
    rows, M = all_sum(batch.ids.shape[0], world).item(), cfg.answers  # thoughts over all ranks
    if M > 1 and cfg.aggregation == "seq_mean_token_mean":
        kw = dict(thought_weight=cfg.thought_weight, answer_weight=cfg.answer_weight, num_thoughts=rows)
        answer_id = torch.where(mask, batch.answer_id, -1)
        weight = advantage.grpo_ma_token_weights(batch.thought & mask, answer_id, num_answers=rows * M, **kw)
    else:
        m = mask.float()
        kw = dict(max_len=cfg.completion_limit, num_seqs=rows, num_tokens=all_sum(m.sum(), world).item())
        weight = advantage.token_weights(m, cfg.aggregation, **kw)
    # GTPO's conflict tokens, GPG's alpha: the step's weight, the KL penalty's too
    weight = methods.chain(run, "token_weights", weight, groups, batch, raw.to(dev), mask, metrics)
    # Clip-Cov, KL-Cov, the 80/20 entropy mask: selections over the whole step's tokens, for the surrogate only
    metrics |= methods.select(run, batch, adv, mask)
    return adv, weight, mask, metrics


def update(run: Run, step: int, batch: Batch, micro: list[tuple[torch.Tensor, Batch]]) -> tuple[dict, torch.Tensor]:
    """6. mu epochs; each accumulates policy_loss over every micro-batch (row indices into `batch`, the rows),
    then one clipped AdamW step. Returns the first epoch's sums of loss and token-weighted diagnostics (the clip
    fraction: over every epoch, as TRL and verl log it; the first epoch's ratio is 1 when mu > 1), and the last
    gradient norm."""
    cfg, world = run.cfg, run.world
    sums = dict.fromkeys(SUMS, 0.0)
    entropy_grad = methods.needs(cfg, "needs_entropy_grad")  # a loss term on the token entropy (the entropy bonus)
    # each micro-batch's trained tokens, the weight of its diagnostics: the same in every epoch, one sync per step
    trained = torch.stack([batch.mask[rows].sum() for rows, _ in micro]).tolist()
    for epoch in range(cfg.mu):
        with run.precision():  # each shared prompt once per epoch, when that saves work; mu > 1: per micro-batch, as
            tables = VocabGrads()  # the (V, C) tables' gradients summed over micro-batches, handed by the last
            shared = step_prompts(run.model, batch, micro, tables) if cfg.mu == 1 else None  # ratio 1 exactly
        for i, (rows, mb) in enumerate(micro):
            sync = tables.last = i == len(micro) - 1  # DDP/FSDP: reduce gradients once, after the last micro-batch
            no_sync = world > 1 and not cfg.fsdp and not sync
            run.policy.set_requires_gradient_sync(sync) if run.fsdp else None  # FSDP: the same, by its own switch
            with run.model.no_sync() if no_sync else contextlib.nullcontext(), run.precision():
                old = None if batch.old_logp is None else batch.old_logp[rows]  # None: mu = 1, the log-probs, detached
                kw = dict(entropy=epoch == 0 and batch.entropy is None, entropy_grad=entropy_grad, vocab_grads=tables)
                prompts = shared and (shared if sync else shared.leaves)  # the step's prompts, run once (or None)
                logp, ent = token_stats(run.model, mb, cfg.temperature, **kw, prompts=prompts)
                mask = batch.mask[rows]
                tok = Tokens(logp, logp.detach() if old is None else old, **batch.per_token(rows))  # adv, weights, ...
                sampled = mask if tok.off_policy is None else mask & ~tok.off_policy  # the tokens the sampler drew
                # the rollout-mismatch weights, V3.2's sequence mask: per micro-batch, on the current log-probs
                tok = methods.chain(run, "micro_batch", tok, mb, sampled, sums, epoch)
                loss, metrics = policy_loss(tok, cfg, run.objective)
                loss = methods.chain(run, "loss_terms", loss, tok, ent)
                # DDP/FSDP average over ranks (our loss is already the global sum); the shared prompts' backward: once
                shared.backward(loss * world) if shared and sync else (loss * world).backward()
            sums["clip_frac"] += metrics["clip_frac"] * trained[i] / cfg.mu  # the mean over epochs
            if epoch == 0:  # diagnostics on the sampling-time parameters, token-weighted
                per_token = (logp, mb.sampler_logp, mask, sampled, ent if ent is not None else batch.entropy[rows])
                add_micro_batch(sums, trained[i], loss, metrics, *per_token, tok.off_policy)
        grad_norm = optimizer_step(run, step, math.isfinite(sums["loss"]))
    return sums, grad_norm


def optimizer_step(run: Run, step: int, loss_finite: bool) -> torch.Tensor:
    """Clip the global gradient norm, step AdamW and the schedule, and refuse weights the update broke (NaN, inf,
    a 1000-fold jump: run.guard stops the run before anything uses or saves them). A non-finite loss or gradient
    skips the update (Run.skip_update). Returns the gradient norm."""
    trainable = [p for p in run.policy.parameters() if p.requires_grad]  # LoRA: the adapters
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, run.cfg.grad_clip)
    if torch.isfinite(grad_norm) and loss_finite:
        run.optimizer.step()  # --optimizer-offload: on CPU copies of the weights (run.OffloadedAdamW)
        run.scheduler.step()
        run.guard.check(step + 1)
        if run.sampler is not run.policy:  # the rollout copy follows the new weights (LoRA: merged)
            (lora.copy_merged_ if run.cfg.lora_rank else copy_weights_)(run.sampler, run.policy)
        run.state["bad_steps"] = 0
    else:
        run.skip_update(step)
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm


# -----------------------------------------------------------------------------
# Step 7: log, evaluate, save


def log(run: Run, row: dict, file: str = "metrics.jsonl") -> None:
    """The one logging call: a line of OUT/file (+ wandb for metrics), on rank 0."""
    if run.rank == 0:
        checkpoint.append_row(os.path.join(run.cfg.out, file), row)
        if run.wandb is not None and file == "metrics.jsonl":
            run.wandb.log(row, step=row["step"])


def evaluate_heldout(run: Run, step: int) -> dict:
    """Held-out greedy accuracy, mean@n and pass@k (heldout.evaluate) on rank 0, logged as eval/..."""
    cfg = run.cfg
    with run.rollout_weights():  # FSDP: every rank gathers, then rank 0 alone runs forwards
        if run.rank != 0:
            return {}
        kw = dict(n=cfg.eval_samples, temperature=cfg.temperature, max_new_tokens=cfg.completion_limit)
        kw |= dict(static_step=run.static_step, rollout=methods.evaluator(run))  # with the tool when --tools is on
        with run.precision():
            res = evaluate(run.sampler, run.tokenizer, run.task, run.heldout, seed=derive_seed(cfg.seed, 10**9), **kw)
    row = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
    log(run, row)
    return row


def save(run: Run, path: str) -> None:
    """A checkpoint at `path`: HF weights in --save-dtype, tokenizer files and trainer state (with
    --save-optimizer: the optimizer, and float32 masters when the weights are written in less)."""
    cfg = run.cfg
    fsdp_state = distributed.gather_full_state(run.policy, run.optimizer) if run.fsdp else None
    weights, optim = fsdp_state or (None, run.optimizer.state_dict())
    write_model = None
    if cfg.lora_rank:  # the adapters alone, in PEFT's format, in their own float32 (every rank gathers them)
        adapters = lora.adapter_tensors(run.policy, cfg.model)  # in the layout of the base checkpoint's class
        write_model = functools.partial(lora.write_adapters, adapters, lora.adapter_config(run.policy, cfg.model))
    if run.rank == 0:
        dtype = None if cfg.save_dtype == "auto" else getattr(torch, cfg.save_dtype)
        lossy = checkpoint.saves_masters(cfg, run.policy.config.torch_dtype)  # weights written in less than float32
        masters = (run.policy.state_dict() if weights is None else weights) if lossy else None
        optim, scheduler = optim if cfg.save_optimizer else None, run.scheduler.state_dict()
        state = dict(optimizer=optim, scheduler=scheduler, trainer=run.state, config=asdict(cfg))
        state["master_weights"] = masters
        kw = dict(weights=weights, dtype=dtype, write_model=write_model)
        checkpoint.save_checkpoint(path, run.policy, cfg.model, state, asdict(cfg), **kw)
    if run.world > 1:
        dist.barrier()


def save_merged(run: Run) -> None:
    """--merge: OUT/merged, a full HF checkpoint of the LoRA run's final weights (adapters merged in)."""
    merged = lora.merged_state_dict(run.policy)  # every rank: FSDP gathers
    if run.rank == 0:
        dtype = None if run.cfg.save_dtype == "auto" else getattr(torch, run.cfg.save_dtype)
        path = os.path.join(run.cfg.out, "merged")
        save_model(run.policy, path, tokenizer_dir=run.cfg.model, state_dict=merged, dtype=dtype)


# -----------------------------------------------------------------------------
# The loop


def main(cfg: TrainConfig) -> dict:
    run, t_start = setup(cfg), time.perf_counter()
    P_local = cfg.prompts_per_step // run.world
    if run.state["step"] == 0:
        evaluate_heldout(run, 0)
    bar = tqdm(total=cfg.max_steps, initial=run.state["step"], disable=run.rank != 0, desc="train", dynamic_ncols=True)
    resume = ("python" if run.world == 1 else "torchrun ...") + f" train.py --resume {cfg.out}"
    with stop_signals(resume) as stop, bar:  # SIGINT, SIGTERM: stop at the next step boundary, with a checkpoint
        state, step = run.state, run.state["step"]
        try:
            for step in range(run.state["step"], cfg.max_steps):
                state = copy.deepcopy(run.state)  # the step's start: what a checkpoint after an error in it holds
                clock = StepClock(run.device)  # each phase's time and peak memory
                slots = [run.rank * P_local + i for i in range(P_local)]  # global prompt slots of this rank
                examples = [run.pool[step * cfg.prompts_per_step + s] for s in slots]
                with run.rollout_weights():  # FSDP: whole weights while ranks run different numbers of forwards
                    # 1. sample: K thoughts x M answers for this rank's share of the global batch
                    seeds = [derive_seed(cfg.seed, step, s) for s in slots]
                    prompts, tree = sample(run, examples, seeds)
                    clock.lap("sample")
                    # 2. score: the step's record, rewards [P, K, M]
                    groups = score(run, examples, prompts, tree, seeds)
                    correct = per_completion(groups, "correct")
                    batch_accuracy = (all_sum(correct.mean(dim=(1, 2)).sum(), run.world) / cfg.prompts_per_step).item()
                    counts = {"resampled": 0}  # this rank's counts of the resample and rollouts seams, for the metrics
                    # resample: DAPO's dynamic sampling redraws the groups whose rewards are all equal
                    groups = methods.chain(run, "resample", groups, step, slots, functools.partial(draw, run), counts)
                sampled = rollout_metrics(groups, run.world, cfg.answers)
                if cfg.samples_every and (step + 1) % cfg.samples_every == 0:
                    log_samples(run, step + 1, groups)
                # transform rollouts (after their metrics): DaGRPO's anchors, a reference where no rollout is correct
                groups = methods.chain(run, "rollouts", groups, counts)
                # --staleness K: train on the groups sampled K steps ago (methods/staleness.py); none in the first K
                groups, batch_accuracy = methods.chain(run, "queue", (groups, batch_accuracy), step, counts)
                clock.lap("score")
                if not groups:  # a step that only samples: its row holds the rollouts' metrics, no update's
                    run.state["step"], state = step + 1, run.state
                    row = {"step": step + 1, **sampled} | clock.row(sampled["tokens/generated"])
                    end_of_step(run, step, row, stop, bar)
                    continue

                # 3. pack: one row per thought; micro-batches cut once, for the score pass and every epoch
                batch = pack(groups, run.tokenizer.pad_id, run.device, cfg.share_prompt)
                cuts = split_rows(batch, run.micro_batch_rows, cfg.micro_batch_tokens)  # auto: what fits
                micro = [(rows, select_rows(batch, rows)) for rows in cuts]
                # 4. score pass (no grad): old log-probs, reference log-probs, entropy
                batch.score_logp, batch.ref_logp, batch.entropy = score_pass(run, micro, batch.ids.shape)
                batch.old_logp = batch.score_logp if cfg.mu > 1 else None
                batch = methods.chain(run, "scores", batch, micro, groups)  # a teacher's log-probs (OPD, RLSD, SDPO)
                clock.lap("score_pass")
                # 5. advantages: per sequence, then per-token adv and weight for the whole step
                batch.adv, batch.weight, batch.mask, selection = advantages(run, groups, batch, batch_accuracy)
                # 6. update: mu epochs, each one optimizer step over all micro-batches
                state = None  # the weights change: no checkpoint after an error until the step is done
                sums, grad_norm = update(run, step, batch, micro)
                clock.lap("update")

                # 7. log, evaluate, save
                run.state["step"], state = step + 1, run.state  # the step is done: an error now keeps it
                row = {"step": step + 1, **sampled, "batch_accuracy": batch_accuracy, "resampled": counts["resampled"]}
                lr, kl = run.scheduler.get_last_lr()[0], {} if cfg.beta > 0 else {"kl": None}  # no reference, no KL
                row |= update_metrics(sums, batch.mask, grad_norm, run.state, run.world, lr=lr, **kl)
                row |= selection | methods.metrics(run, sums, counts) | clock.row(sampled["tokens/generated"])
                end_of_step(run, step, row, stop, bar)
        except Exception as e:  # a bug, a library's error, a full disk: never lose the steps done
            stop_on_error(run, e, step, state, stop.resume, bar)
    save(run, os.path.join(cfg.out, "final"))
    if cfg.merge:
        save_merged(run)
    if run.world > 1:
        dist.destroy_process_group()
    return finish(run, time.perf_counter() - t_start)


def end_of_step(run: Run, step: int, row: dict, stop, bar: tqdm) -> None:
    """A step's row logged and drawn (at a stop here the bar and the checkpoint show the same step); then evaluate,
    save, and stop at this boundary if a SIGINT or SIGTERM came."""
    log(run, row)
    bar.update()
    bar.set_postfix({k: round(row[k], 3) for k in ("reward/mean", "accuracy", "gss") if k in row})
    # the last step's evaluation too: every row of a step is logged before its checkpoint is written
    if (run.cfg.eval_every and (step + 1) % run.cfg.eval_every == 0) or step + 1 == run.cfg.max_steps:
        evaluate_heldout(run, step + 1)
    if run.cfg.save_every and (step + 1) % run.cfg.save_every == 0:
        save(run, os.path.join(run.cfg.out, f"step-{step + 1}"))
    if all_sum(stop.signum, run.world).item() and step + 1 < run.cfg.max_steps:  # a SIGINT or SIGTERM came
        stop_at_boundary(run, step + 1, stop.signum, stop.resume)


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
        checkpoint.release_run_dir(cfg.out)
    raise Stopped(signum, message)


def stop_on_error(run: Run, error: Exception, step: int, state: dict | None, resume: str, bar: tqdm) -> NoReturn:
    """An unexpected exception ended the run in step `step` + 1: as for a signal, a checkpoint of the last completed
    step first (`state`: the trainer state it ended with; None when the error came mid-update, whose weights no
    checkpoint may hold), then the traceback and a last line that says what holds the run (exit status 1). A
    ValueError or OSError is one sentence instead, with that line appended (status 2, as cli.user_errors); a
    UserError, a stop the trainer chose, passes unchanged."""
    bar.close()  # the bar's last line above what follows
    if isinstance(error, UserError):  # a stop the trainer chose (broken weights, a removed run directory)
        raise error  # its sentence says what is intact
    cfg, done = run.cfg, (state or {}).get("step", 0)
    path = os.path.join(cfg.out, f"step-{done}")
    last = checkpoint.checkpoint_dirs(cfg.out)
    kept = f"the last checkpoint, {last[0]}, stands" if last else "no checkpoint was written"
    if state is None:
        note = f"it came during the update, whose weights are not saved: {kept}"
    elif done == 0:
        note = "no step had completed, so no checkpoint was written: start the run again (--overwrite)"
    elif run.world > 1:  # the other ranks may be gone: a save would wait for them forever
        note = f"with several processes no checkpoint is written after an error: {kept}"
    else:
        note = f"{path} holds step {done}: {resume}"
        if not os.path.isdir(path):  # --save-every may have just written it
            run.state = state
            try:
                save(run, path)
            except Exception as e:  # noqa: BLE001 -- the first error is the one to report
                note = f"a checkpoint of step {done} could not be written ({e}): {kept}"
    if run.rank == 0:
        checkpoint.release_run_dir(cfg.out)
    message = f"the run stopped on an error in step {step + 1} of {cfg.max_steps}; {note}"
    if isinstance(error, (ValueError, OSError)) and not os.environ.get("NANORL_TRACEBACK"):
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{said}; {message}") from None
    traceback.print_exception(error)
    print(f"\nerror: {message}", file=sys.stderr)
    raise SystemExit(1)


def finish(run: Run, seconds: float) -> dict:
    """The end of a run on rank 0: the summary (held-out accuracy at the first and last evaluation, time,
    outputs, the commands to run next) printed and the run directory released. Returns the first and
    last evaluation rows of the run's log ({} on other ranks)."""
    cfg = run.cfg
    if run.rank != 0:
        return {"first_eval": {}, "last_eval": {}}
    evals = checkpoint.eval_rows(cfg.out)
    files = [f for f in ("metrics.jsonl", "samples.jsonl", "config.json") if os.path.isfile(os.path.join(cfg.out, f))]
    data = [("--task", cfg.task), ("--data", cfg.data), ("--test-data", cfg.test_data)]
    flags = "".join(f"{k} {v} " for k, v in data if v) + f"--max-new-tokens {cfg.completion_limit} "
    flags += methods.eval_flags(cfg)  # --tools python: evaluate with the tool, as trained
    flags += eval_size(sum(p.numel() for p in run.policy.parameters()), run.device.type)  # its cost fits the model
    saved = checkpoint.saved_text(cfg, run.policy.config.torch_dtype)  # final/'s size and what it holds
    print(end_summary(evals, seconds, cfg.out, files, flags, cfg.max_steps, saved, merged=cfg.merge))
    if run.static_step is not None:  # CUDA graphs or --compile's step: what ran, and what fell back to eager and why
        print(f"decode path: {decode_path(run.static_step)}")
    checkpoint.release_run_dir(cfg.out)
    return {"first_eval": evals[0] if evals else {}, "last_eval": evals[-1] if evals else {}}


if __name__ == "__main__":
    with user_errors():
        config, typed = parse_config(
            TrainConfig, description=__doc__.split("\n\n")[0], presets=PRESETS, preset_field="algo"
        )
        config = resume_config(config, typed)
        main(replace(config, model=bundled(config.model)))
