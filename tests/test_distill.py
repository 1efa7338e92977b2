"""Teachers in the loop: OPD (methods/opd.py), RLSD (methods/rlsd.py), SDPO (methods/sdpo.py) and the teacher's
scoring (methods/teacher.py), against the peers' formulas (docs reference: algorithms-2026 sections 1 and 2)."""

from __future__ import annotations

import contextlib
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import methods
from helpers import BUNDLED, SMALL_RUN, make_hf_checkpoint
from hf import load_model
from logprobs import token_logprobs
from losses import CLIP, Tokens, policy_loss
from methods import opd, rlsd, sdpo, teacher
from pack import Answer, Group, Thought, pack, rollouts, select_rows
from sampler import Tree

HP = SimpleNamespace(clip_low=0.2, clip_high=0.2, beta=0.0, kl_estimator="k3", loss="clip")


def example():
    """Two rows of four tokens, the last of row 1 padding: student s, teacher T, sampler b, task advantage A."""
    s = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, 0.0]])
    T = torch.tensor([[-0.2, -0.9, -1.0, -0.1], [-0.3, -0.2, -3.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    A = torch.tensor([[0.5] * 4, [-1.0] * 4])
    return s, T, mask, A


def test_opd_advantage_is_the_task_advantage_plus_the_teacher_log_ratio():
    """Guards the OPD signal's sign and form: slime/ms-swift's A - c (o - T), tinker's A_task - c (b - T) and, with
    --distill-only, SkyRL's -(o - T); 0 off the mask."""
    s, T, mask, A = example()
    for c in (1.0, 0.5):
        want = torch.where(mask, A - c * (s - T), 0.0)
        torch.testing.assert_close(opd.opd_advantages(A, T, s, mask, c), want, rtol=0, atol=0)
        torch.testing.assert_close(opd.opd_advantages(A, T, s, mask, c, True), torch.where(mask, -c * (s - T), 0.0))


def test_opd_gradient_equals_tinkers_importance_sampling_loss():
    """Guards the OPD step against the recipe: -sum_t exp(s_t - b_t) A_t / N (tinker, SkyRL) and its gradient, by
    the clipped surrogate at mu = 1 (slime, ms-swift) and by --loss plain_is, with token_mean weights."""
    s0, T, mask, A = example()
    b = s0 + torch.tensor([[0.0, 0.01, -0.02, 0.0], [0.03, 0.0, 0.0, 0.0]])  # the sampler's log-probs
    adv = opd.opd_advantages(torch.zeros_like(A), T, b, mask, 1.0, distill_only=True)
    N = mask.sum()
    ref = s0.clone().requires_grad_(True)
    want = -(torch.exp(ref - b) * adv * mask).sum() / N
    want.backward()
    weight = mask.float() / N
    for objective, old in (
        (methods.LOSSES["plain_is"], b),
        (CLIP, s0),
    ):  # is: o = b (the sampler); clip at mu = 1: o = s
        logp = s0.clone().requires_grad_(True)
        loss, _ = policy_loss(Tokens(logp, old, adv, weight, mask=mask), HP, objective)
        loss.backward()
        if objective is not CLIP:
            torch.testing.assert_close(loss, want)
            torch.testing.assert_close(logp.grad, ref.grad)
        else:  # ratio 1: the gradient is -A_t / N, tinker's without its sampler-mismatch factor exp(s - b)
            torch.testing.assert_close(logp.grad, torch.where(mask, -adv / N, 0.0))


def test_a_teacher_equal_to_the_student_gives_zero_signal_loss_and_gradient():
    """Guards pure OPD against a leak of the task reward or a nonzero signal: teacher == student gives exactly 0
    advantage, loss and gradient (prime-rl's edge case), and an empty mask a graph-attached 0."""
    s, _, mask, A = example()
    adv = opd.opd_advantages(A, s, s, mask, 1.0, distill_only=True)
    assert torch.equal(adv, torch.zeros_like(adv))
    logp = s.clone().requires_grad_(True)
    loss, _ = policy_loss(Tokens(logp, s, adv, mask.float() / mask.sum(), mask=mask), HP)
    loss.backward()
    assert loss.item() == 0 and torch.equal(logp.grad, torch.zeros_like(s))
    empty = torch.zeros_like(mask)
    logp = s.clone().requires_grad_(True)
    loss, _ = policy_loss(Tokens(logp, s, opd.opd_advantages(A, s * 0, s, empty), empty.float(), mask=empty), HP)
    assert loss.item() == 0 and loss.requires_grad
    loss = sdpo.sdpo_loss(logp, s * 0, empty, torch.ones(2, dtype=torch.bool))
    assert loss.item() == 0 and loss.requires_grad


def test_full_vocabulary_reverse_kl_equals_the_direct_one_in_chunks():
    """Guards the full-vocabulary mode (TRL DistillationTrainer beta = 1, GKD's reverse case): the chunked reverse
    KL sum_v p_S (log p_S - log p_T) at a temperature equals the one from whole logits, value and gradient, for
    chunks that do not divide the tokens; a teacher equal to the student gives 0."""
    torch.manual_seed(0)
    hs, ht = torch.randn(7, 16, requires_grad=True), torch.randn(7, 12)
    ws, wt = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(12, 50, bias=False)
    kl = opd.reverse_kl(ws, hs, wt, ht, temperature=0.7, chunk_tokens=3)
    ls, lt = F.log_softmax(ws(hs) / 0.7, -1), F.log_softmax(wt(ht) / 0.7, -1)
    want = F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)  # KL(p_S || p_T)
    torch.testing.assert_close(kl, want)
    g = torch.autograd.grad(kl.sum(), [hs, ws.weight])
    h2 = hs.detach().clone().requires_grad_(True)
    ls2 = F.log_softmax(ws(h2) / 0.7, -1)
    g2 = torch.autograd.grad((ls2.exp() * (ls2 - lt)).sum(), [h2, ws.weight])
    for a, b in zip(g, g2):
        torch.testing.assert_close(a, b)
    same = opd.reverse_kl(ws, hs, ws, hs, chunk_tokens=2)
    torch.testing.assert_close(same, torch.zeros(7), atol=1e-6, rtol=0)


def test_rlsd_rescales_the_advantage_per_token_and_never_flips_its_sign():
    """Guards RLSD's rule A_t = A sg((1 - l) + l clip(exp(sign(A) delta_t), 1 - e, 1 + e)) on worked values, the
    sign kept, an all-equal group (A = 0) giving 0, l = 0 giving plain GRPO and l = 1 a factor in [0.8, 1.2]."""
    s, T, mask, A = example()
    out = rlsd.rlsd_advantages(A, T, s, mask, 0.5, 0.2)
    d = T - s  # row 0: +0.8 -0.4 +1.0 0 with A = 0.5; row 1: 0 +1.0 -2.3 with A = -1
    f0 = [0.5 + 0.5 * min(max(math.exp(x), 0.8), 1.2) for x in (0.8, -0.4, 1.0, 0.0)]
    f1 = [0.5 + 0.5 * min(max(math.exp(-x), 0.8), 1.2) for x in (0.0, 1.0, -2.3)]
    want = torch.tensor([[0.5 * f for f in f0], [-f for f in f1] + [0.0]])
    torch.testing.assert_close(out, want)
    assert torch.equal(out[1, :3] < 0, torch.ones(3, dtype=torch.bool)) and (out[0] > 0).all()
    assert (d[0, 0] > 0) and out[0, 0] == 0.5 * 1.1  # a token the teacher likes gets more credit
    assert torch.equal(rlsd.rlsd_advantages(torch.zeros_like(A), T, s, mask), torch.zeros_like(A))
    torch.testing.assert_close(rlsd.rlsd_advantages(A, T, s, mask, 0.0), torch.where(mask, A, 0.0), rtol=0, atol=0)
    ratio = rlsd.rlsd_advantages(A, T, s, mask, 1.0)[mask] / A[mask]
    assert ratio.min() >= 0.8 - 1e-6 and ratio.max() <= 1.2 + 1e-6
    # the iie-ycx and ms-swift forms are one rule on the student log-prob they are given: a tensor in, no grad out
    assert not rlsd.rlsd_advantages(A, T, s.requires_grad_(True), mask).requires_grad


def test_sdpo_advantages_give_trls_sampled_token_loss_gradient():
    """Guards SDPO against TRL's sampled_token loss sg(s - T) s, averaged per row over mask * sd_mask and then over
    ALL rows: the advantage T - s on rows with a demo, trained by the clipped surrogate at mu = 1 with
    seq_mean_token_mean weights, has the same gradient; rows without a demo carry none."""
    from advantage import token_weights

    s, T, mask, A = example()
    has = torch.tensor([True, False])
    adv = sdpo.sdpo_advantages(A, T, s, mask, has, 1.0)
    assert torch.equal(adv[1], torch.zeros(4))
    weight = token_weights(mask.float(), "seq_mean_token_mean", max_len=4, num_seqs=2, num_tokens=int(mask.sum()))
    logp = s.clone().requires_grad_(True)
    policy_loss(Tokens(logp, s, adv, weight, mask=mask), HP)[0].backward()
    ref = s.clone().requires_grad_(True)
    sdpo.sdpo_loss(ref, T, mask, has).backward()
    torch.testing.assert_close(logp.grad, ref.grad)
    ref2 = s.clone().requires_grad_(True)  # at mu = 1 TRL's IS factor min(exp(s - o), 2) is 1
    sdpo.sdpo_loss(ref2, T, mask, has, old_logp=s).backward()
    torch.testing.assert_close(ref2.grad, ref.grad)
    mixed = sdpo.sdpo_advantages(A, T, s, mask, has, 0.25)
    torch.testing.assert_close(mixed, 0.25 * adv + 0.75 * torch.where(mask, A, 0.0))


def answer(tokens, reward, text=""):
    return Answer(tokens, [0.0] * len(tokens), "stop", text=text, reward=reward)


def test_sdpo_demo_is_the_first_successful_sibling_other_than_the_row():
    """Guards the demo choice: the first completion of the group at or above the threshold outside the row itself
    (dont_reprompt_on_self_success); a row whose group has no other success gets none."""
    rows = [("a", 0.0), ("b", 1.0), ("c", 1.0), ("d", 0.0)]
    g = Group({}, [1], [Thought([], [], False, [answer([3], r, t)]) for t, r in rows])
    lone = Group({}, [1], [Thought([], [], False, [answer([3], r, t)]) for t, r in [("x", 1.0), ("y", 0.0)]])
    assert sdpo.demos([g, lone], 1.0) == ["b", "c", "b", "b", None, "x"]
    assert sdpo.demos([g], 2.0) == [None] * 4


def fake_run(model, share_prompt=False, kind="live"):
    cfg = SimpleNamespace(share_prompt=share_prompt, temperature=0.7, self_teacher=kind, rlsd_lambda=0, teacher="")
    return SimpleNamespace(
        cfg=cfg,
        tokenizer=SimpleNamespace(pad_id=0),
        device=torch.device("cpu"),
        teacher=model,
        policy=None,
        precision=contextlib.nullcontext,
    )


def tree_groups(vocab, m, context=False):
    """Two prompts x 3 thoughts x m answers of random tokens; context: each answer's middle tokens come from a tool."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    P, K = 2, 3
    prompts = [rand(5), rand(8)]
    thoughts = [rand(2 + (i * 5) % 7) if m > 1 else [] for i in range(P * K)]
    answers = [rand(3 + (a * 3) % 5) for a in range(P * K * m)]
    tree = Tree(thoughts, [[0.0] * len(t) for t in thoughts], [False] * (P * K), answers,
                [[0.0] * len(a) for a in answers], ["stop"] * len(answers))  # fmt: skip
    if context:
        tree.answer_context = [[0 < i < 2 for i in range(len(a))] for a in answers]
    return prompts, thoughts, answers, rollouts([{}] * P, prompts, tree, K, m)


CASES = [(False, 3, False, False), (True, 3, False, True), (True, 1, True, False), (False, 2, False, True)]


@pytest.mark.parametrize(("share", "m", "context", "hybrid"), CASES)
def test_teacher_log_probs_of_packed_rows_equal_separate_forwards(tmp_path, share, m, context, hybrid):
    """Guards the teacher's scoring (methods/teacher.score) on packed GRPO-MA rows (tree attention; a hybrid's
    tree_hidden), shared prompts and a tool rollout's rows (tokens appended from a tool inside an answer), and on
    the rows re-packed with other prompts (a self-teacher's): each completion token's log-prob equals a plain
    forward of that one sequence, prompt + thought + answer, through the teacher."""
    model = load_model(make_hf_checkpoint(tmp_path, "qwen3_5" if hybrid else "qwen3"))
    prompts, thoughts, answers, groups = tree_groups(model.config.vocab_size, m, context)
    batch = pack(groups, 0, torch.device("cpu"), share)
    micro = [(rows, select_rows(batch, rows)) for rows in (torch.tensor([4, 1]), torch.tensor([0, 2, 3, 5]))]
    run = fake_run(model, share)
    new = [[7, 8, 9] + p for p in prompts]  # a teacher prompt per group
    again = [Group({}, p, g.thoughts) for g, p in zip(groups, new)]
    for got, ps in ((teacher.score(run, batch, micro), prompts), (teacher.score(run, batch, micro, again), new)):
        for r in range(len(thoughts)):
            prompt, th = ps[r // 3], thoughts[r]
            for j in range(m):
                seq = torch.tensor([prompt + th + answers[r * m + j]])
                with torch.no_grad():
                    lp = token_logprobs(model(seq)[0, :-1], seq[0, 1:], 0.7)[len(prompt) - 1 :]
                cols = torch.nonzero(batch.thought[r] | (batch.answer_id[r] == j)).flatten()
                if context:  # the tool's tokens are in no answer's mask but are scored at their place
                    cols = torch.arange(len(th) + len(answers[r * m + j]))
                torch.testing.assert_close(got[r, cols], lp, atol=2e-5, rtol=0)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    """Guards --teacher against a checkpoint whose tokenizer differs from the student's: one sentence at the start."""
    from cli import UserError
    from tokenizer import load_tokenizer

    student = load_tokenizer(BUNDLED)
    teacher.check_tokenizer(student, BUNDLED)
    with pytest.raises(UserError, match="vocabulary or special tokens differ"):
        teacher.check_tokenizer(student, "assets/tiny-tool-model")


def checkpoint_with_bundled_tokenizer(tmp_path, family):
    path = make_hf_checkpoint(tmp_path, family, tied=True, vocab_size=28, name=family)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{BUNDLED}/{f}", path / f)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_opd_with_a_teacher_trains_on_a_hybrid_and_a_qwen3_teacher(tmp_path, family):
    """Guards --teacher through train.main with tiny random Qwen3.5-hybrid and Qwen3 teachers on packed GRPO-MA
    rows (answers 2): the teacher is scored, its metrics logged, the student's weights move."""
    import json

    import train
    from train import TrainConfig

    t = checkpoint_with_bundled_tokenizer(tmp_path, family)
    kw = SMALL_RUN | dict(
        algo="opd", **opd.PRESETS["opd"], teacher=t, answers=2, thoughts=2, max_steps=1, eval_examples=2
    )
    train.main(TrainConfig(**kw, out=str(tmp_path / "run")))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert any("teacher/eval/accuracy" in r for r in rows)
    kl = [r["teacher/reverse_kl"] for r in rows if "teacher/reverse_kl" in r]
    assert len(kl) == 1 and kl[0] > 0.5  # a random teacher is far from the trained student
    start, end = load_model(BUNDLED).state_dict(), load_model(tmp_path / "run" / "final").state_dict()
    assert any(not torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_leaves_nothing_to_learn(tmp_path):
    """Guards pure OPD end to end: the student as its own teacher (--teacher-student old: the score pass's
    log-probs, bit for bit the teacher's) gives a zero reverse KL, zero gradient norm and zero loss, and (no weight
    decay) weights equal to the start's after two steps."""
    import json

    import train
    from train import TrainConfig

    kw = SMALL_RUN | dict(
        algo="opd", **opd.PRESETS["opd"], teacher=BUNDLED, teacher_student="old", weight_decay=0.0, eval_examples=2
    )
    train.main(TrainConfig(**kw, out=str(tmp_path / "run")))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "loss" in line]
    assert len(rows) == 2
    assert all(r["teacher/reverse_kl"] == 0 and r["grad_norm"] == 0 and r["loss"] == 0 for r in rows)
    start, end = load_model(BUNDLED).state_dict(), load_model(tmp_path / "run" / "final").state_dict()
    assert all(torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rlsd", "sdpo"])
def test_self_distillation_trains_with_its_teacher_prompt(tmp_path, algo):
    """Guards RLSD and SDPO through train.main: the teacher prompt is rendered and re-packed, the teacher (initial
    weights for RLSD, the live policy for SDPO) scored, and the metrics logged."""
    import json

    import train
    from train import TrainConfig

    template = "{prompt}={answer}" if algo == "rlsd" else "{demo}\n{prompt}"
    kw = SMALL_RUN | dict(
        algo=algo,
        **{"rlsd": rlsd, "sdpo": sdpo}[algo].PRESETS[algo],
        teacher_template=template,
        max_steps=1,
        eval_examples=2,
    )
    train.main(TrainConfig(**kw, out=str(tmp_path / "run")))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "teacher/adv_share" in line]
    assert len(rows) == 1 and all(math.isfinite(r["teacher/reverse_kl"]) for r in rows)


def test_teacher_flags_are_checked_and_its_weights_counted():
    """Guards the flag checks (pure OPD without a teacher, a template without a self-teacher, a template naming
    another field) and memory.py's count of the teacher (its parameters at the rollout dtype's bytes)."""
    import json

    from cli import FlagError
    from config import TrainConfig
    from hf import config_from_hf
    from memory import n_params

    for kw, match in ((dict(distill_only=True), "needs --teacher"), (dict(teacher_template="{prompt}"), "rlsd or sdpo"),
                      (dict(rlsd_lambda=0.5, teacher_template="{demo}"), "only {prompt} and {answer}")):  # fmt: skip
        with pytest.raises(FlagError, match=match):
            TrainConfig(**kw)
    cfg = TrainConfig(teacher=BUNDLED)
    with open(f"{BUNDLED}/config.json") as f:
        assert teacher.weight_bytes(cfg, 2) == 2 * n_params(config_from_hf(json.load(f))) > 0
    assert teacher.weight_bytes(TrainConfig(), 2) == 0


def perturbed_teacher(path) -> str:
    """The bundled model with every weight moved by 5% noise (seed 0): a teacher with the student's tokenizer that
    is neither the student nor its base."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(BUNDLED, path)
    g = torch.Generator().manual_seed(0)
    tensors = load_file(f"{path}/model.safetensors")
    tensors = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)).contiguous() for k, v in tensors.items()}
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.mark.slow
def test_a_teacher_under_ddp_equals_one_process_and_under_lora_is_not_the_base(tmp_path):
    """Guards --teacher beyond one full-weight process: 2 DDP ranks (gloo) of pure OPD after one step equal one
    process (each rank scores its own rows with its own copy of the teacher; the KL metric sums over ranks); and with
    LoRA the teacher stays the --teacher checkpoint, not the adapters' frozen base: at the first step the LoRA student
    equals the base, so its reverse KL to the teacher equals the full-weight run's (were the teacher the base, 0)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_train import DDP_ARGS, TORCHRUN, assert_equals_one_process

    teacher_dir = perturbed_teacher(tmp_path / "teacher")
    args = [a if a != "grpo" else "opd" for a in DDP_ARGS] + ["--teacher", teacher_dir, "--samples-every", "0"]
    launch = [*TORCHRUN, "--nproc_per_node", "2", "--master-port", "29561"]
    assert_equals_one_process([launch], args, tmp_path)

    import train
    from train import TrainConfig

    kls = []
    for lora_rank in (0, 4):
        out = tmp_path / f"lora{lora_rank}"
        kw = SMALL_RUN | dict(algo="opd", **opd.PRESETS["opd"], teacher=teacher_dir, max_steps=1, eval_examples=2)
        train.main(TrainConfig(**kw, lora_rank=lora_rank, out=str(out)))
        rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "teacher/reverse_kl" in line]
        kls.append(rows[0]["teacher/reverse_kl"])
    assert kls[0] > 1e-4 and kls[1] == pytest.approx(kls[0], rel=1e-5, abs=1e-7)
