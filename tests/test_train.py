"""The training loop: every preset runs, resume is exact, micro-batches and ranks do not change the
update, saves are atomic, bad flags are one clear message, and the default setup learns."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import cli
import sft
import train
from helpers import count_compiled_steps
from hf import load_model, save_model
from model import ModelConfig, Transformer
from sft import build_char_tokenizer, write_tokenizer
from tasks import SYNTHETIC_CHARS
from tokenizer import load_tokenizer
from train import PRESETS, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "assets", "tiny-model")  # trained: its groups have mixed rewards, so updates are non-zero


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A random 2-layer Qwen2-shaped model with the bundled character tokenizer."""
    path = str(tmp_path_factory.mktemp("tiny"))
    tok_dir = os.path.join(path, "tok")
    write_tokenizer(build_char_tokenizer(SYNTHETIC_CHARS), tok_dir)
    vocab = load_tokenizer(tok_dir).vocab_size
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        attention_bias=True,
        model_type="qwen2",
        max_position_embeddings=256,
    )
    model_dir = os.path.join(path, "model")
    save_model(Transformer(cfg), model_dir, tokenizer_dir=tok_dir)
    return model_dir


def small(tiny: str, out: str, **kw) -> TrainConfig:
    """A few-second run: 4 prompts, short completions, one held-out eval of 8 prompts."""
    algo = kw.pop("algo", "grpo")
    base = dict(
        algo=algo,
        model=tiny,
        out=out,
        max_steps=2,
        prompts_per_step=4,
        thoughts=4,
        answers=1,
        max_thought_tokens=12,
        max_answer_tokens=6,
        eval_every=0,
        eval_examples=8,
        eval_samples=2,
        samples_every=1,
        micro_batch_rows=64,
    )
    preset = {k: v for k, v in PRESETS[algo].items() if k not in ("prompts_per_step", "thoughts", "lr")}
    return TrainConfig(**{**base, **preset, **kw})


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_model(path).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(PRESETS))
def test_every_preset_runs(tiny, tmp_path, algo):
    """Guards against a preset whose flag combination crashes the loop or writes no metrics/checkpoint."""
    extra = dict(thoughts=2) if algo == "two_grpo" else dict(answers=2) if algo == "grpo_ma" else {}
    extra |= dict(teacher=tiny) if algo == "opd" else {}  # the one preset that needs a checkpoint: its teacher
    out = str(tmp_path / algo)
    train.main(small(tiny, out, algo=algo, **extra))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in (
        "reward/mean",
        "reward/std",
        "frac_zero_std_groups",
        "loss",
        "grad_norm",
        "gss",
        "clip_frac",
        "kl",
        "entropy",
        "len/completion_mean",
        "truncated_frac",
        "logp_gap",
        "time/sample_s",
        "time/score_s",
        "time/score_pass_s",
        "time/update_s",
        "time/step_s",
        "tokens_per_s",
        "mem/sample_gib",
        "mem/score_gib",
        "mem/score_pass_gib",
        "mem/update_gib",
    ):
        assert key in steps[0], key
    phases = sum(steps[0][f"time/{k}_s"] for k in ("sample", "score", "score_pass", "update"))
    assert 0 < phases <= steps[0]["time/step_s"]  # the phases are laps of one step
    assert all(abs(r["logp_gap"]) < 1e-4 for r in steps)  # sampler and trainer agree in float32
    assert any("eval/accuracy" in r for r in rows)
    assert os.path.isfile(os.path.join(out, "final", "model.safetensors"))
    assert os.path.isfile(os.path.join(out, "samples.jsonl"))
    load_model(os.path.join(out, "final"))
    undocumented = {k for r in rows for k in r} - documented_metrics()  # each preset's own metrics too
    assert not undocumented, f"metrics.jsonl names missing from docs/runs.md's table: {sorted(undocumented)}"


def documented_metrics() -> set[str]:
    """The metric names docs/runs.md's Metrics table lists (eval/mean@N and eval/pass@K stand for every N and K)."""
    text = open(os.path.join(ROOT, "docs", "runs.md")).read().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names = {
        n for line in text.splitlines() if line.startswith("| `") for n in re.findall(r"`([^`]+)`", line.split("|")[1])
    }
    return names | {f"eval/{k}@{n}" for k in ("mean", "pass") for n in range(1, 65)}


def test_every_metric_a_method_or_the_loop_names_is_documented():
    """Guards against `gss` and its kin: names shown on every progress line and in metrics.jsonl that no page a user
    reads explains. Every metric key the loop, metrics.py and methods/ write as a literal must be in docs/runs.md's
    table (the slow test_every_preset_runs checks the rows real runs write)."""
    sources = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    sources += [os.path.join("methods", f) for f in os.listdir(os.path.join(ROOT, "methods")) if f.endswith(".py")]
    literal = set()
    for path in sources:
        literal |= set(
            re.findall(
                r'"((?:reward|len|tokens|tis|opsm|token_select|kl_cov|gpg|noise|anchors|tool|time|mem)/[\w@]+)"',
                open(os.path.join(ROOT, path)).read(),
            )
        )
    literal |= {"gss", "gss10_frac", "grad_norm", "logp_gap", "clip_frac", "frac_zero_std_groups", "resampled"}
    missing = {k for k in literal if k not in documented_metrics()}
    assert not missing, sorted(missing)
    assert len(literal) > 20
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().replace("*", "").split())
    first_bar = readme.index("gss=")  # where the README first shows the progress bar, it says what gss is
    assert "gradient spike score" in readme[first_bar - 1500 : first_bar + 1500]


def test_resume_is_bitwise(tiny, tmp_path):
    """Guards against resume losing optimizer, scheduler (cosine), data-order or trainer state: a
    4-step run continued from its step-2 checkpoint must equal the uninterrupted run, bit for bit."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    kw = dict(algo="grpo_ma", answers=2, mu=2, max_thought_tokens=40, max_steps=4)
    train.main(small(BUNDLED, a, save_every=2, **kw))
    train.main(small(BUNDLED, b, resume=os.path.join(a, "step-2"), **kw))
    wa, wb = weights(os.path.join(a, "final")), weights(os.path.join(b, "final"))
    assert any(not torch.equal(wa[k], weights(BUNDLED)[k]) for k in wa)  # training did move the weights
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    rows_a = [json.loads(x) for x in open(os.path.join(a, "metrics.jsonl")) if '"loss"' in x]
    rows_b = [json.loads(x) for x in open(os.path.join(b, "metrics.jsonl")) if '"loss"' in x]
    assert [(r["reward/mean"], r["lr"]) for r in rows_a[2:]] == [(r["reward/mean"], r["lr"]) for r in rows_b]


def test_micro_batch_split_does_not_change_the_update(tiny, tmp_path):
    """Guards against a loss normaliser computed per micro-batch (the gradient would depend on the split)."""
    outs = []
    for rows, tokens in ((64, 0), (3, 0), (64, 150)):  # by rows, and by a token budget (--micro-batch-tokens)
        out = str(tmp_path / f"mb{rows}-{tokens}")
        cfg = small(BUNDLED, out, algo="grpo_ma", answers=2, max_steps=1, micro_batch_rows=rows, max_thought_tokens=40)
        train.main(dataclasses.replace(cfg, micro_batch_tokens=tokens))
        outs.append(weights(os.path.join(out, "final")))
    start = weights(BUNDLED)
    assert any(not torch.equal(start[k], outs[0][k]) for k in start)  # the step did move the weights
    for k in outs[0]:
        torch.testing.assert_close(outs[0][k], outs[1][k], atol=1e-6, rtol=1e-5)
        # the token budget cuts 7 micro-batches: float sums in another order; Adam's first step is ~3e-4
        torch.testing.assert_close(outs[0][k], outs[2][k], atol=5e-6, rtol=1e-5)


def test_token_budget_cuts_micro_batches_within_it(tiny):
    """Guards against --micro-batch-tokens exceeding its budget (rows x longest row + shared prompts x
    longest prompt), losing or repeating a row, or splitting when one micro-batch fits."""
    from pack import pack, rollouts, split_rows

    model = load_model(tiny)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    from sampler import sample_tree

    tree = sample_tree(model, prompts, k=4, m=1, max_thought_tokens=0, max_answer_tokens=9, seed=[1, 2])
    for share in (False, True):
        batch = pack(rollouts([{}, {}], prompts, tree, 4, 1), pad_id=0, device=torch.device("cpu"), share_prompt=share)
        every = torch.sort(torch.cat(split_rows(batch, 64))).values
        assert len(split_rows(batch, 64, max_tokens=10**6)) == 1
        for budget in (1, 20, 40, 80):
            cuts = split_rows(batch, 64, max_tokens=budget)
            assert torch.equal(torch.sort(torch.cat(cuts)).values, every)
            for rows in cuts:
                width = int((batch.to_logical[rows] >= 0).nonzero()[:, 1].max()) + 1
                cost = len(rows) * width
                if share:
                    lens = batch.prompt_valid[torch.unique(batch.prompt_of[rows])].sum(1)
                    cost += len(lens) * int(lens.max())
                assert cost <= budget or len(rows) == 1


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("share_prompt", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_packed_log_probs_equal_separate_forwards(tiny, tmp_path, share_prompt, m, hybrid):
    """Guards against a wrong tree mask, position, jump source or logical index in the packed layout
    (the prompt leading each row, or shared: run once, its keys/values prepended): every completion token's log-prob
    and entropy must equal a plain forward of that one sequence, prompt + thought + answer."""
    from helpers import make_hf_checkpoint
    from logprobs import token_entropy, token_logprobs
    from pack import rollouts
    from sampler import Tree

    model = load_model(make_hf_checkpoint(tmp_path, "qwen3_5") if hybrid else tiny)  # hybrid: pack.tree_hidden
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    P, K = 2, 3
    prompts = [rand(5), rand(8)]
    thoughts = [
        rand(2 + (i * 5) % 7) if m > 1 and i != 4 else [] for i in range(P * K)
    ]  # an empty one: answers jump to the prompt
    answers = [rand(1 + (a * 3) % 5) for a in range(P * K * m)]
    tree = Tree(
        thoughts,
        [[0.0] * len(t) for t in thoughts],
        [False] * (P * K),
        answers,
        [[0.0] * len(a) for a in answers],
        ["stop"] * len(answers),
    )
    groups = rollouts([{}] * P, prompts, tree, K, m)
    batch = train.pack(groups, pad_id=0, device=torch.device("cpu"), share_prompt=share_prompt)
    assert (batch.prompt_ids is not None) == share_prompt and batch.packed_ids.shape[0] == P * K
    rows = torch.tensor([4, 1, 2])  # a micro-batch out of order, across two prompts: the index re-basing runs
    with torch.no_grad():
        full_lp, full_ent = train.token_stats(model, batch, temperature=0.7, entropy=True)
        mb_lp, _ = train.token_stats(model, train.select_rows(batch, rows), temperature=0.7)
    torch.testing.assert_close(mb_lp, full_lp[rows], atol=1e-6, rtol=0)
    completion = batch.thought | (batch.answer_id >= 0)
    assert completion.sum() == sum(map(len, thoughts)) + sum(map(len, answers))
    for r in range(P * K):
        prompt, th = prompts[r // K], thoughts[r]
        for j in range(m):
            seq = torch.tensor([prompt + th + answers[r * m + j]])
            with torch.no_grad():
                logits = model(seq)[0, :-1]
            lp, ent = token_logprobs(logits, seq[0, 1:], 0.7), token_entropy(logits, 0.7)
            # logical columns of this sequence's thought and answer j
            cols = torch.nonzero(batch.thought[r] | (batch.answer_id[r] == j)).flatten()
            n_th = len(th)
            ref_lp = torch.cat([lp[len(prompt) - 1 : len(prompt) - 1 + n_th], lp[len(prompt) - 1 + n_th :]])
            ref_ent = torch.cat([ent[len(prompt) - 1 : len(prompt) - 1 + n_th], ent[len(prompt) - 1 + n_th :]])
            torch.testing.assert_close(full_lp[r, cols], ref_lp, atol=2e-5, rtol=0)
            torch.testing.assert_close(full_ent[r, cols], ref_ent, atol=2e-5, rtol=0)
    assert (full_lp[~completion] == 0).all()


def test_shared_prompt_packing_gives_the_same_update(tiny, tmp_path):
    """Guards against --share-prompt changing the gradient: it is a layout, not an algorithm change."""
    outs = []
    for share in (False, True):
        out = str(tmp_path / f"share{share}")
        train.main(
            small(
                BUNDLED,
                out,
                algo="grpo_ma",
                answers=2,
                max_steps=1,
                share_prompt=share,
                max_thought_tokens=40,
                micro_batch_rows=5,
            )
        )
        outs.append(weights(os.path.join(out, "final")))
    for k in outs[0]:  # Adam's first step is about lr * sign(grad): a layout bug moves weights by ~3e-4
        torch.testing.assert_close(outs[0][k], outs[1][k], atol=2e-5, rtol=0)


# test_two_processes_equal_one's step: 4 prompts x 4 completions, 3 rows per micro-batch (a split across ranks)
DDP_ARGS = ["--algo", "grpo", "--model", BUNDLED, "--max-steps", "1", "--prompts-per-step", "4", "--thoughts", "4"]
DDP_ARGS += ["--max-thought-tokens", "40", "--max-answer-tokens", "8", "--eval-every", "0", "--eval-examples", "4"]
DDP_ARGS += ["--eval-samples", "0", "--micro-batch-rows", "3"]


def assert_equals_one_process(launches: list[list[str]], args: list[str], tmp_path) -> list[str]:
    """One process of train.py `args`, then the `launches` (torchrun command lines, run at once, train.py's the same
    but --out): each ends with 0, and the final weights equal one process's within 1e-5 (and moved). Returns the
    launches' stdouts."""
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "train.py", *args, "--out", one], cwd=ROOT, check=True, env=env, capture_output=True
    )
    kw = dict(cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs = [subprocess.Popen([*launch, "train.py", *args, "--out", many], **kw) for launch in launches]
    try:
        outs, errs = zip(*[p.communicate(timeout=150) for p in procs])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.terminate()  # SIGTERM: the launcher stops its ranks before it exits
            p.communicate()
        pytest.fail("torchrun hung: the ranks never met, or fell out of step in a collective")
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-2000:]
    w1, w2 = weights(os.path.join(one, "final")), weights(os.path.join(many, "final"))
    assert any(not torch.equal(w1[k], weights(BUNDLED)[k]) for k in w1)  # the step did move the weights
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
    return list(outs)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.slow
@pytest.mark.parametrize("share_prompt", [False, True])
def test_two_processes_equal_one(tiny, tmp_path, share_prompt):
    """Guards against DDP changing the update: 2 CPU ranks (gloo) after one step equal 1 process on
    the same global batch (rollout seeds come from the global prompt index, token counts are summed);
    with --share-prompt each micro-batch runs two forwards (prompts, then rows) before one backward."""
    launch = [*TORCHRUN, "--nproc_per_node", "2", "--master-port", "29533"]
    assert_equals_one_process([launch], DDP_ARGS + ["--share-prompt"] * share_prompt, tmp_path)


@pytest.mark.slow
def test_two_nodes_equal_one(tmp_path):
    """Guards docs/real-models.md's two-machine recipe: two torchrun launches, one per node (--nnodes 2,
    --nproc-per-node 1), meeting at a c10d rendezvous (here both on localhost, gloo), after one step equal one
    process, as two ranks of one launch do (a recipe whose flags never form one world hangs, or trains alone)."""
    node = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    node += ["--rdzv-endpoint", "localhost:29545", "--rdzv-id", "two-nodes"]
    outs = assert_equals_one_process([node, node], DDP_ARGS, tmp_path)
    assert sum("done: step 1" in out for out in outs) == 1  # one world: its rank 0 on one node, not a run per node


def test_interrupted_save_keeps_the_last_checkpoint(tiny, tmp_path, monkeypatch):
    """Guards against a crash mid-save leaving a half-written checkpoint that resume would load."""
    out = str(tmp_path / "run")
    train.main(small(tiny, out, max_steps=2, save_every=1))
    real_save = torch.save

    def crash(obj, f, *a, **kw):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train.main(small(tiny, out, max_steps=3, save_every=1, resume=out))
    monkeypatch.setattr(torch, "save", real_save)
    assert os.path.basename(train.checkpoint.find_checkpoint(out)) in (
        "step-2",
        "final",
    )  # both hold step 2, final is newest
    assert not os.path.exists(os.path.join(out, "step-3"))
    load_model(os.path.join(out, "step-2"))


def test_the_clip_fraction_counts_every_epoch(tmp_path):
    """Guards against clip_frac being measured in the first epoch only, where the ratio is exactly 1: with mu = 2
    every logged value was 0 whatever the second epoch clipped. A large step moves the ratio past the clip in the
    second epoch, so clip_frac must be > 0 there (and stays 0 for mu = 1, whose only ratio is 1)."""
    rows = {}
    for mu in (1, 2):
        out = str(tmp_path / f"mu{mu}")
        kw = dict(mu=mu, lr=0.01, max_steps=1, eval_examples=4, eval_samples=0, thoughts=8, max_thought_tokens=24)
        train.main(small(BUNDLED, out, **kw))  # the bundled model: rewards that differ, so advantages that move it
        rows[mu] = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x][0]
    assert rows[1]["clip_frac"] == 0.0
    assert 0.0 < rows[2]["clip_frac"] <= 0.5  # the mean over the epochs: the first one's is 0


def test_non_finite_steps_are_skipped_then_stop(tiny, tmp_path, monkeypatch):
    """Guards against silently applying NaN updates: each is skipped and counted, and a run of them stops."""
    import losses

    real = losses.policy_loss

    def nan_loss(*a, **kw):
        loss, m = real(*a, **kw)
        return loss * float("nan"), m

    monkeypatch.setattr(train, "policy_loss", nan_loss)
    out = str(tmp_path / "nan")
    with pytest.raises(SystemExit, match="consecutive non-finite"):
        train.main(small(tiny, out, max_steps=5, max_bad_steps=3))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if "loss" in line]
    assert [r["skipped_steps"] for r in rows] == [1, 2]
    assert not os.path.exists(os.path.join(out, "final"))  # nothing corrupted was saved


@pytest.mark.slow
def test_help_lists_every_flag():
    """Guards against `train.py --help` crashing (argparse %-formatting of help text), missing a field or a family
    (teachers: the distillation methods'), losing a field's help text, or hiding the family a flag belongs to and
    the values a choice flag takes."""
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    helps, groups = cli._field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in r.stdout, f.name
        assert helps.get(f.name), f"{f.name} has no help comment"
    families = (
        "run",
        "rollouts",
        "rewards",
        "advantages",
        "loss",
        "optimisation",
        "logging and checkpoints",
        "teachers",
    )
    assert set(groups.values()) == set(families)
    sections = [line[:-1] for line in r.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert [s for s in sections if s in families] == list(families)
    for name, allowed in TrainConfig.CHOICES.items():
        assert f"--{name.replace('_', '-')} {{{','.join(allowed)}}}" in r.stdout, name
    for script, cls in (("eval.py", None), ("sft.py", sft.SFTConfig)):
        out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        if cls is not None:
            assert set(cli._field_docs(cls)[1].values()) <= {line[:-1] for line in out.stdout.splitlines()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algo", "ppo"], "--algo must be one of"),
        (["--answers", "4", "--sequence-ratio"], "--sequence-ratio (GSPO) needs --answers 1"),
        (["--advantage", "two_grpo", "--thoughts", "4", "--answers", "1"], "--advantage two_grpo needs --thoughts 2"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--rollout-dtype", "fp16"], "--rollout-dtype must be one of auto, float32, bfloat16"),
        (["--tis-cap", "-1"], "--tis-cap must be >= 0 and finite"),
        (["--optimizer-offload", "--fsdp"], "--optimizer-offload is for one process or DDP"),
        (["--no-enable-thinking"], "--no-enable-thinking pre-fills an empty thought, leaving none to sample answers"),
    ],
)
def test_bad_flags_are_one_clear_error(argv, message):
    """Guards against impossible flag combinations being silently accepted or ending in a traceback."""
    r = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "task, system_prompt, thinking, start, end",
    [
        ("synthetic", "yes=1+1", True, "<|im_start|>system\nyes=1+1<|im_end|>\n<|im_start|>user\n", "assistant\n"),
        ("jsonl", None, True, "<|im_start|>system\n", "<|im_start|>assistant\n"),
        ("jsonl", "", True, "<|im_start|>user\n", "<|im_start|>assistant\n"),
        ("synthetic", None, False, "<|im_start|>user\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
def test_system_prompt_and_thinking_switch_reach_rollouts(tiny, tmp_path, task, system_prompt, thinking, start, end):
    """Guards --system-prompt and --no-enable-thinking being parsed but not used: the prompts a training
    step samples from carry the given system turn (a text replaces the task's, "" removes it, unset
    keeps it: the jsonl task has one) and, with thinking off, the pre-filled empty thought."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+2", "answer": i + 2}) + "\n" for i in range(100)))
    kw = dict(system_prompt=system_prompt, enable_thinking=thinking)
    cfg = small(tiny, str(tmp_path / "run"), task=task, data=str(data) if task == "jsonl" else "", **kw)
    run = train.setup(cfg)
    prompts, _ = train.sample(run, run.pool[:1], [0])
    text = run.tokenizer.decode(prompts[0])
    assert text.startswith(start) and text.endswith(end)


def test_compile_flag_samples_through_the_compiled_step(tiny, tmp_path, monkeypatch):
    """Guards train.py --compile being parsed but not used: the sampler's static decode step is
    compiled once, and rollouts and the held-out evaluation both decode through it (torch.compile is
    replaced by a counting wrapper here: compiling takes minutes on CPU), sampling what eager does."""
    calls = count_compiled_steps(monkeypatch)
    run = train.setup(small(tiny, str(tmp_path / "compiled"), compile=True))
    _, tree = train.sample(run, run.pool[:2], [0, 1])
    steps = calls.count("step")
    train.evaluate_heldout(run, 0)
    assert calls.count("compile") == 1 and steps > 0 and calls.count("step") > steps
    eager = train.setup(small(tiny, str(tmp_path / "eager")))
    assert eager.static_step is None and train.sample(eager, eager.pool[:2], [0, 1])[1].answers == tree.answers


def test_presets_fill_only_unset_flags():
    """Guards against a preset overriding a flag the user typed (or not applying at all)."""
    from cli import parse_config

    cfg, explicit = parse_config(
        TrainConfig, ["--algo", "dapo", "--clip-high", "0.3"], presets=PRESETS, preset_field="algo"
    )
    assert cfg.clip_high == 0.3 and cfg.aggregation == "token_mean" and cfg.dynamic_sampling
    assert explicit == {"algo", "clip_high"}
    cfg, _ = parse_config(TrainConfig, ["--algo", "two_grpo"], presets=PRESETS, preset_field="algo")
    assert (cfg.thoughts, cfg.prompts_per_step, cfg.lr) == (2, 8 * TrainConfig.prompts_per_step, 8 * TrainConfig.lr)


@pytest.mark.slow
def test_a_short_run_learns(tmp_path):
    """Guards against a loop that runs but does not learn (a sign error, misaligned advantages or
    log-probs): 40 seeded GRPO steps from the bundled model must raise held-out mean@4 by at least
    5 points (measured: 0.259 -> 0.374; the spread of a 200-prompt estimate is about 2 points)."""
    out = str(tmp_path / "learn")
    res = train.main(TrainConfig(algo="grpo", out=out, max_steps=40, eval_every=0, samples_every=0))
    before, after = res["first_eval"]["eval/mean@4"], res["last_eval"]["eval/mean@4"]
    assert after - before >= 0.05, (before, after)


def test_gtpo_conflict_weights_use_the_raw_group_advantage():
    """Guards against the GTPO wiring bug: the conflict mask took its positive/negative split from
    the entropy-gated, entropy-shifted advantage, where GTPO's paper and code use the raw group
    advantage. Here the shift makes both completions negative; the raw advantages are +0.5 / -0.5,
    so the shared tokens are conflict tokens: weight x2 on the correct completion, x0 on the wrong one."""
    import types

    from pack import completions, pack, rollouts
    from sampler import Tree

    cfg = TrainConfig(algo="gtpo", thoughts=2, answers=1, prompts_per_step=1, entropy_gamma=1.0, gtpo_conflict=True,
                      entropy_gate=True, std_normalize=False, max_thought_tokens=4, max_answer_tokens=4)  # fmt: skip
    run = types.SimpleNamespace(cfg=cfg, world=1, device=torch.device("cpu"), state={"gate_on": True})
    tree = Tree([[], []], [[], []], [False, False], [[5, 6, 7], [5, 6, 8]], [[0.0] * 3, [0.0] * 3], ["stop"] * 2)
    groups = rollouts([{}], [[1, 2]], tree, 2, 1)
    for (_, _, a), reward in zip(completions(groups), (1.0, 0.0)):
        a.reward = a.correct = a.credit = reward
    batch = pack(groups, pad_id=0, device=torch.device("cpu"))
    batch.entropy = torch.full(batch.ids.shape, 0.6)  # under the ln 2 gate; shift 1.0 * 0.6 > 0.5
    adv, weight, completion, _ = train.advantages(run, groups, batch, batch_accuracy=0.5)
    assert torch.allclose(adv[:, 0], torch.tensor([0.5 - 0.6, -0.5 - 0.6]))  # both negative after the shift
    base = train.advantage.token_weights(completion.float(), cfg.aggregation, max_len=8, num_seqs=2, num_tokens=6)
    # tokens 5, 6 are shared from the start; the last tokens (7 vs 8) differ, so only the first two conflict
    assert torch.equal(weight / base.clamp(min=1e-30) * (base > 0), torch.tensor([[2.0, 2.0, 1.0], [0.0, 0.0, 1.0]]))


def test_case5_a_diverging_update_stops_before_the_sampler_sees_it(tmp_path, monkeypatch):
    """Guards against --lr 1e10 leaving weights whose next forward overflows (the bundled model's norms
    jump from ~1 to ~1e9), which the sampler met as `index 28 is out of bounds`: the update is caught
    right after the optimizer step, the run stops in one sentence naming the step and --lr, and neither
    the sampler nor a checkpoint ever sees those weights."""
    seen = []
    real = train.sample_tree

    def spy(model, *a, **kw):
        seen.append(all(torch.isfinite(p).all() and p.abs().max() < 1e3 for p in model.parameters()))
        return real(model, *a, **kw)

    monkeypatch.setattr(train, "sample_tree", spy)
    out = str(tmp_path / "lr")
    with pytest.raises(cli.UserError) as e:
        train.main(small(BUNDLED, out, lr=1e10, max_steps=4, save_every=1))
    assert re.fullmatch(
        r"step (\d): the update took model\.\S+'s norm from \S+ to \S+; the run stopped before these weights were "
        r"used or saved \(the last checkpoint is intact\): lower --lr \(now 1e\+10\)",
        str(e.value),
    ), str(e.value)
    step = int(str(e.value)[5])
    assert seen == [True] * step  # the sampler only ever ran on sane weights
    assert sorted(set(os.listdir(out)) - {".lock"}) == ["config.json", "metrics.jsonl", "samples.jsonl"] + [
        f"step-{s}" for s in range(1, step)
    ]


def test_the_weight_guard_compares_each_update_with_the_last():
    """Guards against the guard checking against stale norms (the norms before the first update, or none): each
    check compares the weights with those the last check saw, so a slow drift of sane steps never adds up to a
    refusal and a jump after a sane step is refused, naming the parameter."""
    from distributed import WeightGuard

    a, b = torch.ones(4), torch.zeros(3)
    guard = WeightGuard(["a", "b"], [a, b], 1, "lower --lr")
    for step in range(1, 5):  # 4 steps each 500x the last: 6e10x in all, each step is sane
        a.mul_(500.0)
        guard.check(step)
    assert guard.norms[0] == torch.linalg.vector_norm(a)
    b.fill_(float("nan"))
    with pytest.raises(cli.UserError, match=r"^step 5: the update took b's norm from 0 to nan;.*lower --lr$"):
        guard.check(5)


def test_offloaded_adamw_is_adamw_on_the_parameters():
    """Guards against the CPU copies drifting from the parameters (a missed copy back, stale gradients left on
    either side): three steps of OffloadedAdamW equal AdamW's bit for bit, its state dict loads into a new one,
    and zero_grad clears the gradients on both sides."""
    from run import OffloadedAdamW

    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(7)]
    plain, offloaded = ([p.clone().requires_grad_() for p in start] for _ in range(2))
    kw = dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    opt_a, opt_b = torch.optim.AdamW(plain, **kw), OffloadedAdamW(offloaded, torch.device("cpu"), **kw)
    for _ in range(3):
        for params, opt in ((plain, opt_a), (offloaded, opt_b)):
            sum((p * p).sum() + p.sum() for p in params).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(plain, offloaded))
    assert all(p.grad is None for p in offloaded) and all(h.grad is None for h in opt_b.param_groups[0]["params"])
    again = OffloadedAdamW([p.detach().clone().requires_grad_() for p in offloaded], torch.device("cpu"), **kw)
    again.load_state_dict(opt_b.state_dict())
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], opt_a.state_dict()["state"][0]["exp_avg"])


def test_check_update_refuses_non_finite_or_exploding_weights():
    """Guards against a broken update passing the check (NaN, inf, a norm grown past 1000x) or a sane one being
    refused (growth up to 1000x of max(norm, 1), zero-initialised tensors growing to 999)."""
    from distributed import check_update, weight_norms

    names = ["a", "b"]
    ok = [
        (torch.tensor([2.0, 0.0]), torch.tensor([1999.0, 999.0])),
        (torch.tensor([0.5, 3.0]), torch.tensor([1000, 3])),
    ]
    for before, after in ok:
        check_update(names, before, after, 1, 7, "lower --lr")
    bad = [
        (torch.tensor([2.0, 1.0]), torch.tensor([1.0, math.nan]), "b", "nan"),
        (torch.tensor([2.0, 1.0]), torch.tensor([math.inf, 1.0]), "a", "inf"),
        (torch.tensor([2.0, 0.0]), torch.tensor([2001.0, 1.0]), "a", "2e+03"),
        (torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1001.0]), "b", "1e+03"),
    ]
    for before, after, name, shown in bad:
        with pytest.raises(
            cli.UserError, match=rf"^step 7: the update took {name}'s norm from \S+ to {re.escape(shown)};"
        ):
            check_update(names, before, after, 1, 7, "lower --lr")
    x = [torch.tensor([3.0, 4.0]), torch.tensor([[float("nan")]]), torch.tensor([1.0, float("inf")])]
    assert weight_norms(x)[0] == 5.0 and weight_norms(x)[1].isnan() and weight_norms(x)[2].isinf()


def test_case14_sft_refuses_to_overwrite_the_bundled_model_with_other_flags(monkeypatch):
    """Guards against `python sft.py --steps 5` (its --out defaults to assets/tiny-model) silently replacing
    the bundled model with another recipe's; the default recipe (make tiny-model) and any --out DIR still work."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(cli.UserExit, match=r"--out assets/tiny-model is the bundled model, .* with --steps, --lr pass"):
        cli.parse_config(sft.SFTConfig, ["--steps", "5", "--lr", "0.1"])
    assert cli.parse_config(sft.SFTConfig, [])[0].out == "assets/tiny-model"
    assert cli.parse_config(sft.SFTConfig, ["--steps", "5", "--out", "/tmp/x"])[0].steps == 5


def test_case9_the_start_line_and_the_summary_say_what_runs_where():
    """Guards against a run that prints only its progress bar: no line saying what it trains, from which step,
    into which directory, and at the end no held-out accuracy before and after, no time, no pointer to the
    outputs or to the commands that evaluate and plot them."""
    line = cli.start_line(
        algo="grpo_ma",
        flags="rollouts: --thoughts 4 --answers 4",
        model="m",
        task="synthetic",
        out="runs/x",
        step=100,
        max_steps=200,
        resumed_from="runs/x/step-100",
        device="cpu, float32",
        memory="estimated peak memory 0.41 GiB",
    )
    assert line == (
        "train: --algo grpo_ma, model m, task synthetic, on cpu, float32; steps 101-200, "
        "resuming runs/x/step-100 at step 100, into runs/x; estimated peak memory 0.41 GiB\n"
        "       rollouts: --thoughts 4 --answers 4"
    )
    evals = [
        {"step": 0, "eval/greedy_accuracy": 0.425, "eval/mean@4": 0.259, "eval/accuracy": 0.425},
        {"step": 200, "eval/greedy_accuracy": 0.74, "eval/mean@4": 0.676, "eval/accuracy": 0.74},
    ]
    files = ["metrics.jsonl", "config.json"]
    flags = "--task synthetic --max-new-tokens 80 " + cli.eval_size(743_040, "cpu")  # the bundled model's
    assert cli.end_summary(evals, 112.4, "runs/x", files, flags, 200, "8.6 MiB: weights").splitlines() == [
        "done: step 200 in 1 min 52 s (this process)",
        "held-out greedy accuracy: 42.5% at step 0 -> 74.0% at step 200",
        "held-out mean@4: 25.9% at step 0 -> 67.6% at step 200",
        "outputs: runs/x (metrics.jsonl, config.json), weights in runs/x/final (8.6 MiB: weights)",
        "next: python eval.py --model runs/x/final --task synthetic --max-new-tokens 80 --n 16  # pass@k of the "
        "trained model",
        "      python eval.py --plot runs/x --out runs/x/plot.png  # its curves",
    ]


def test_the_start_line_names_every_flag_that_differs_from_its_default():
    """Guards against a start line that showed the preset's flags, not the run's: `--algo rloo --lora-rank 4` never
    mentioned LoRA, `--select hardest` was not shown, `--rollout-dtype bfloat16` still said float32. Every flag that
    differs from its default is named once, grouped by its --help family; the ones the line says elsewhere are not."""
    argv = ["--algo", "rloo", "--lora-rank", "4", "--select", "hardest", "--pass-rates", "r.jsonl", "--no-share-prompt"]
    argv += ["--system-prompt", "be brief", "--out", "runs/x"]
    cfg, _ = cli.parse_config(TrainConfig, argv, presets=PRESETS, preset_field="algo")
    line = cli.changed_flags(cfg, skip=("algo", "out"))
    assert "optimisation: " in line and "--lora-rank 4" in line and "--no-share-prompt" in line
    assert "--select hardest" in line and "--pass-rates r.jsonl" in line and "--system-prompt 'be brief'" in line
    assert "--advantage rloo --no-std-normalize" in line  # the preset's flags too
    assert "--algo" not in line and "--out" not in line and "--thoughts" not in line  # skipped, or at its default
    default, _ = cli.parse_config(TrainConfig, [], presets=PRESETS, preset_field="algo")
    assert cli.changed_flags(default, skip=("algo",)) == "rollouts: --thoughts 4 --answers 4"
    assert cli.changed_flags(TrainConfig(), skip=("algo",)) == ""


def test_a_preset_refusal_names_the_default_preset_and_help_shows_effective_defaults():
    """Guards against `train.py --loss gspo` blaming `--algo None` (the default preset, grpo_ma, was not typed), and
    --help showing `--thoughts (default: 16)` and `--answers (default: 1)` when a run without flags samples 4 x 4
    through the default preset."""
    with pytest.raises(cli.UserExit, match=r"--loss gspo needs --answers 1 \(--algo grpo_ma sets --answers 4\)"):
        cli.parse_config(TrainConfig, ["--loss", "gspo"], presets=PRESETS, preset_field="algo")
    text = " ".join(cli.build_parser(TrainConfig, "", PRESETS, "algo").format_help().split())
    assert "(default: 4, from the default --algo grpo_ma; 16 without that preset)" in text
    assert "(default: 4, from the default --algo grpo_ma; 1 without that preset)" in text
    assert "--prompts-per-step INT P, global over all ranks (default: 16)" in text


def test_micro_batch_rows_takes_a_count_or_auto_and_says_so():
    """Guards against argparse's `invalid int_or_auto value: 'foo'` (the parser function's name) as the sentence a
    user reads for a mistyped --micro-batch-rows."""
    for bad in ("foo", "1.5"):
        with pytest.raises(cli.UserExit, match=rf"--micro-batch-rows: must be a whole number or auto, got '{bad}'"):
            cli.parse_config(TrainConfig, ["--micro-batch-rows", bad], presets=PRESETS, preset_field="algo")
    for good, want in (("auto", "auto"), ("16", 16)):
        cfg, _ = cli.parse_config(TrainConfig, ["--micro-batch-rows", good], presets=PRESETS, preset_field="algo")
        assert cfg.micro_batch_rows == want


def test_the_suggested_evaluation_costs_about_what_the_bundled_models_does_on_a_cpu():
    """Guards against the end summary suggesting eval.py's defaults (200 prompts, greedy and --n 16: 3,400
    completions) whatever the model: at 0.8B on a CPU that takes hours. Parameters x completions stay within the
    device's budget (the bundled model's defaults on a CPU; 1000x on CUDA, with --device cuda), shedding samples
    first (16, 4, then greedy alone), then prompts down to 20."""
    assert cli.eval_size(743_040, "cpu") == "--n 16 "  # the bundled model: eval.py's defaults
    assert cli.eval_size(2_000_000, "cpu") == "--n 4 "  # 1,263 completions fit: 200 x 5
    assert cli.eval_size(5_000_000, "cpu") == "--n 0 "  # 505: 200 greedy
    assert cli.eval_size(50_000_000, "cpu") == "--examples 50 --n 0 "
    assert cli.eval_size(800_000_000, "cpu") == "--examples 20 --n 0 "  # 3 fit: the floor of 20 prompts
    assert cli.eval_size(800_000_000, "cuda") == "--n 4 --device cuda "  # 3,158 fit
    assert cli.eval_size(100_000, "cuda") == "--n 16 --device cuda "
    for params, device in ((2_000_000, "cpu"), (50_000_000, "cpu"), (800_000_000, "cuda")):
        flags = dict(re.findall(r"--(examples|n) (\d+)", cli.eval_size(params, device)))
        budget = 743_040 * 3_400 * (1000 if device == "cuda" else 1)  # the bundled model's defaults on a CPU
        assert params * int(flags.get("examples", 200)) * (int(flags["n"]) + 1) <= budget


def test_a_run_near_its_memory_says_so_and_its_summary_says_what_final_holds(tiny, tmp_path, monkeypatch, capsys):
    """Guards against the 0.8B report: a start line at 98% of the available memory without a word, and a 2-step run
    that wrote a 9.9 GB final/ (float32 masters and AdamW's moments) without saying so. With a fake available figure
    that puts the estimate at 93%, the start line is followed by one warning line; the end summary gives final/'s
    size on disk (its files' bytes) and what takes it, with the flag that leaves the optimizer state out."""
    import memory
    from tasks import get_task

    cfg, peaks = small(tiny, str(tmp_path / "run"), max_steps=1), []
    real = memory.estimate
    spy = lambda c, shape, **kw: (r := real(c, shape, **kw), peaks.append(max(sum(t.values()) for t in r.values())))[0]
    monkeypatch.setattr(memory, "estimate", spy)
    monkeypatch.setattr(memory, "process_bytes", lambda: 0)  # the available figure is then exactly the fake one
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 50)
    memory.check_memory(cfg, get_task("synthetic"), torch.device("cpu"), 1)
    monkeypatch.setattr(memory, "available_bytes", lambda device, have=int(peaks[-1] / 0.93): have)
    train.main(cfg)
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("train: --algo grpo"))  # then its flags
    warning = out[start + 2]
    assert re.match(r"warning: the estimated peak is 9[234]% of the available memory, above the 85% ", warning)
    assert warning.endswith(
        "lower --micro-batch-rows or --micro-batch-tokens, or pass --gradient-checkpointing or --lora-rank N"
    )
    final = os.path.join(cfg.out, "final")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(final) for f in names)
    saved = f"({size / 2**20:.1f} MiB: weights and AdamW moments; --no-save-optimizer leaves them out)"
    assert f"weights in {final} {saved}" in "\n".join(out)
    assert f"python eval.py --model {final} --task synthetic --max-new-tokens 18 --n 16  # pass@k" in "\n".join(out)


def test_the_end_summary_names_the_merged_weights():
    """Guards against a --merge run whose summary pointed only at final/ (the adapters), never at OUT/merged."""
    text = cli.end_summary([], 5.0, "runs/x", ["metrics.jsonl"], "", 3, "1.0 MiB: LoRA adapters", merged=True)
    assert "merged (a full HF checkpoint) in runs/x/merged" in text and "--model runs/x/merged" in text


def test_case15_random_checkpoint_builds_a_published_shape(tmp_path, monkeypatch):
    """Guards against the README's offline path to a real-shaped model (bench/random_checkpoint.py) drifting from
    the benchmarks' (one MODELS table, one build function) or writing a config that is not the published one."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_scale
    import random_checkpoint

    assert bench_scale.MODELS is random_checkpoint.MODELS and bench_scale.checkpoint is random_checkpoint.checkpoint
    shape = {
        **random_checkpoint.MODELS["qwen2.5-0.5b"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    monkeypatch.setitem(random_checkpoint.MODELS, "tiny-qwen2.5", shape)
    tok, _ = random_checkpoint.tokenizer_dir(tmp_path, "char")
    random_checkpoint.build("tiny-qwen2.5", tmp_path / "m", tok, seed=0, layers=2)
    model = load_model(tmp_path / "m")
    assert model.config.num_hidden_layers == 2 and model.config.torch_dtype == "bfloat16"
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert {k: written[k] for k in ("vocab_size", "hidden_size", "rope_theta", "tie_word_embeddings")} == {
        k: shape[k] for k in ("vocab_size", "hidden_size", "rope_theta", "tie_word_embeddings")
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--clip-low", "2"], "--clip-low must be in [0, 1), got 2.0"),
        (["--clip-low", "-0.1"], "--clip-low must be in [0, 1), got -0.1"),
        (["--clip-high", "0"], "--clip-high must be > 0 and finite, got 0.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1] (1 = off), got 1.5"),
        (["--top-p", "0"], "--top-p must be > 0 and finite, got 0.0"),
        (["--lr", "inf"], "--lr must be > 0 and finite, got inf"),
        (["--beta", "nan"], "--beta must be >= 0 and finite, got nan"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
        (["--thought-weight", "-1"], "--thought-weight must be >= 0 and finite, got -1.0"),
        (["--agrae-alpha", "0"], "--agrae-alpha must be > 0 and finite, got 0.0"),
        (["--entropy-threshold", "0"], "--entropy-threshold must be > 0 and finite, got 0.0"),
        (["--gtpo-w-neg", "-1"], "--gtpo-w-neg must be >= 0 and finite, got -1.0"),
        (["--max-resample-rounds", "0"], "--max-resample-rounds must be >= 1, got 0"),
        (["--overlong-buffer", "-1"], "--overlong-buffer must be >= 0, got -1"),
    ],
)
def test_numeric_flags_are_range_checked_when_parsed(argv, message):
    """Guards against a numeric flag outside its range being accepted silently (--clip-low 2 once was: a
    clip range whose low end is negative) or failing only after the model has loaded: parsing alone refuses it."""
    with pytest.raises(cli.UserExit) as e:
        cli.parse_config(TrainConfig, argv, presets=PRESETS, preset_field="algo")
    assert str(e.value) == message + " (see --help)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--algo", "dagrpo", "--answers", "4"],
            "--algo dagrpo sets --aggregation seq_mean_token_sum_norm/--pair-delta/--anchors (an anchor is a whole "
            "reference completion, not a thought and its answers), which need --answers 1",
        ),
        (
            ["--algo", "dagrpo", "--anchors", "--answers", "4"],
            "--aggregation seq_mean_token_sum_norm/--pair-delta/--anchors (an anchor is a whole reference completion, "
            "not a thought and its answers) need --answers 1 (--algo dagrpo sets --aggregation "
            "seq_mean_token_sum_norm, --pair-delta 0.1)",
        ),
        (
            ["--algo", "grpo_ma", "--sequence-ratio"],
            "--sequence-ratio (GSPO) needs --answers 1 (--algo grpo_ma sets --answers 4)",
        ),
        (
            ["--algo", "two_grpo", "--thoughts", "4"],
            "--algo two_grpo sets --advantage two_grpo, which needs --thoughts 2 --answers 1",
        ),
        (
            ["--algo", "gtpo", "--answers", "2"],
            "--algo gtpo sets --gtpo-conflict/--entropy-gate/--entropy-gamma, which need --answers 1",
        ),
        (
            ["--algo", "grpo_ma", "--end-of-thought", ""],
            "--algo grpo_ma sets --answers 4, which needs an --end-of-thought marker",
        ),
        (["--pair-delta", "0.1", "--answers", "2"], "--pair-delta needs --answers 1"),
    ],
)
def test_a_presets_value_is_never_blamed_as_typed(argv, message):
    """Guards against an error that names a flag the user did not type as the problem (`--algo dagrpo --answers 4`
    once said `--pair-delta must be ...`): what a preset set is said to come from the preset, and checks that fail
    the same way are one sentence."""
    with pytest.raises(cli.UserExit) as e:
        cli.parse_config(TrainConfig, argv, presets=PRESETS, preset_field="algo")
    assert str(e.value) == message + " (see --help)"


def test_every_preset_is_valid_alone():
    """Guards against a preset whose own values contradict each other (every run of it would be refused); opd needs
    the one thing no preset can name, its --teacher checkpoint."""
    from hf import BUNDLED

    for name in PRESETS:
        extra = ["--teacher", BUNDLED] if name == "opd" else []
        cli.parse_config(TrainConfig, ["--algo", name, *extra], presets=PRESETS, preset_field="algo")


def test_the_default_model_is_the_bundled_one_from_any_working_directory(tmp_path, monkeypatch):
    """Guards against `python /path/to/train.py` failing outside the project directory with
    'assets/tiny-model: model directory not found': the default names the project's own copy, while a
    directory of that name in the working directory, or any other path, is taken as typed."""
    from hf import BUNDLED, bundled

    monkeypatch.chdir(tmp_path)
    assert bundled(BUNDLED) == os.path.join(ROOT, "assets", "tiny-model")
    assert bundled("elsewhere/model") == "elsewhere/model"
    (tmp_path / "assets" / "tiny-model").mkdir(parents=True)
    assert bundled(BUNDLED) == BUNDLED
    assert TrainConfig().model == BUNDLED


@pytest.mark.slow
def test_train_and_eval_find_the_bundled_model_from_another_directory(tmp_path):
    """The same through the command lines: eval.py evaluates the bundled model from a foreign working
    directory, and train.py gets as far as its memory estimate, which reads the model's config."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "eval.py"), "--examples", "2", "--n", "1", "--k", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "accuracy" in r.stdout, r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--prompts-per-step", "100000", "--out", "run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: a training step needs about "), r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


FLAG_CONFIGS = [("train.py", TrainConfig), ("sft.py", sft.SFTConfig), ("grpo_minimal.py", None), ("eval.py", None)]


@pytest.mark.parametrize("script, cls", FLAG_CONFIGS)
def test_a_mistyped_flag_is_refused_before_torch_loads_with_the_closest_flag(script, cls):
    """Guards against a typo costing the seconds of torch's import and naming no alternative (`--modle x` said only
    'unrecognized arguments'), and against the early check's names drifting from the config dataclass: every field's
    flag (a bool's --no- form too) passes it, and only the typo is named, before torch is imported."""
    import eval as evaluation
    import grpo_minimal

    cls = cls or {"grpo_minimal.py": grpo_minimal.Config, "eval.py": evaluation.EvalConfig}[script]
    argv = ["--seeed", "x"]
    for f in dataclasses.fields(cls):
        argv += [cli.flag(f.name), f"--no-{cli.flag(f.name)[2:]}"] if f.type == "bool" else [cli.flag(f.name), "1"]
    code = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code, script, *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr[-2000:]
    assert r.stderr.strip() == "error: unrecognized arguments: --seeed; did you mean --seed? (see --help)"


def test_the_parser_suggests_the_closest_flags():
    """Guards against the full parser (tests, torchrun, flags past the early check) naming no alternative to a typo."""
    with pytest.raises(cli.UserExit, match=r"unrecognized arguments: --steps 5; did you mean --max-steps"):
        cli.parse_config(TrainConfig, ["--steps", "5"])
    with pytest.raises(cli.UserExit, match=r"--zzz-qqq \(see --help\)$"):  # nothing close: no suggestion
        cli.parse_config(TrainConfig, ["--zzz-qqq"])


def test_the_bar_counts_from_the_resumed_step_and_stops_with_the_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    """Guards against the progress bar disagreeing with the run: at SIGINT it showed 81/200 while the checkpoint
    was step 82; after a resume it counted 0/118, not 83/200; and --resume of a finished run printed "steps 201-200"
    instead of saying that it is done and how to extend it (exit status 0); the README showing other names than the
    bar's; and a CPU run ending on the jargon line `decode path: eager`."""
    import signal

    out, real_log, handlers = str(tmp_path / "run"), train.log, {s: signal.getsignal(s) for s in (2, 15)}

    def log_then_interrupt(run, row, **kw):
        real_log(run, row, **kw)
        if row.get("step") == 2 and "loss" in row:  # Ctrl-C during step 2's bookkeeping: it stops after step 2
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train, "log", log_then_interrupt)
    try:
        with pytest.raises(SystemExit) as e:
            train.main(small(tiny, out, max_steps=4))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "stopped at step 2 of 4 by SIGINT" in err, err[-3000:]
    assert re.findall(r"\| (\d)/4 ", err.split("stopped at step")[0])[-1] == "2"
    monkeypatch.setattr(train, "log", real_log)
    train.main(small(tiny, out, max_steps=4, resume=out))
    said = capsys.readouterr()
    counts = re.findall(r"\| (\d)/(\d) ", said.err)
    assert counts[0] == ("2", "4") and counts[-1] == ("4", "4") and {c[1] for c in counts} == {"4"}
    readme = open(os.path.join(ROOT, "README.md")).read()  # the bar's names as the README shows them
    assert re.search(r"reward/mean=[-\d.]+, accuracy=[\d.]+, gss=[\d.]+\]", said.err)
    assert re.search(r"\d+/200 \[.*, reward/mean=[\d.]+, accuracy=[\d.]+, gss=[\d.]+\]", readme)
    assert "decode path" not in said.out  # eager on a CPU: nothing to explain
    with pytest.raises(SystemExit) as e:
        train.main(small(tiny, out, max_steps=4, resume=out))
    said = f"--resume {out}/final: already at its last step (4); to extend it, --max-steps N > 4"
    assert e.value.code == 0 and capsys.readouterr().out.strip() == said


def test_every_readme_command_that_trains_writes_its_own_run_directory():
    """Guards against the README's commands colliding with `make train`'s runs/default: after it, the tools command
    and every flags-by-family example were refused (`--out runs/default already holds files`)."""
    text = open(os.path.join(ROOT, "README.md")).read().replace("\\\n", " ")
    commands = [line for line in text.splitlines() if re.match(r"(python|torchrun .*) train\.py ", line)]
    outs = [re.search(r"--out (\S+)", c) for c in commands if "--resume" not in c]
    assert len(outs) >= 12 and all(outs), [c for c, o in zip(commands, outs) if not o]
    names = [o[1] for o in outs]
    assert len(set(names)) == len(names) and "runs/default" not in names
