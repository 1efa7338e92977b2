"""model.py and hf.py: logits parity with transformers for every family, the cache protocol, checkpoint
load/save (strict errors, shards, both config layouts, atomic save, the checkpoint's dtype kept).
The log-prob functions are tested in test_logprobs.py."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import model as M
from helpers import CatCache, bottom_right_causal, hf_logits, make_hf_model
from hf import config_from_hf, config_to_hf, load_model, save_model

TOL = dict(atol=1e-4, rtol=1e-4)
# (family, tied, extra config): GQA, MQA, tied and untied heads, Qwen3's head_dim != hidden / heads
VARIANTS = {
    "llama-gqa-untied": ("llama", False, {}),
    "llama-mqa-tied": ("llama", True, dict(num_key_value_heads=1)),
    "qwen2-gqa-tied": ("qwen2", True, {}),
    "qwen2-mha-untied": ("qwen2", False, dict(num_key_value_heads=4)),
    "qwen3-gqa-tied": ("qwen3", True, {}),
    "qwen3-mqa-untied": ("qwen3", False, dict(num_key_value_heads=1, head_dim=24)),
}


def ids(B: int = 2, T: int = 50, V: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant, hf_checkpoint):
    """Guards the architecture itself: a dropped q/k/v bias, interleaved instead of split-halves
    RoPE, missing llama3 frequency scaling, missing Qwen3 q/k norm, head_dim derived from
    hidden/heads, a wrong GQA head mapping or an untied/tied head mix-up all change the logits of
    a fully randomised model far beyond 1e-4."""
    family, tied, kw = VARIANTS[variant]
    path = hf_checkpoint(family, tied, **kw)
    x = ids()
    ours = load_model(path)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf_logits(path, x), **TOL)


def test_published_config_layout(tmp_path):
    """Guards config parsing of the layout every Hub checkpoint uses (top-level rope_theta and a
    rope_scaling dict whose type key is the old "type"): reading only transformers-5's
    rope_parameters would silently fall back to theta 10000 and no scaling."""
    hf = make_hf_model("llama", False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_model(tmp_path)
    assert ours.config.rope_theta == 500000.0 and ours.config.rope_scaling["rope_type"] == "llama3"
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, **TOL)


def test_sharded_checkpoint(hf_checkpoint):
    """Guards loading many *.safetensors through model.safetensors.index.json (every real
    checkpoint above ~1B parameters is sharded): a loader reading only one file misses tensors."""
    path = hf_checkpoint("qwen2", False, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(load_model(path)(x), hf_logits(path, x), **TOL)


def test_bf16_weights_and_dtype(tmp_path):
    """Guards dtype handling: a bf16 checkpoint must load into float32 as the exact upcast values,
    and load_model(dtype=bf16) must give bf16 parameters whose log-probs stay near float32's."""
    hf = make_hf_model("qwen3", True)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    m32, m16 = load_model(tmp_path), load_model(tmp_path, dtype=torch.bfloat16)
    for (name, p32), (_, p16) in zip(m32.named_parameters(), m16.named_parameters()):
        assert p32.dtype == torch.float32 and p16.dtype == torch.bfloat16, name
        assert torch.equal(p32, p16.float()), name
    x = ids()
    with torch.no_grad():
        lp32 = torch.log_softmax(m32(x).float(), -1)
        lp16 = torch.log_softmax(m16(x).float(), -1)
    assert (lp32 - lp16).abs().mean() < 2e-2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_logits_bitwise_equal_transformers(family, hf_checkpoint):
    """Guards the bf16 rounding order, invisible in float32: RMSNorm must cast back to bf16 BEFORE
    multiplying by its weight and RoPE's cos/sin must be cast to bf16, as in transformers.
    Both run the same op sequence on the same CPU kernels, so the logits are bitwise equal
    (measured); scaling in float32 first changes them by ~0.02."""
    import transformers

    path = hf_checkpoint(family, True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = ids()
    with torch.no_grad():
        assert torch.equal(load_model(path, dtype=torch.bfloat16)(x), hf(x).logits)


def test_load_shares_tied_parameter_and_leaves_nothing_on_meta(hf_checkpoint, monkeypatch):
    """Guards meta-device loading: the model must be built on the meta device (no random init of
    a second full copy), a tied head must BE the embedding Parameter after assignment (else
    training updates only one of them), and no parameter may stay on the meta device."""
    path = hf_checkpoint("qwen2", True)
    init_devices = []
    normal_ = torch.nn.init.normal_

    def spy(tensor, *a, **k):
        init_devices.append(tensor.device.type)
        return normal_(tensor, *a, **k)

    monkeypatch.setattr(torch.nn.init, "normal_", spy)
    m = load_model(path)
    assert init_devices and set(init_devices) == {"meta"}
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in make_hf_model("qwen2", True).parameters())


# ----------------------------------------------------------------------------- cache protocol


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen2-gqa-tied", "qwen3-mqa-untied"])
def test_cache_prefill_chunk_decode_equals_full_forward(variant, hf_checkpoint):
    """Guards the cache path: prefill, then a multi-token chunk on a non-empty cache (needs the
    bottom-right mask, is_causal would be wrong), then token-by-token decode (the pack-GQA path)
    must reproduce the full forward's logits; wrong positions or head grouping break it."""
    family, tied, kw = VARIANTS[variant]
    m = load_model(hf_checkpoint(family, tied, **kw))
    x = ids(T=40)
    B, T = x.shape
    with torch.no_grad():
        full = m(x)
        cache, parts = CatCache(), []
        for start, end in [(0, 12), (12, 25)] + [(t, t + 1) for t in range(25, T)]:
            pos = torch.arange(start, end).expand(B, -1)
            parts.append(m(x[:, start:end], pos, cache, bottom_right_causal(B, end - start, end)))
        assert cache.length == T
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_left_padding_with_positions_and_mask(hf_checkpoint):
    """Guards explicit positions: a left-padded row with positions cumsum(valid)-1 and a padding
    mask must give the same logits as the unpadded sequence alone (RoPE must use the given
    positions, not the slot index)."""
    m = load_model(hf_checkpoint("llama", False))
    x = ids(B=1, T=20)
    pad = 7
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], dim=1)
    valid = torch.arange(pad + 20)[None] >= pad
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    mask = bottom_right_causal(1, pad + 20, pad + 20) & valid[:, None, None, :]
    with torch.no_grad():
        torch.testing.assert_close(m(padded, pos, attn_mask=mask)[:, pad:], m(x), atol=1e-5, rtol=1e-5)


def test_logits_to_keep_positions_and_cache_without_mask(hf_checkpoint):
    """Guards logits_to_keep (only the last N rows, same values), (T,) positions broadcasting over
    the batch, and the contract that a cache without an explicit mask is refused (is_causal on a
    non-empty cache is silently wrong)."""
    m = load_model(hf_checkpoint("qwen3", True))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m(x, logits_to_keep=3), m(x)[:, -3:], atol=1e-6, rtol=1e-6)
        assert torch.equal(m(x, positions=torch.arange(x.shape[1])), m(x))  # (T,) positions broadcast
        with pytest.raises(ValueError, match="attn_mask"):
            m(x, cache=CatCache())


def test_gradient_checkpointing_same_gradients(hf_checkpoint):
    """Guards activation checkpointing: recomputing layers in backward must give the same loss
    gradients as the plain forward (and must be active only in training with grad enabled)."""
    m = load_model(hf_checkpoint("qwen2", True)).train()
    x = ids()

    def grads() -> list[torch.Tensor]:
        m.zero_grad()
        F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        return [p.grad.clone() for p in m.parameters()]

    plain = grads()
    m.gradient_checkpointing = True
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_swiglu_saves_two_activations_and_changes_no_bit(autocast):
    """Guards the MLP's hand-written backward (_SwiGLUDown): the output and every gradient equal
    plain autograd's bit for bit, in float32 and under bf16 autocast, and what it saves for backward
    is gate and up only (plus the weight it already holds): saving silu(gate) or the product again,
    as autograd does, doubles the largest activations of a training step."""
    cfg = M.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, model_type="llama")  # fmt: skip
    torch.manual_seed(0)
    mlp = M.MLP(cfg)
    x = torch.randn(3, 7, 32, requires_grad=True)
    w_out = torch.randn(3, 7, 32)

    def run(fn):
        mlp.zero_grad()
        x.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = fn()
        (y.float() * w_out).sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in mlp.parameters()], saved

    plain, saved_plain = run(lambda: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    ours, saved = run(lambda: mlp(x))
    for a, b in zip(plain, ours):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # (3, 7, intermediate) activations saved, each storage once (a linear saves its input as a 2-D view)
    wide = lambda ts: len({t.untyped_storage().data_ptr() for t in ts if t.numel() == 3 * 7 * 88})  # noqa: E731
    assert wide(saved) == 2 and wide(saved_plain) == 4
    with torch.no_grad():  # sampling: the plain path, nothing saved
        assert torch.equal(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


# ----------------------------------------------------------------------------- save / round trip


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen2-gqa-tied", "qwen3-mqa-untied"])
def test_save_model_round_trip(variant, hf_checkpoint, tmp_path):
    """Guards save_model: transformers must load our config.json + model.safetensors to the same
    logits (a missing bias flag, head_dim or rope_scaling in config.json breaks this), and our own
    loader must get back identical tensors with the tied head still tied."""
    family, tied, kw = VARIANTS[variant]
    m = load_model(hf_checkpoint(family, tied, **kw))
    out = tmp_path / "saved"
    save_model(m, out)
    x = ids()
    with torch.no_grad():
        ref = m(x)
        torch.testing.assert_close(hf_logits(out, x), ref, **TOL)
        back = load_model(out)
        assert torch.equal(back(x), ref)
    assert back.config == m.config
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) == (not tied)


def test_save_model_atomic_and_copies_tokenizer(hf_checkpoint, tmp_path, monkeypatch):
    """Guards atomic saving: overwriting a checkpoint replaces it completely, a save that fails
    midway leaves the previous checkpoint intact and no temporary directory behind; tokenizer
    files are copied and generation_config.json carries the eos ids."""
    m = load_model(hf_checkpoint("qwen2", True))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    (tok_dir / "tokenizer_config.json").write_text('{"pad_token": "<|endoftext|>"}')
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    save_model(m, out, tokenizer_dir=tok_dir)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("hf.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(m, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "qwen2-tied", "tok"]


def test_save_model_writes_the_checkpoint_dtype(tmp_path):
    """Guards "checkpoints are saved in the dtype they were loaded in": a bf16 checkpoint trained
    with float32 weights must save as bf16 by default (not twice its size in float32), with
    torch_dtype in config.json saying so and transformers loading it to the same logits; an
    explicit dtype must win; the dtype must come from config.json's torch_dtype or dtype key, else
    from the stored tensors; a model built from scratch saves float32."""
    import transformers

    src = tmp_path / "bf16"
    make_hf_model("qwen2", True).to(torch.bfloat16).save_pretrained(src)
    m = load_model(src)
    assert m.config.torch_dtype == "bfloat16" and m.lm_head.weight.dtype == torch.float32
    save_model(m, tmp_path / "default")
    save_model(m, tmp_path / "fp32", dtype=torch.float32)
    for name, dtype in [("default", torch.bfloat16), ("fp32", torch.float32)]:
        hf_config = json.loads((tmp_path / name / "config.json").read_text())
        assert hf_config["torch_dtype"] == str(dtype).removeprefix("torch.")
        assert {t.dtype for t in load_file(tmp_path / name / "model.safetensors").values()} == {dtype}
        assert transformers.AutoConfig.from_pretrained(tmp_path / name).dtype == dtype
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("default", "fp32")}
    assert 1.9 < size["fp32"] / size["default"] < 2.1
    x = ids()
    with torch.no_grad():  # the values are bf16-exact, so every copy gives the same logits
        torch.testing.assert_close(hf_logits(tmp_path / "default", x), m(x), **TOL)
    assert load_model(tmp_path / "fp32").config.torch_dtype == "float32"
    assert load_model(tmp_path / "default").config == m.config

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(cfg))
    assert load_model(src).config.torch_dtype == "bfloat16"  # from the safetensors
    scratch = M.Transformer(M.ModelConfig(32, 16, 32, 1, 2, 1, 8, attention_bias=True))  # dtype not given
    save_model(scratch, tmp_path / "scratch")
    assert load_file(tmp_path / "scratch" / "model.safetensors")["model.norm.weight"].dtype == torch.float32
    save_model(scratch, tmp_path / "scratch16", dtype=torch.bfloat16)
    assert load_model(tmp_path / "scratch16").config.torch_dtype == "bfloat16"


# ----------------------------------------------------------------------------- strict errors


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))


def _edit_tensors(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


BAD = {
    "missing dir": (lambda p: p.rename(p.with_name("gone")), FileNotFoundError, "model directory not found"),
    "missing config": (lambda p: (p / "config.json").unlink(), FileNotFoundError, r"config\.json: missing"),
    "unknown model_type": (
        lambda p: _edit_config(p, model_type="gpt2"),
        ValueError,
        "model_type 'gpt2' is not supported",
    ),
    "sliding window": (lambda p: _edit_config(p, use_sliding_window=True), ValueError, "sliding-window"),
    "hidden_act": (lambda p: _edit_config(p, hidden_act="gelu"), ValueError, "hidden_act 'gelu'"),
    "yarn rope": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
        ValueError,
        "rope type 'yarn' is not supported",
    ),
    "missing tensor": (
        lambda p: _edit_tensors(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        ValueError,
        r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight",
    ),
    "unexpected tensor": (
        lambda p: _edit_tensors(p, lambda t: t.update({"model.extra.weight": torch.zeros(2)})),
        ValueError,
        r"model\.safetensors: unexpected tensor 'model\.extra\.weight'",
    ),
    "wrong shape": (
        lambda p: _edit_tensors(p, lambda t: t.update({"model.norm.weight": torch.ones(65)})),
        ValueError,
        r"'model\.norm\.weight' has shape \(65,\), config\.json implies \(64,\)",
    ),
    "truncated": (
        lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-100]),
        ValueError,
        r"model\.safetensors: unreadable safetensors file, truncated",
    ),
    "missing shard": (
        lambda p: (p / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
        ),
        FileNotFoundError,
        r"index\.json: names shard 'model-00002-of-00002\.safetensors', which is missing",
    ),
    "llama3 keys": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}),
        ValueError,
        r"config\.json: rope_scaling .* only 'llama3' scaling with keys",
    ),
    "bad json": (lambda p: (p / "config.json").write_text("{"), ValueError, r"config\.json: not valid JSON"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint_raises_one_clear_error(case, hf_checkpoint):
    """Guards strict loading: every malformed checkpoint must end in one ValueError or
    FileNotFoundError sentence naming the file and the problem, never a silent partial load
    (strict=False) or a deep traceback."""
    corrupt, exc, pattern = BAD[case]
    path = hf_checkpoint("qwen2", True)
    corrupt(path)
    with pytest.raises(exc, match=pattern):
        load_model(path)


def test_model_config_validation():
    """Guards ModelConfig: combinations transformers would build differently (Qwen2 without its
    hard-coded bias, q/k norm outside Qwen3, unsupported RoPE scaling) are refused, and
    to_hf/from_hf round-trips every field."""
    base = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    with pytest.raises(ValueError, match="attention_bias=True"):
        M.ModelConfig(**base, model_type="qwen2")
    with pytest.raises(ValueError, match="qk_norm"):
        M.ModelConfig(**base, model_type="llama", qk_norm=True)
    with pytest.raises(ValueError, match="llama3"):
        M.ModelConfig(**base, model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="torch_dtype 'int8'"):
        M.ModelConfig(**base, model_type="llama", torch_dtype="int8")
    cfg = M.ModelConfig(
        **base,
        model_type="llama",
        torch_dtype="bfloat16",
        rope_theta=5e5,
        tie_word_embeddings=True,
        eos_token_id=[1, 2],
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_config_json_that_is_not_an_object_is_one_sentence(tmp_path):
    """Guards against a config.json holding `[1]` ending in a raw AttributeError with no file named."""
    import shutil

    bundled = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-model")
    shutil.copytree(bundled, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object, got list"):
        load_model(tmp_path / "m")
