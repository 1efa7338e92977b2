"""The methods' seams: every extension's flag checks are gathered by TrainConfig, and DAPO's dynamic sampling
redraws exactly the flat groups from their own slot's top-ups and seeds (so the world size cannot change them)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import types

import pytest

import config
import methods
from distributed import derive_seed
from methods import dapo
from model import ModelConfig
from pack import Answer, Group, Thought

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = {  # one bad value of a flag each method owns (or a combination its check refuses)
    "hard_examples": dict(select_fraction=0.0),
    "noise": dict(reward_noise="0.2"),
    "dapo": dict(max_resample_rounds=0),
    "dagrpo": dict(anchor_gamma=0.0),
    "gtpo": dict(entropy_threshold=0.0),
    "entropy_mask": dict(top_entropy_fraction=2.0),
    "cov": dict(clip_cov_ratio=0.0),
    "sapo": dict(sapo_tau_pos=0.0),
    "dppo": dict(dppo_kl_tau=-1.0),
    "agrae": dict(agrae_alpha=0.0),
    "gspo": dict(sequence_ratio=True, loss="sapo"),
    "gmpo": dict(loss="gmpo", answers=2),
    "two_grpo": dict(advantage="two_grpo", thoughts=3),
    "dsv32": dict(opsm_delta=-2.0),
    "mismatch": dict(tis_floor=-1.0),
    "staleness": dict(staleness=-1),
    "m2po": dict(m2po_threshold=-1.0),
    "rloo": dict(advantage="rloo"),  # needs --no-std-normalize
    "maxrl": dict(advantage="maxrl"),  # needs --no-std-normalize
    "gdpo": dict(reward_weights="correct"),  # not name=number
    "reinforce_pp": dict(advantage="reinforce_pp"),
    "batch_std": dict(batch_std=True, std_normalize=False),
    "kl": dict(kl_in_reward=True),  # needs --beta > 0
    "dual_clip": dict(dual_clip=0.5),
    "entropy_bonus": dict(entropy_coef=-1.0),
    "tools": dict(max_tool_calls=0),
    "teacher": dict(teacher="/no/such/checkpoint"),
    "opd": dict(teacher_coef=-1.0),
    "rlsd": dict(rlsd_lambda=2.0),
    "sdpo": dict(sdpo_weight=2.0),
}
# presets and objectives with no flag of their own to check
NOTHING_TO_REFUSE = ("grpo_ma", "dr_grpo", "cispo", "gpg", "mask_truncated", "components")


def test_every_method_is_checked():
    """Guards against a method file the trainer never loads (methods.ORDER names the files, in the seams' order) or
    whose flag checks TrainConfig never runs (a bad value would then be accepted until it fails mid-run, or never):
    every file in methods/ is loaded, and each one's bad value is refused with its flag named."""
    files = {f[:-3] for f in os.listdir(os.path.join(ROOT, "methods")) if f.endswith(".py") and f != "__init__.py"}
    loaded = {m.__name__.split(".")[-1] for m in methods.METHODS}
    assert loaded == files == set(BAD) | set(NOTHING_TO_REFUSE)
    for bad in BAD.values():
        flag = "--" + next(iter(bad)).replace("_", "-")
        with pytest.raises(ValueError, match=flag):
            config.TrainConfig(**bad)


def test_chain_passes_a_value_through_the_enabled_hooks_in_order(monkeypatch):
    """Guards against a seam that skips a hook, calls a disabled method's, reorders them, or drops the context:
    chain threads the value through every enabled method's hook in ORDER; needs() asks the enabled ones only."""
    calls = []

    def method(name: str, on: bool, needs: bool):
        def seam(run, value, step, counts):
            calls.append((name, value, step))
            counts[name] = step
            return value + [name]

        return types.SimpleNamespace(enabled=lambda cfg: on, seam=seam, needs_it=lambda cfg: needs)

    fake = (method("first", True, False), method("off", False, True), method("last", True, False))
    monkeypatch.setattr(methods, "METHODS", fake)
    run, counts = types.SimpleNamespace(cfg=None), {}
    assert methods.chain(run, "seam", [], 7, counts) == ["first", "last"]
    assert calls == [("first", [], 7), ("last", ["first"], 7)] and counts == {"first": 7, "last": 7}
    assert methods.chain(run, "no_such_seam", 1.5) == 1.5  # no method has the hook: the value as it came
    assert not methods.needs(None, "needs_it")  # only the disabled method says yes
    monkeypatch.setattr(methods, "METHODS", fake[1:2])
    assert methods.chain(run, "seam", [], 7, counts) == []


def test_the_mismatch_correction_is_on_only_when_a_copy_samples(monkeypatch):
    """Guards against the rollout-mismatch weights running when the float32 policy samples itself (nothing to
    correct) or missing when a bfloat16 copy samples (by default on CUDA): mismatch.enabled follows the resolved
    --rollout-dtype and --tis-cap."""
    from methods import mismatch

    cfg = config.TrainConfig()
    for cuda in (False, True):
        monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
        assert mismatch.enabled(cfg) is cuda  # auto: a bfloat16 copy on CUDA
        assert not mismatch.enabled(config.TrainConfig(device="cpu"))
        assert not mismatch.enabled(config.TrainConfig(rollout_dtype="float32"))
        assert mismatch.enabled(config.TrainConfig(rollout_dtype="bfloat16"))
        assert not mismatch.enabled(config.TrainConfig(rollout_dtype="bfloat16", tis_cap=0.0))


def group(example: dict, rewards: list[float]) -> Group:
    """A group of one-token completions with these rewards (M = 1)."""
    return Group(example, [1], [Thought([], [], False, [Answer([2], [0.0], "stop", reward=r)]) for r in rewards])


def test_dynamic_sampling_redraws_flat_groups_from_their_slots():
    """Guards against top-ups drawn by rank-local position instead of the global slot (the world size would change
    the run), a round's seed reused by the next, redrawing groups with contrast, or miscounting: slot 5's flat group
    is redrawn from top-ups (step * P + 5) * R + round - 1 with seed derive_seed(seed, step, 5, round, 1), twice
    (the first redraw is flat again), and slot 6's mixed group is left alone."""
    cfg = types.SimpleNamespace(max_resample_rounds=3, prompts_per_step=8, seed=7)
    topups = [{"i": i} for i in range(2 * 8 * 3)]
    calls = []

    def redraw(examples, seeds):
        calls.append((examples, seeds))
        return [group(ex, [1.0, 1.0] if len(calls) == 1 else [1.0, 0.0]) for ex in examples]

    groups = [group({"i": "a"}, [0.0, 0.0]), group({"i": "b"}, [0.0, 1.0])]
    kept = groups[1]
    groups, n = dapo.dynamic_sampling(groups, 1, [5, 6], topups, cfg, redraw)
    assert n == 2 and groups[1] is kept and groups[0].example == {"i": (8 + 5) * 3 + 1}
    assert calls == [
        ([{"i": (8 + 5) * 3}], [derive_seed(7, 1, 5, 1, 1)]),
        ([{"i": (8 + 5) * 3 + 1}], [derive_seed(7, 1, 5, 2, 1)]),
    ]


def test_the_loop_reads_no_methods_flag_and_the_core_imports_no_method():
    """Guards against a paper woven back into the loop: train.py, its setup or any file outside methods/ (the memory
    estimate, the loss) reading a flag that a method file owns (cfg.X, run.cfg.X or hp.X for a field of some
    methods/*.py Flags: it must go through a seam, or a field of losses.Tokens, instead), or the
    model, the sampler and the RL core (advantage.py, losses.py, pack.py) importing methods/, which would make the
    core depend on the papers built on it."""
    import ast
    import dataclasses

    owned = {f.name for m in methods.METHODS if hasattr(m, "Flags") for f in dataclasses.fields(m.Flags)}
    reads = []
    # every file but config.py (it gathers the flags) and eval.py (its own EvalConfig has a --pass-rates too)
    trainer = [f for f in os.listdir(ROOT) if f.endswith(".py") and f not in ("config.py", "eval.py")]
    for loop in trainer:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, loop)).read())):
            if isinstance(node, ast.Attribute) and node.attr in owned:
                base = node.value
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                if name in ("cfg", "config", "hp"):
                    reads.append(f"{loop}:{node.lineno} reads --{node.attr.replace('_', '-')}")
    assert not reads, reads
    assert owned >= {"gtpo_conflict", "dynamic_sampling", "top_entropy_fraction", "kl_in_reward", "tis_cap"}
    # and positively: the loop and its setup read the core's flags (config.CoreFlags) and nothing else
    core = {f.name for f in dataclasses.fields(config.CoreFlags)} | {"completion_limit"}  # a property of them
    model = {f.name for f in dataclasses.fields(ModelConfig)}  # policy.config.X: the model's, not a flag
    for loop in ("train.py", "run.py"):
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, loop)).read())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
                base = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
                allowed = core | (model if base == "config" else set())
                assert base not in ("cfg", "config") or node.attr in allowed, f"{loop}:{node.lineno} .{node.attr}"
    for core in ("model.py", "sampler.py", "advantage.py", "losses.py", "pack.py", "hf.py", "tokenizer.py"):
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, core)).read())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] == "methods" for n in names), f"{core} imports methods"


def imports(path: str) -> set[str]:
    """The top-level names of the modules a file imports."""
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


LANGUAGE_MODEL = (
    "model",
    "deltanet",
    "logprobs",
    "hf",
    "tokenizer",
    "kvcache",
    "graphs",
    "fused",
    "sampler",
    "stop_text",
    "multiturn",
)
RL_CORE = ("advantage", "losses", "pack", "lora")
TASKS_AND_REWARDS = ("tasks", "data", "rewards", "math_answers", "math_equal", "sandbox", "confine", "calls", "envs")
LOOP = ("train", "run", "config", "methods", "eval", "heldout", "grpo_minimal")
INFRASTRUCTURE = ("checkpoint", "distributed", "memory", "metrics", "cli", "sft")  # any layer may use these


@pytest.mark.parametrize(
    "layer, below",
    [(LANGUAGE_MODEL, LANGUAGE_MODEL), (RL_CORE, LANGUAGE_MODEL + RL_CORE), (TASKS_AND_REWARDS, TASKS_AND_REWARDS)],
)
def test_each_layer_imports_only_the_layers_below_it(layer, below):
    """Guards the README's layout: the language model imports nothing of the RL core, the tasks or the loop; the RL
    core only the language model; the tasks and rewards (pure functions of text) nothing of the model or the loop
    (the run infrastructure is open to all). A module imported across these lines makes a file that cannot be
    read, or forked, without the other; a new top-level file must be given a layer."""
    layered = set(LANGUAGE_MODEL + RL_CORE + TASKS_AND_REWARDS + LOOP)
    for name in layer:
        crossing = (imports(f"{name}.py") & layered) - set(below)
        assert not crossing, f"{name}.py imports {sorted(crossing)}"
    everything = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} | {"methods"}
    unplaced = everything - layered - set(INFRASTRUCTURE)
    assert not unplaced, f"a top-level file in no layer: {sorted(unplaced)}"


def test_no_source_file_is_over_500_lines():
    """Guards the readability budget: a project source file (top level, methods/) past 500 lines holds more than
    one concept and should be split along them, as model/kvcache/sampler and math_answers/math_equal are."""
    files = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    files += [os.path.join("methods", f) for f in os.listdir(os.path.join(ROOT, "methods")) if f.endswith(".py")]
    long = {f: n for f in files if (n := len(open(os.path.join(ROOT, f)).read().splitlines())) > 500}
    assert not long, long
    assert len(files) > 40


def test_the_readme_is_a_front_page_within_its_budget():
    """Guards the README's budget: it grew to 20,063 characters against the 16,000 set when the detail moved to
    docs/. It stays at most 16,000 characters, shows the two quick-start commands, and every docs/ page it links
    exists."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text) <= 16_000, f"README.md is {len(text)} characters: move detail to docs/"
    assert "make train" in text and "make test" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link


@pytest.mark.slow
def test_the_trainer_runs_with_every_method_file_deleted(tmp_path):
    """Guards "deleting a method's file leaves a working trainer" at its limit: a copy of the project with
    methods/ reduced to __init__.py trains plain GRPO end to end (its default --algo), offers only that preset,
    and the copy with one method deleted (dapo.py, whose flags the memory estimate once read) still runs another."""
    import shutil
    import subprocess
    import sys

    from helpers import BUNDLED

    def copy(keep) -> str:
        d = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        (d / "methods").mkdir(parents=True)
        for f in os.listdir(ROOT):
            if f.endswith(".py"):
                shutil.copy(os.path.join(ROOT, f), d / f)
        for f in os.listdir(os.path.join(ROOT, "methods")):
            if f == "__init__.py" or f[:-3] in keep:
                shutil.copy(os.path.join(ROOT, "methods", f), d / "methods" / f)
        return str(d)

    flags = ["--model", BUNDLED, "--max-steps", "1", "--prompts-per-step", "2", "--thoughts", "2"]
    flags += ["--max-thought-tokens", "16", "--max-answer-tokens", "8", "--eval-examples", "2", "--eval-samples", "0"]
    bare = copy(keep=())
    run = subprocess.run([sys.executable, "train.py", *flags, "--out", "out"], cwd=bare, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert os.path.isfile(os.path.join(bare, "out", "final", "model.safetensors"))
    assert json.load(open(os.path.join(bare, "out", "config.json")))["algo"] == "grpo"
    err = subprocess.run([sys.executable, "train.py", "--algo", "dapo"], cwd=bare, capture_output=True, text=True)
    assert err.returncode == 2 and "--algo must be one of grpo," in err.stderr
    others = {m.__name__.split(".")[-1] for m in methods.METHODS} - {"dapo"}
    no_dapo = copy(keep=others)
    cmd = [sys.executable, "train.py", *flags, "--algo", "gtpo", "--out", "out"]
    run = subprocess.run(cmd, cwd=no_dapo, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_every_top_level_module_is_installed():
    """Guards `pip install .` against a new top-level file missing from pyproject.toml's py-modules (the installed
    project would fail on its first import of it), or a listed module that no longer exists."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    files = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    assert set(setuptools["py-modules"]) == files and setuptools["packages"] == ["methods"]


@pytest.mark.slow
def test_one_plain_grpo_step_reads_at_most_500_lines():
    """Guards the read path's targets against creeping back (bench/read_path.py measures them): one step of
    --algo grpo enters at most 500 code lines of the loop, the RL core, the task's reward and the seams, runs no
    method's hook, and at most 10 of its loop and core lines read a field only a method fills. The counter itself
    is checked: the step enters sample, policy_loss and pack, and DAPO's step runs DAPO's hooks."""
    spec = importlib.util.spec_from_file_location("read_path", os.path.join(ROOT, "bench", "read_path.py"))
    read_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(read_path)
    m = read_path.measure("grpo")
    names = {(path, name) for path, fns in m["by_file"].items() for _, name in fns}
    assert {("train.py", "sample"), ("losses.py", "policy_loss"), ("pack.py", "pack")} <= names
    assert m["read_path"] <= 500 and m["hook_lines"] == 0 and m["method_fields"] <= 10, m["read_path"]
    dapo = read_path.measure("dapo")
    assert dapo["hook_lines"] > 0 and "methods/dapo.py" in dapo["hooks"]
