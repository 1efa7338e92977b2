"""The newer losses' wiring in the trainer: the step's token selections (methods/cov.py: Clip-Cov, KL-Cov;
methods/entropy_mask.py: the 80/20 mask) are the whole step's, whatever the micro-batch split or the world size;
GPG's alpha, DeepSeek-V3.2's sequence mask and the rollout-mismatch modes reach the update; impossible combinations
are refused in one sentence."""

from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cli
import methods
import train
from distributed import gather_rows
from helpers import BUNDLED
from hf import load_model
from methods import dsv32
from methods.cov import clip_cov_mask, kl_cov_select
from methods.entropy_mask import high_entropy_mask
from train import PRESETS, TrainConfig


def step_tensors(rows: int = 6, cols: int = 9, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A step's logp, adv, entropy and mask, rows of different lengths, advantages constant per row."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=g) * 4
    adv = torch.randn(rows, 1, generator=g).expand(rows, cols).clone()
    entropy = torch.rand(rows, cols, generator=g) * 2
    lengths = torch.randint(2, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    return logp, adv, entropy, mask


def hp(**kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**dataclasses.asdict(TrainConfig()), **kw})


def select(logp, adv, ent, mask, cfg, step: int, rank: int, world: int) -> tuple:
    """The step's token selections through the methods' seam (methods.select), as the trainer calls it after the
    score pass: (keep, KL-Cov's selected, metrics)."""
    run = types.SimpleNamespace(cfg=cfg, rank=rank, world=world, state={"step": step})
    batch = types.SimpleNamespace(score_logp=logp, entropy=ent)
    metrics = methods.select(run, batch, adv, mask)  # the selections go to the batch
    return batch.keep, batch.selected, metrics


def test_select_is_the_losses_functions_on_the_whole_step():
    """Guards against the methods computing another selection than their own functions: keep is the entropy mask
    and Clip-Cov's draw (seeded by seed and step), selected is KL-Cov's, and tokens off the mask keep factor 1."""
    logp, adv, ent, mask = step_tensors()
    cfg = hp(loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-5.0, clip_cov_ub=5.0, top_entropy_fraction=0.5, seed=3)
    keep, selected, metrics = select(logp, adv, ent, mask, cfg, step=7, rank=0, world=1)
    from distributed import derive_seed

    g = torch.Generator().manual_seed(derive_seed(3, 7, -1))
    want = high_entropy_mask(ent, mask, 0.5) & clip_cov_mask(logp, adv, mask, ratio=0.1, low=-5, high=5, generator=g)
    assert selected is None and torch.equal(keep, want | ~mask)
    assert metrics["token_select/kept_frac"] == pytest.approx(want.sum().item() / mask.sum().item())
    assert 0 < metrics["token_select/kept_frac"] < 0.5
    cfg = hp(loss="kl_cov", kl_cov_ratio=0.2)
    keep, selected, metrics = select(logp, adv, ent, mask, cfg, step=0, rank=0, world=1)
    assert torch.equal(keep, torch.ones_like(keep)) and torch.equal(selected, kl_cov_select(logp, adv, mask, ratio=0.2))
    assert metrics["kl_cov/selected_frac"] == pytest.approx(int(mask.sum() * 0.2) / mask.sum().item())


def _two_ranks(rank: int, path: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    logp, adv, ent, mask = step_tensors()
    mine = slice(0, 4) if rank == 0 else slice(4, 6)  # uneven rows; rank 1's rows are also narrower
    cols = mask.shape[1] if rank == 0 else int(mask[mine].sum(-1).max())
    part = [x[mine, :cols] for x in (logp, adv, ent, mask)]
    full, own = gather_rows(part[0], rank, 2)
    out = {"gathered": full, "slice": (own.start, own.stop)}
    for name, kw in (("clip_cov", dict(clip_cov_ratio=0.1, clip_cov_lb=-5.0, clip_cov_ub=5.0)), ("kl_cov", {})):
        cfg = hp(loss=name, top_entropy_fraction=0.5, kl_cov_ratio=0.2, **kw)
        out[name] = select(*part, cfg, step=2, rank=rank, world=2)
    results[rank] = out
    dist.destroy_process_group()


def test_selections_under_two_ranks_equal_one_process(tmp_path):
    """Guards against a selection taken over one rank's tokens (a quantile, covariance or draw of half a step):
    two ranks with uneven rows and widths select exactly what one process selects over the whole step."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_two_ranks, args=(str(tmp_path / "store"), results), nprocs=2, start_method="fork")
        results = dict(results)
    logp, adv, ent, mask = step_tensors()
    assert results[0]["slice"] == (0, 4) and results[1]["slice"] == (4, 6)
    for rank in (0, 1):  # every rank holds the whole step's rows, in rank order
        assert torch.equal(torch.where(mask, results[rank]["gathered"], 0), torch.where(mask, logp, 0))
    for name in ("clip_cov", "kl_cov"):
        cfg = hp(loss=name, top_entropy_fraction=0.5, kl_cov_ratio=0.2, clip_cov_ratio=0.1, clip_cov_lb=-5.0)
        keep, selected, metrics = select(logp, adv, ent, mask, cfg, step=2, rank=0, world=1)
        for rank, rows in ((0, slice(0, 4)), (1, slice(4, 6))):
            k, s, m = results[rank][name]
            assert torch.equal(k, keep[rows, : k.shape[1]]) and m == metrics
            assert (s is None) == (selected is None) and (s is None or torch.equal(s, selected[rows, : s.shape[1]]))


@pytest.mark.parametrize(
    "extra",
    [
        dict(algo="clip_cov", clip_cov_ratio=0.05),
        dict(algo="kl_cov", kl_cov_ratio=0.05),
        dict(top_entropy_fraction=0.2),
    ],
)
def test_micro_batch_split_does_not_change_a_selection(tmp_path, extra):
    """Guards against a selection taken per micro-batch (verl's Clip-Cov and KL-Cov are): the step's update is the
    same whether its rows run as one micro-batch or as micro-batches of 3 rows, and the selection did act."""
    outs, rows_logged = [], []
    for rows in (64, 3):
        out = str(tmp_path / f"mb{rows}")
        base = dict(model=BUNDLED, out=out, max_steps=1, prompts_per_step=4, thoughts=4, answers=1, eval_every=0)
        base |= dict(eval_examples=4, eval_samples=0, micro_batch_rows=rows, max_thought_tokens=40, samples_every=0)
        algo = extra.get("algo", "grpo")
        cfg = TrainConfig(**{**base, **PRESETS[algo], **extra})
        train.main(cfg)
        outs.append(load_model(os.path.join(out, "final")).state_dict())
        rows_logged.append([json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x][0])
    for k in outs[0]:  # float sums in another order (~1e-6); a selection per micro-batch moves weights ~1e-4
        torch.testing.assert_close(outs[0][k], outs[1][k], atol=5e-6, rtol=1e-5)
    key = "kl_cov/selected_frac" if extra.get("algo") == "kl_cov" else "token_select/kept_frac"
    assert rows_logged[0][key] == rows_logged[1][key] and 0 < rows_logged[0][key] < 1


def test_gpg_alpha_and_the_sequence_mask_reach_the_update(tmp_path, monkeypatch):
    """Guards against --gpg-alpha or --opsm-delta parsed but not used: GPG's weights are scaled by groups / groups
    with a spread (logged as gpg/alpha), and the V3.2 mask multiplies the token weights of the update."""
    seen = []
    real = dsv32.off_policy_sequence_mask
    monkeypatch.setattr(dsv32, "off_policy_sequence_mask", lambda *a, **k: seen.append(k["delta"]) or real(*a, **k))
    base = dict(model=BUNDLED, max_steps=1, prompts_per_step=4, thoughts=4, eval_every=0, eval_examples=4)
    base |= dict(eval_samples=0, samples_every=0, max_thought_tokens=40)
    out = str(tmp_path / "gpg")
    train.main(TrainConfig(**{**base, **PRESETS["gpg"], "algo": "gpg", "out": out}))
    row = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x][0]
    spread = 1 - row["frac_zero_std_groups"]
    assert row["gpg/alpha"] == pytest.approx(1 / spread if spread else 1.0)
    out = str(tmp_path / "dsv32")
    train.main(TrainConfig(**{**base, **PRESETS["dsv32"], "algo": "dsv32", "out": out}))
    row = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x][0]
    assert seen == [1e-4] * 2 and 0 <= row["opsm/masked_frac"] <= 1 and row["kl"] is not None


def test_the_kl_penalty_takes_the_step_weight_without_the_surrogates_masks(tmp_path, monkeypatch):
    """Guards against the update handing the KL term the surrogate's token weights: with V3.2's sequence mask
    dropping every sequence and the 80/20 entropy mask on, the surrogate's weights are all 0 while the KL penalty
    keeps the step's aggregation weight on every trained token (TRL adds beta * KL after its masks; verl and slime
    compute the KL loss apart)."""
    calls = []
    real = train.policy_loss
    drop_all = lambda logp, behaviour, adv, mask, **k: torch.zeros_like(mask, dtype=torch.bool)  # noqa: E731
    monkeypatch.setattr(dsv32, "off_policy_sequence_mask", drop_all)

    def spy(tok, hp, objective):  # (the surrogate's weights: the step's times the selections, the KL's)
        calls.append((tok.weight * tok.keep, tok.weight))
        return real(tok, hp, objective)

    monkeypatch.setattr(train, "policy_loss", spy)
    cfg = TrainConfig(model=BUNDLED, out=str(tmp_path / "run"), max_steps=1, prompts_per_step=4, thoughts=4)
    cfg = dataclasses.replace(cfg, eval_every=0, eval_examples=4, eval_samples=0, max_thought_tokens=40)
    train.main(dataclasses.replace(cfg, **PRESETS["dsv32"], algo="dsv32", top_entropy_fraction=0.5))
    assert len(calls) >= 2  # mu = 2 epochs
    for w, kl_w in calls:
        assert torch.count_nonzero(w) == 0 and torch.count_nonzero(kl_w) > 0 and (kl_w >= 0).all()
    row = [json.loads(x) for x in open(os.path.join(cfg.out, "metrics.jsonl")) if '"loss"' in x][0]
    assert row["opsm/masked_frac"] > 0 and row["kl"] >= 0


def test_rollout_is_modes_run_on_a_bf16_sampler(tmp_path):
    """Guards against a --rollout-is mode parsed but not applied: on a bf16 sampler copy the sequence mask at a cap
    below every sequence ratio would mask most tokens (tis/capped_frac near 1), the default truncation few."""
    fracs = {}
    for mode, cap in (("token_truncate", 2.0), ("sequence_mask", 1.0 + 1e-9)):
        out = str(tmp_path / mode)
        cfg = TrainConfig(model=BUNDLED, out=out, algo="grpo", max_steps=1, prompts_per_step=4, thoughts=4)
        cfg = dataclasses.replace(cfg, eval_every=0, eval_examples=4, eval_samples=0, rollout_dtype="bfloat16")
        train.main(dataclasses.replace(cfg, rollout_is=mode, tis_cap=cap, max_thought_tokens=40))
        fracs[mode] = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x][0]
    assert fracs["token_truncate"]["tis/capped_frac"] < 0.05 < fracs["sequence_mask"]["tis/capped_frac"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--algo", "gmpo", "--answers", "4"],
            "--algo gmpo sets --loss gmpo (one ratio per sequence), which needs --answers 1",
        ),
        (["--algo", "grpo", "--opsm-delta", "0.1", "--answers", "2"], "--opsm-delta (one KL per sequence) needs"),
        (["--algo", "grpo", "--rollout-is", "sequence_mask", "--answers", "2"], "--rollout-is sequence_mask needs"),
        (["--algo", "grpo", "--kl-estimator", "unbiased"], "--kl-estimator unbiased is the KL penalty's estimator"),
        (["--algo", "dagrpo", "--kl-estimator", "unbiased", "--beta", "0.1"], "anchor tokens were not sampled by it"),
        (["--algo", "grpo", "--tis-floor", "3"], "--tis-floor must be below --tis-cap, got 3.0 and 2.0"),
        (["--algo", "grpo", "--clip-cov-lb", "6"], "--clip-cov-lb must be below --clip-cov-ub"),
        (["--algo", "grpo", "--opsm-delta", "-0.5"], "--opsm-delta must be >= 0, or -1 (off), got -0.5"),
        (["--algo", "grpo", "--top-entropy-fraction", "1.5"], "--top-entropy-fraction must be in [0, 1], got 1.5"),
        (["--algo", "grpo", "--kl-cov-ratio", "0"], "--kl-cov-ratio must be in (0, 1], got 0.0"),
        (["--algo", "grpo", "--sapo-tau-neg", "0"], "--sapo-tau-neg must be > 0 and finite, got 0.0"),
        (["--algo", "grpo", "--rollout-is", "icepop"], "--rollout-is must be one of token_truncate, token_mask"),
    ],
)
def test_impossible_combinations_of_the_newer_flags_are_one_sentence(argv, message):
    """Guards against a newer flag silently accepted where it cannot act (a per-sequence quantity over a packed
    GRPO-MA row, an estimator without a penalty) or out of its range."""
    with pytest.raises(cli.UserExit) as e:
        cli.parse_config(TrainConfig, argv, presets=PRESETS, preset_field="algo")
    assert message in str(e.value)


def test_a_mismatch_mode_without_a_sampler_copy_is_one_sentence(tmp_path):
    """Guards against --rollout-is or --tis-floor accepted on a run that samples with the float32 policy itself
    (no copy, so nothing to correct): the run is refused before any step, naming --rollout-dtype."""
    for extra in (dict(rollout_is="sequence_mask"), dict(tis_floor=0.5)):
        cfg = TrainConfig(model=BUNDLED, out=str(tmp_path / "run"), algo="grpo", rollout_dtype="float32", **extra)
        with pytest.raises(
            cli.UserError, match=r"^--rollout-is and --tis-floor correct a --rollout-dtype bfloat16 copy"
        ):
            train.setup(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        dict(algo="grpo_ma", answers=2, loss="cispo", mu=2),  # CISPO's objective on GRPO-MA's tree advantages
        dict(algo="dapo", loss="sapo", opsm_delta=0.0, mu=2),  # DAPO's sampling, SAPO's gate, V3.2's mask
        dict(algo="dr_grpo", loss="gmpo", top_entropy_fraction=0.5, mu=2),  # a sequence loss on the entropy mask
        dict(algo="gtpo", loss="dppo", kl_estimator="unbiased", beta=0.01, mu=2),  # GTPO's weights, DPPO, V3.2's KL
    ],
)
def test_the_newer_losses_compose_with_the_other_methods(tmp_path, flags):
    """Guards against a newer loss or mask that only runs on its own preset: composed with another method's
    advantages, sampling or weights, a step runs and moves the weights."""
    algo = flags.pop("algo")
    base = dict(model=BUNDLED, out=str(tmp_path / "run"), max_steps=1, prompts_per_step=4, thoughts=4, eval_every=0)
    base |= dict(eval_examples=4, eval_samples=0, samples_every=0, max_thought_tokens=40, max_answer_tokens=8)
    preset = {k: v for k, v in PRESETS[algo].items() if k not in ("prompts_per_step", "thoughts", "lr")}
    train.main(TrainConfig(**{**base, **preset, "algo": algo, **flags}))
    row = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in x][0]
    moved = load_model(str(tmp_path / "run" / "final")).state_dict()
    start = load_model(BUNDLED).state_dict()
    assert row["grad_norm"] > 0 and any(not torch.equal(moved[k], start[k]) for k in start)
