"""LoRA adapters (lora.py): the frozen base as reference, gradients through every target (the fused MLP
path included), merged weights for the sampler, PEFT-format checkpoints both ways, the merged HF checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import lora
import model as M
from cli import UserExit, parse_config
from helpers import hf_logits, make_hf_model
from hf import load_model, save_model
from logprobs import head_logprobs
from sampler import generate

ALL = lora.DECODER
TOL = dict(atol=1e-5, rtol=1e-5)  # float32, two implementations of the same formula


def ids(B: int = 2, T: int = 24, V: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def randomize_b(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Nonzero B everywhere, so every adapter changes the output (a fresh adapter's B is zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_layers(model).values():
            m.lora_B.copy_(std * torch.randn(m.lora_B.shape, generator=g))


@pytest.fixture
def qwen2(tmp_path):
    """A tiny random Qwen2 checkpoint (q/k/v bias, untied head) written by transformers, and its path."""
    path = tmp_path / "qwen2"
    make_hf_model("qwen2").save_pretrained(path)
    return path


def wrapped(path, rank: int = 4, alpha: float = 8.0, targets=ALL, seed: int = 0) -> M.Transformer:
    m = lora.add_lora(load_model(path), rank, alpha, targets, seed=seed)
    randomize_b(m)
    return m


# ----------------------------------------------------------------------------- the layer and the reference


def test_fresh_adapter_changes_no_bit_and_freezes_the_base(qwen2):
    """Guards the initialisation: B must start at zero (a nonzero B, or a bias added twice, moves the policy
    before its first update), A as PEFT draws it (kaiming-uniform, |A| <= 1/sqrt(in)), the base frozen and
    the optimizer's list exactly the adapters, with their names showing it."""
    base, m = load_model(qwen2), lora.add_lora(load_model(qwen2), 4, 8, ALL, seed=0)
    x = ids()
    with torch.no_grad():
        assert torch.equal(m(x), base(x))
        assert torch.equal(lora.merged_copy(m)(x), base(x))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * 7 * m.config.num_hidden_layers
    assert [id(p) for p in lora.lora_parameters(m)] == [id(p) for n, p in m.named_parameters() if p.requires_grad]
    q = m.model.layers[0].self_attn.q_proj
    assert q.lora_A.shape == (4, 64) and q.lora_B.shape == (64, 4) and q.scaling == 2.0
    assert 0 < q.lora_A.abs().max() <= 1 / 64**0.5 and q.lora_A.std() > 0.5 / (3 * 64) ** 0.5
    # the base names are untouched, so the base loads and saves name by name as before
    assert set(base.state_dict()) == {k for k in m.state_dict() if not k.endswith((".lora_A", ".lora_B"))}
    again = lora.add_lora(load_model(qwen2), 4, 8, ALL, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(lora.lora_parameters(m), lora.lora_parameters(again)))


def test_adapters_off_is_the_base_model_bit_for_bit(qwen2):
    """Guards the KL reference without a second copy of the weights: under adapters_off the wrapped model's
    logits and training-path log-probs equal the unwrapped base's bit for bit, with and without grad (the
    fused MLP path must drop the down adapter too), and the adapters come back on after the block, even
    after an exception inside it."""
    base, m = load_model(qwen2), wrapped(qwen2)
    x = ids()

    def logp(model):
        h = model(x[:, :-1], hidden=True)
        return head_logprobs(model, h, x[:, 1:])[0]

    with torch.no_grad():
        on, want = m(x), base(x)
        with lora.adapters_off(m):
            assert torch.equal(m(x), want)
    with lora.adapters_off(m):
        assert torch.equal(logp(m), logp(base))  # grad enabled: the fused MLP path
    assert not torch.equal(on, want)
    with pytest.raises(RuntimeError), lora.adapters_off(m):
        raise RuntimeError
    with torch.no_grad():
        assert torch.equal(m(x), on)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_gradients_reach_every_target_as_plain_autograd(qwen2, autocast, monkeypatch):
    """Guards the fused SwiGLU backward with an adapter on down_proj: it uses down_proj's weight directly, so
    a LoRA on down would be silently skipped there. Output and every adapter gradient must equal plain
    autograd's (the MLP written out, the adapter's own forward) bit for bit, every adapter gets a nonzero
    gradient, the frozen base none, and the training path's output equals the no-grad path's."""
    m = wrapped(qwen2).train()
    x = ids()

    def run():
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = m(x[:, :-1], hidden=True)
            lp = head_logprobs(m, h, x[:, 1:])[0]
        lp.sum().backward()
        return [lp.detach()] + [p.grad for p in lora.lora_parameters(m)]

    ours = run()
    assert all(g is not None and g.abs().sum() > 0 for g in ours[1:])
    assert all(p.grad is None for n, p in m.named_parameters() if not n.endswith((".lora_A", ".lora_B")))
    with monkeypatch.context() as mp:
        mp.setattr(M.MLP, "forward", lambda self, x: self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
        plain = run()
    for a, b in zip(ours, plain):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert torch.equal(head_logprobs(m, m(x[:, :-1], hidden=True), x[:, 1:])[0], ours[0])
    m.gradient_checkpointing = True  # each layer recomputed in backward: the same gradients
    for a, b in zip(run(), ours):
        assert torch.equal(a, b)


def test_arguments_are_checked():
    """Guards against a silently ignored target name or an impossible rank: one sentence each."""
    assert lora.parse_targets("down, q,v") == ("q", "v", "down")
    for bad in ("q,x", "", "q_proj"):
        with pytest.raises(ValueError, match="--lora-targets"):
            lora.parse_targets(bad)
    cfg = M.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, model_type="llama")  # fmt: skip
    for kw, msg in [(dict(rank=0), "rank"), (dict(alpha=0), "alpha"), (dict(targets=("x",)), "targets")]:
        with pytest.raises(ValueError, match=msg):
            lora.add_lora(M.Transformer(cfg), **(dict(rank=2, alpha=4, targets=ALL) | kw))
    m = lora.add_lora(M.Transformer(cfg), 2, 4, ("q",))
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.add_lora(m, 2, 4, ("q",))
    assert lora.lora_spec(m) == dict(rank=2, alpha=4, targets=("q",))


# ----------------------------------------------------------------------------- merged weights for the sampler


def test_merged_copy_samples_the_same_tokens_and_leaves_the_base_alone(qwen2):
    """Guards the sampler's merged copy (the claim of lora.py's docstring): a merge that drops the scaling or
    transposes B A changes the logits by far more than rounding (~1e-6 here); greedy and seeded sampling
    give the same tokens merged or not, their log-probs agree to rounding; the merge never touches the base
    weights (an in-place merge and unmerge drifts the reference: (W + D) - D != W), and a refreshed copy is
    bit-equal to a fresh one."""
    m = wrapped(qwen2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    copy = lora.merged_copy(m)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(copy(x), m(x), **TOL)
        with lora.adapters_off(m):
            assert (copy(x) - m(x)).abs().max() > 1e-2  # the adapters matter at this B
    prompts = [[3, 4, 5, 6, 7], [20, 21], [9]]
    for temperature in (0.0, 1.0):
        a = generate(m, prompts, max_new_tokens=24, n=3, temperature=temperature, seed=0)
        b = generate(copy, prompts, max_new_tokens=24, n=3, temperature=temperature, seed=0)
        assert a.tokens == b.tokens
        for u, v in zip(a.logprobs, b.logprobs):
            torch.testing.assert_close(torch.tensor(u), torch.tensor(v), **TOL)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    randomize_b(m, seed=2)
    fresh = lora.merged_copy(m)
    lora.copy_merged_(copy, m)
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), fresh.parameters()))
    bf16 = lora.merged_copy(m, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    sd = lora.merged_state_dict(m)
    q = m.model.layers[1].self_attn.q_proj
    want = q.weight + (q.lora_B @ q.lora_A) * q.scaling
    torch.testing.assert_close(sd["model.layers.1.self_attn.q_proj.weight"], want, atol=0, rtol=0)


# ----------------------------------------------------------------------------- PEFT's format


def peft_model(path, adapter_dir):
    """transformers' model of `path` with PEFT's loader reading adapter_dir (float32, eval)."""
    import transformers
    from peft import PeftModel

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, adapter_dir).eval()


def test_peft_loads_our_adapters_to_the_same_logits(qwen2, tmp_path):
    """Guards save_adapters' format: a key name PEFT does not expect (it would load nothing and warn), a
    transposed A or B, alpha or r written wrong, or a missing target each make PEFT's logits differ from
    ours. The adapters are trained a few AdamW steps first, so A moves from its init too."""
    pytest.importorskip("peft")
    m = lora.add_lora(load_model(qwen2), 4, 8, ALL, seed=0)
    opt = torch.optim.AdamW(lora.lora_parameters(m), lr=1e-2)
    x = ids()
    for _ in range(3):
        h = m(x[:, :-1], hidden=True)
        (-head_logprobs(m, h, x[:, 1:])[0].mean()).backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path / "adapter"
    lora.save_adapters(m, out, qwen2)
    config = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == 4
    assert config["base_model_name_or_path"] == str(qwen2) and len(config["target_modules"]) == 7
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in load_file(out / lora.ADAPTER_WEIGHTS)
    with torch.no_grad():
        ours = m(x)
        theirs = peft_model(qwen2, out)(x).logits
    with torch.no_grad(), lora.adapters_off(m):
        assert (ours - m(x)).abs().max() > 1e-3  # trained: the comparison below sees the adapters
    torch.testing.assert_close(theirs, ours, **TOL)


def test_our_loader_reads_peft_adapters(qwen2, tmp_path):
    """Guards load_adapters against PEFT's own files: its key names, its config fields and alpha / r scaling
    (PEFT's random init of B, so every adapter matters), on a subset of targets."""
    pytest.importorskip("peft")
    import transformers
    from peft import LoraConfig, get_peft_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32)
    torch.manual_seed(0)
    cfg = LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    pm = get_peft_model(hf, cfg).eval()
    pm.save_pretrained(tmp_path / "peft")
    spec = lora.read_adapter_config(tmp_path / "peft")
    assert (spec["rank"], spec["alpha"], spec["targets"]) == (3, 5, ("q", "v", "down"))
    m = lora.add_lora(load_model(qwen2), spec["rank"], spec["alpha"], spec["targets"])
    lora.load_adapters(m, tmp_path / "peft")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m(x), pm(x).logits, **TOL)


def test_save_load_round_trip_is_bit_exact(qwen2, tmp_path):
    """Guards resume: adapters saved and loaded into a freshly wrapped model (other A, zero B) come back bit
    for bit (a cast through another dtype or a key matched to the wrong layer breaks it), and saving over an
    existing adapter directory replaces it."""
    m = wrapped(qwen2)
    lora.save_adapters(m, tmp_path / "a", qwen2)
    randomize_b(m, seed=3)
    lora.save_adapters(m, tmp_path / "a", qwen2)
    back = lora.load_adapters(lora.add_lora(load_model(qwen2), 4, 8, ALL, seed=7), tmp_path / "a")
    assert all(torch.equal(a, b) for a, b in zip(lora.lora_parameters(m), lora.lora_parameters(back)))
    x = ids()
    with torch.no_grad():
        assert torch.equal(back(x), m(x))


def edit_weights(d, fn):
    t = load_file(d / lora.ADAPTER_WEIGHTS)
    fn(t)
    save_file(t, d / lora.ADAPTER_WEIGHTS)


def edit_config(d, **kw):
    c = json.loads((d / lora.ADAPTER_CONFIG).read_text())
    (d / lora.ADAPTER_CONFIG).write_text(json.dumps(c | kw))


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BROKEN = {  # name -> (how the adapter directory is broken, what the sentence says)
    "missing tensor": (lambda d: edit_weights(d, lambda t: t.pop(KEY)), "lacks 1 adapter tensor"),
    "extra tensor": (lambda d: edit_weights(d, lambda t: t.update(x=torch.zeros(1))), "unexpected tensor 'x'"),
    "wrong shape": (lambda d: edit_weights(d, lambda t: t.update({KEY: torch.zeros(4, 65)})), "has shape"),
    "other rank": (lambda d: edit_config(d, r=8), "r is 8"),
    "other alpha": (lambda d: edit_config(d, lora_alpha=16), "lora_alpha is 16"),
    "other targets": (lambda d: edit_config(d, target_modules=["q_proj"]), "target_modules is"),
    "unknown module": (lambda d: edit_config(d, target_modules=["q_proj", "fc1"]), "must be a list of names"),
    "dora": (lambda d: edit_config(d, use_dora=True), "use_dora"),
    "not lora": (lambda d: edit_config(d, peft_type="IA3"), "only LORA"),
    "truncated": (lambda d: (d / lora.ADAPTER_WEIGHTS).write_bytes(b"\x08"), "unreadable"),
    "no config": (lambda d: (d / lora.ADAPTER_CONFIG).unlink(), "missing"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_adapter_is_one_sentence_naming_the_file(case, qwen2, tmp_path):
    """Guards strict loading: a missing, extra or mis-shaped tensor, a config for other adapters or with a
    PEFT feature not implemented here must fail in one sentence naming the file, never load in part."""
    m = wrapped(qwen2)
    d = tmp_path / "a"
    lora.save_adapters(m, d, qwen2)
    breaks, says = BROKEN[case]
    breaks(d)
    before = [p.clone() for p in lora.lora_parameters(m)]
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        lora.load_adapters(m, d)
    msg = str(e.value)
    assert says in msg and str(d) in msg and len(msg.splitlines()) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, lora.lora_parameters(m)))


# ----------------------------------------------------------------------------- the merged checkpoint


def test_merged_checkpoint_loads_in_transformers(qwen2, tmp_path):
    """Guards merge_checkpoint and `lora.py --merge`: transformers must load the merged directory to the
    adapter model's logits, our loader to the merged copy's bit for bit (float32 base, so nothing is
    rounded on the way), with no adapter tensor left in the file; a missing --out is one sentence; and
    hf.save_model refuses the wrapped model itself (transformers would load it dropping the adapters)."""
    m = wrapped(qwen2)
    lora.save_adapters(m, tmp_path / "a", qwen2)
    lora.main(lora.MergeConfig(merge=str(tmp_path / "a"), out=str(tmp_path / "merged")))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "merged", x), m(x), **TOL)
        assert torch.equal(load_model(tmp_path / "merged")(x), lora.merged_copy(m)(x))
    assert not any("lora" in k for k in load_file(tmp_path / "merged" / "model.safetensors"))
    with pytest.raises(UserExit, match="--out DIR"):
        parse_config(lora.MergeConfig, ["--merge", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="lora_A' is no tensor of a qwen2 checkpoint"):
        save_model(m, tmp_path / "wrapped")
    assert not (tmp_path / "wrapped").exists()


# ----------------------------------------------------------------------------- distributed

DIST_SCRIPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import lora, model as M
from hf import load_model, save_model
from logprobs import head_logprobs
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
rank, mode = dist.get_rank(), sys.argv[1]
m = lora.add_lora(load_model({path!r}), 4, 8, lora.DECODER, seed=0)
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for p in lora.lora_parameters(m):
        p.copy_(0.05 * torch.randn(p.shape, generator=g))
x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
if mode == "fsdp":
    for layer in m.model.layers:
        fully_shard(layer)
    run = fully_shard(m)
else:
    run = torch.nn.parallel.DistributedDataParallel(m)
rows = x[rank * 2 : rank * 2 + 2]
with torch.no_grad(), lora.adapters_off(m):
    ref = m(rows)
lp = head_logprobs(m, run(rows[:, :-1], hidden=True), rows[:, 1:])[0]
(lp.sum() / 2).backward()
grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in lora.lora_parameters(m)]
merged = lora.merged_state_dict(m)
lora.save_adapters(m, {out!r} + "/" + mode, {path!r})
if rank == 0:
    torch.save(dict(grads=grads, merged=merged, ref=ref), {out!r} + "/" + mode + ".pt")
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ddp_and_fsdp_wrap_the_adapters(mode, qwen2, tmp_path):
    """Guards LoRA under torchrun (2 CPU ranks, gloo): DDP over a model with a frozen base and FSDP2's
    fully_shard of layers holding frozen and trainable parameters must give the adapters the one-process
    gradient (mean over ranks), adapters_off must work on the wrapped model, and the merged weights and
    saved adapters must be gathered whole from the shards."""
    script = tmp_path / "run.py"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(textwrap.dedent(DIST_SCRIPT).format(root=root, path=str(qwen2), out=str(tmp_path)))
    port = {"ddp": "29611", "fsdp": "29612"}[mode]  # test_fsdp.py and test_train.py use 29533-29542
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", port]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*cmd, str(script), mode], check=True, timeout=300, env=env, capture_output=True)
    got = torch.load(tmp_path / f"{mode}.pt")
    m = wrapped(qwen2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora.lora_parameters(m):
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    x = ids(4, 16)
    lp = head_logprobs(m, m(x[:, :-1], hidden=True), x[:, 1:])[0]
    (lp.sum() / 4).backward()
    for a, p in zip(got["grads"], lora.lora_parameters(m)):
        torch.testing.assert_close(a, p.grad, **TOL)
    for k, v in lora.merged_state_dict(m).items():
        torch.testing.assert_close(got["merged"][k], v, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(got["ref"], load_model(qwen2)(x[:2]), atol=0, rtol=0)
    back = lora.load_adapters(lora.add_lora(load_model(qwen2), 4, 8, ALL), tmp_path / mode)
    assert all(torch.equal(a, b) for a, b in zip(lora.lora_parameters(back), lora.lora_parameters(m)))


# ----------------------------------------------------------------------------- the trainer with --lora-rank


def _lora_run(out: str, **flags) -> dict:
    """A short LoRA run of the bundled model through train.main (KL penalty on: its reference is the base)."""
    import train
    from config import TrainConfig
    from helpers import BUNDLED

    base = dict(model=BUNDLED, out=out, algo="grpo", max_steps=2, prompts_per_step=4, thoughts=4, eval_every=0)
    base |= dict(eval_examples=4, eval_samples=1, samples_every=0, max_thought_tokens=40, lora_rank=4, beta=0.01)
    return train.main(TrainConfig(**{**base, "lr": 3e-3, **flags}))


@pytest.mark.slow
def test_a_lora_run_trains_the_adapters_only_resumes_bit_for_bit_and_merges(tmp_path, monkeypatch):
    """Guards against --lora-rank training the base (or loading a second copy of it as the KL reference), writing
    full weights into its checkpoints, a resume that does not reproduce the uninterrupted adapters bit for bit, and
    --merge writing something other than the base with the trained adapters merged in: one model is loaded for the
    whole run, each checkpoint holds the PEFT adapter files and no model.safetensors, the adapters moved, the
    reference log-probs are the base's (adapters off), and OUT/merged equals lora.merged_copy of the final adapters."""
    import hf
    import run as run_py  # setup() loads the models
    import train
    from helpers import BUNDLED

    loads = []
    real_load = run_py.load_model
    monkeypatch.setattr(run_py, "load_model", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    a = str(tmp_path / "a")
    _lora_run(a, save_every=1, merge=True)
    assert len(loads) == 1  # the policy; the KL reference is the same weights with the adapters off
    final = os.path.join(a, "final")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(final))
    assert not os.path.exists(os.path.join(final, "model.safetensors"))
    adapters = load_file(os.path.join(final, "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())  # trained
    rows = [json.loads(x) for x in open(os.path.join(a, "metrics.jsonl")) if '"loss"' in x]
    assert all(r["kl"] is not None and r["kl"] >= 0 for r in rows)

    from config import TrainConfig, resume_config

    c = str(tmp_path / "c")
    train.main(resume_config(TrainConfig(resume=os.path.join(a, "step-1"), out=c), {"resume", "out"}))
    resumed = load_file(os.path.join(c, "final", "adapter_model.safetensors"))
    assert resumed.keys() == adapters.keys() and all(torch.equal(resumed[k], adapters[k]) for k in adapters)

    policy, _ = lora.load_adapted(final)
    base = hf.load_model(BUNDLED)
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = hf.load_model(os.path.join(a, "merged"))(ids)
        assert torch.equal(merged, lora.merged_copy(policy)(ids)) and not torch.equal(merged, base(ids))
        with lora.adapters_off(policy):
            assert torch.equal(policy(ids), base(ids))


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(merge=True), "--merge merges LoRA adapters: it needs --lora-rank R"),
        (dict(lora_rank=4, lora_targets="q,x"), "--lora-targets must be a comma-separated subset of"),
        (dict(lora_rank=-1), "--lora-rank must be >= 0"),
        (dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha must be > 0"),
    ],
)
def test_impossible_lora_flags_are_one_sentence(flags, message):
    """Guards against --merge without adapters, an unknown target layer, or a negative rank or zero alpha being
    accepted (and failing mid-run, or training nothing) instead of refused in one sentence naming the flag."""
    from config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(**flags)


def test_merge_never_replaces_a_run_the_adapters_or_an_unrelated_directory(qwen2, tmp_path):
    """Guards against `lora.py --merge` silently deleting whatever sat at --out (hf.save_model replaces it whole):
    an unrelated non-empty directory or a file, the training run itself (--merge RUN/final --out RUN deleted
    metrics.jsonl and every checkpoint), another run, the adapter directory being merged or a parent of it. A run
    or the adapters are refused even with --overwrite; --overwrite replaces an unrelated directory; an empty or
    absent --out is written."""
    from cli import UserError

    run = tmp_path / "run"  # a LoRA run: its logs, a step checkpoint and final/ = the adapters merged
    lora.save_adapters(wrapped(qwen2), run / "final", qwen2)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "step-1").mkdir()
    (run / "step-1" / "trainer_state.pt").write_bytes(b"state")
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("keep me")
    (tmp_path / "runs").mkdir()
    shutil.copytree(other, tmp_path / "runs" / "deep" / "other-run")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    adapters = str(run / "final")
    for out, overwrite, says in [
        (tmp_path / "unrelated", False, f"--out {tmp_path / 'unrelated'} already holds files (notes.txt); choose"),
        (tmp_path / "a-file", True, f"--out {tmp_path / 'a-file'} is a file, not a directory; choose another --out"),
        (run, True, f"--out {run} holds the adapter directory (--merge) {adapters}; writing there would delete it"),
        (run / "final", True, f"--out {adapters} is the adapter directory (--merge) itself; writing there would"),
        (tmp_path, True, f"--out {tmp_path} holds the adapter directory (--merge) {adapters}; writing there"),
        (other, True, f"--out {other} is a training run; writing there would delete it: choose another --out"),
        (tmp_path / "runs", True, f"--out {tmp_path / 'runs'} holds a training run ({tmp_path}/runs/deep/other-run)"),
    ]:
        with pytest.raises(UserError) as e:
            lora.main(lora.MergeConfig(merge=adapters, out=str(out), overwrite=overwrite))
        assert str(e.value).startswith(says), str(e.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing deleted or changed
    lora.main(lora.MergeConfig(merge=adapters, out=str(tmp_path / "unrelated"), overwrite=True))
    assert not (tmp_path / "unrelated" / "notes.txt").exists()
    (tmp_path / "empty").mkdir()
    for out in ("empty", "absent"):
        lora.main(lora.MergeConfig(merge=adapters, out=str(tmp_path / out)))
    for out in ("unrelated", "empty", "absent"):
        load_model(tmp_path / out)
