"""Qwen3.5/3.6's hybrid (deltanet.py, model.py, hf.py, kvcache.py) against transformers' Qwen3_5ForCausalLM and
Qwen3_5ForConditionalGeneration on tiny random checkpoints with the published [L, L, L, F] layer pattern: logits,
checkpoint layouts, the two forms of the delta rule, the cache (prefill, decode, extend, fork, holes) and sampling."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import deltanet
from helpers import QWEN35_PATTERN, make_hf_model
from hf import config_from_hf, load_model, save_model
from kvcache import decode_step, extend, prefill
from logprobs import token_logprobs
from sampler import generate, sample_tree

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = dict(atol=1e-5, rtol=0)  # the bar: float32 logits to 1e-5, max abs
PROMPTS = [[5, 17, 99, 3, 42], list(range(10, 80)), [7], [int(i) for i in torch.arange(33) * 3 % 120 + 4]]


def save_hf(model, path):
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("qwen3_5", False)


@pytest.fixture(scope="module")
def ours(hf_model, tmp_path_factory):
    return load_model(save_hf(hf_model, tmp_path_factory.mktemp("q35") / "ckpt"))


def ragged(prompts):
    """Left-padded ids, valid, positions and attention mask (B, 1, T, T) of prompts of several lengths."""
    T = max(map(len, prompts))
    ids, valid = torch.zeros(len(prompts), T, dtype=torch.long), torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], valid[i, T - len(p) :] = torch.tensor(p), True
    mask = (valid[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()) | torch.eye(T, dtype=torch.bool)
    return ids, valid, (valid.cumsum(1) - 1).clamp(min=0), mask


# ----------------------------------------------------------------------------- logits and checkpoints


def multimodal_checkpoint(path, tied: bool):
    """A Qwen3_5ForConditionalGeneration checkpoint (the published layout: model.language_model.*, model.visual.*,
    config.json's text_config) whose text model is make_hf_model's, plus an mtp.* tensor as the published files
    carry; returns the path and the text-only reference model."""
    import transformers

    text = make_hf_model("qwen3_5", tied)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.config.hidden_size)
    cfg = transformers.Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision, tie_word_embeddings=tied)
    mm = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in text.named_parameters():
            mm.get_parameter(name.replace("model.", "model.language_model.", 1)).copy_(p)
    mm.save_pretrained(path)
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, path / "mtp.safetensors")
    return path, mm


@pytest.mark.parametrize("layout", ["causal-lm", "causal-lm-tied", "sharded", "multimodal-tied", "multimodal"])
def test_logits_equal_transformers(layout, tmp_path):
    """Guards every part of the hybrid (the delta rule, its convolution and gates, the zero-centred norms, the gated
    attention with partial rotary) and the checkpoint layouts: a causal-LM checkpoint, tied or sharded, and the
    published multimodal one, whose vision tower and MTP head are skipped. Lengths 50 and 130: one chunk, and three
    with a ragged last one."""
    tied = layout.endswith("tied")
    if layout.startswith("multimodal"):
        path, ref = multimodal_checkpoint(tmp_path / "mm", tied)
        with safe_open(path / "model.safetensors", framework="pt") as f:
            prefixes = {k.split(".")[1] for k in f.keys() if k.startswith("model.")}
        assert prefixes == {"language_model", "visual"}
    else:
        ref = make_hf_model("qwen3_5", tied)
        ref.save_pretrained(tmp_path / "c", **({"max_shard_size": "30KB"} if layout == "sharded" else {}))
        path = tmp_path / "c"
    model = load_model(path)
    assert (
        model.config.tie_word_embeddings == tied and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    )
    for T in (50, 130):
        x = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(input_ids=x).logits, **TOL)


def test_ragged_prefill_equals_each_prompt_alone(ours, hf_model):
    """Guards padding in a DeltaNet layer: left padding must not reach any row's state or convolution window, so a
    ragged batch's logits at every real position equal transformers' on that prompt alone (transformers' own padded
    batch is not the reference: its chunks then hold padding, which moves its rounding)."""
    ids, valid, pos, mask = ragged(PROMPTS)
    with torch.no_grad():
        logits = ours(ids, positions=pos, attn_mask=mask, valid=valid)
        for i, p in enumerate(PROMPTS):
            torch.testing.assert_close(logits[i, valid[i]], hf_model(input_ids=torch.tensor([p])).logits[0], **TOL)
        _, last = prefill(ours, PROMPTS)
    torch.testing.assert_close(last, logits[:, -1], **TOL)


def test_recurrent_form_equals_chunked_form():
    """Guards the chunked delta rule (the UT solve, the decay within and across chunks, the ragged tail) against the
    rule's definition, token by token, from a non-zero state: outputs at every position and the final state."""
    g = torch.Generator().manual_seed(0)
    B, H, T, dk, dv = 2, 3, 150, 16, 8
    q, k = (deltanet.l2norm(torch.randn(B, H, T, dk, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g)
    decay, beta = -torch.rand(B, H, T, generator=g), torch.rand(B, H, T, generator=g)
    S = torch.randn(B, H, dk, dv, generator=g)
    out, final = deltanet.chunked_delta_rule(q, k, v, decay, beta, S)
    ref, ref_final = deltanet.recurrent_delta_rule(q, k, v, decay, beta, S)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=0)


def test_recurrent_decode_equals_chunked_forward_at_every_position(ours):
    """Guards the decode step of a DeltaNet layer (the convolution's window shifting by one, the state carried in
    the cache): feeding a sequence one token at a time gives the full forward's logits at every position."""
    x = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        full = ours(x)[0]
        cache, first = prefill(ours, [PROMPTS[1][:1]])
        cache = cache.fork(torch.arange(1), x.shape[1])
        steps = [first[0]] + [
            decode_step(ours, cache, x[:, t], torch.ones(1, dtype=torch.bool))[0] for t in range(1, 70)
        ]
    torch.testing.assert_close(torch.stack(steps), full, **TOL)


def test_save_then_transformers_loads_the_same_logits(ours, tmp_path):
    import transformers

    save_model(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["layer_types"] == QWEN35_PATTERN
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    x = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, ours(x), **TOL)
    assert load_model(tmp_path / "out").config == ours.config


def test_config_json_fields_and_refusals():
    """The published multimodal config.json (text_config, rope_parameters with mrope keys, no layer_types) reads as
    transformers reads it: partial rotary 0.25 by default, every 4th layer full attention, the top-level tie."""
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2)
    text |= dict(num_key_value_heads=1, head_dim=16, model_type="qwen3_5_text", linear_num_value_heads=16)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10]}
    c = config_from_hf({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True})
    assert c.model_type == "qwen3_5" and c.partial_rotary_factor == 0.25 and c.rotary_dim == 4
    assert c.layer_types == tuple(QWEN35_PATTERN * 2) and c.tie_word_embeddings and c.rope_theta == 1e7
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (16, 16, 128)
    with pytest.raises(ValueError, match="config.json: model_type 'qwen3_5' needs a text_config"):
        config_from_hf({"model_type": "qwen3_5"})
    with pytest.raises(ValueError, match="attn_output_gate false is not supported"):
        config_from_hf(text | {"attn_output_gate": False})
    with pytest.raises(ValueError, match="layer_types may only hold"):
        config_from_hf(text | {"layer_types": ["linear_attention"] * 7 + ["mamba"]})
    with pytest.raises(ValueError, match="partial_rotary_factor is not supported for model_type 'qwen3'"):
        config_from_hf(text | {"model_type": "qwen3", "partial_rotary_factor": 0.5})


def test_qwen38_config_reads_as_qwen35():
    """Guards Qwen3.8 (2026-08), which keeps Qwen3.5's architecture: Qwen3.8-27B's published config.json's fields
    (Qwen3_5ForConditionalGeneration, model_type qwen3_5 with a qwen3_5_text text_config, 64 layers [L, L, L, F],
    24/4 heads of 256, DeltaNet 16/48 heads of 128, the dtype at the top level) read as the hybrid it is, in
    bfloat16."""
    text = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408)
    text |= dict(num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256)
    text |= dict(linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128)
    text |= dict(full_attention_interval=4, max_position_embeddings=262144, tie_word_embeddings=False)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10]}
    arch = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "dtype": "bfloat16"}
    c = config_from_hf(arch | {"text_config": text, "tie_word_embeddings": False})
    assert c.model_type == "qwen3_5" and c.torch_dtype == "bfloat16" and c.layer_types == tuple(QWEN35_PATTERN * 16)
    assert (c.hidden_size, c.linear_num_value_heads, c.rotary_dim, c.tie_word_embeddings) == (5120, 48, 64, False)


def edit_checkpoint(path, config=None, tensors=None):
    """Rewrite a saved checkpoint: config(d) edits config.json's dict in place, tensors(sd) model.safetensors'."""
    from safetensors.torch import load_file

    if config is not None:
        d = json.loads((path / "config.json").read_text())
        config(d)
        (path / "config.json").write_text(json.dumps(d))
    if tensors is not None:
        sd = load_file(path / "model.safetensors")
        tensors(sd)
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_stored_head_that_differs_from_the_embedding_is_kept_as_transformers_keeps_it(tmp_path):
    """Guards a dropped head: a multimodal config whose tie_word_embeddings is set only inside text_config, with an
    lm_head.weight stored that differs from the embedding, was tied (the head dropped, logits 2 off). transformers
    ties only a head that is absent or equal, so both its classes run the stored head, and so must we; an equal
    stored head still ties."""
    import transformers

    path, ref = multimodal_checkpoint(tmp_path / "mm", tied=False)
    edit_checkpoint(path, lambda d: (d.pop("tie_word_embeddings"), d["text_config"].update(tie_word_embeddings=True)))
    model = load_model(path)
    assert not model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight
    x = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        for cls in (transformers.Qwen3_5ForConditionalGeneration, transformers.AutoModelForCausalLM):
            theirs = cls.from_pretrained(path, dtype=torch.float32).eval()(input_ids=x).logits
            torch.testing.assert_close(model(x), theirs, **TOL)
        torch.testing.assert_close(model(x), ref(input_ids=x).logits, **TOL)
    save_model(model, tmp_path / "out")  # written untied, with its head
    assert load_model(tmp_path / "out").lm_head.weight.equal(model.lm_head.weight)
    edit_checkpoint(
        path, tensors=lambda sd: sd.update({"lm_head.weight": sd["model.language_model.embed_tokens.weight"].clone()})
    )
    again = load_model(path)
    assert again.config.tie_word_embeddings and again.lm_head.weight is again.model.embed_tokens.weight


def test_a_dtype_stated_only_at_the_top_of_a_multimodal_config_is_read(tmp_path):
    """Guards --save-dtype auto on the published layout: transformers writes a multimodal config's dtype at its top
    level only, and a bf16 checkpoint read as float32 was written back at twice its size."""
    path, _ = multimodal_checkpoint(tmp_path / "mm", tied=True)
    edit_checkpoint(
        path, lambda d: d.update(dtype="bfloat16"), lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items()})
    )
    assert "dtype" not in json.loads((path / "config.json").read_text())["text_config"]
    model = load_model(path)
    assert model.config.torch_dtype == "bfloat16" and model.lm_head.weight.dtype == torch.float32
    save_model(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_quantized_and_moe_checkpoints_are_refused_in_one_sentence(tmp_path):
    """Guards silently wrong weights: FP8 weights loaded without their scales (no quantization_config) or with it,
    the usual FP8 export's weight_scale_inv tensors (which failed as an "unexpected tensor"), and a MoE config
    relabelled qwen3_5_text (which failed on "intermediate_size is missing") each end in one sentence naming what
    is not supported."""
    path, _ = multimodal_checkpoint(tmp_path / "mm", tied=True)
    q = "model.language_model.layers.3.self_attn.q_proj.weight"
    edit_checkpoint(path, tensors=lambda sd: sd.update({q: sd[q].to(torch.float8_e4m3fn)}))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{q}' \(F8_E4M3\) is quantized"):
        load_model(path)
    edit_checkpoint(path, tensors=lambda sd: sd.update({q: sd[q].float(), q + "_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(ValueError, match=r"_scale_inv' \(F32\) is quantized, and quantized checkpoints are not"):
        load_model(path)
    edit_checkpoint(
        path, lambda d: d.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    )
    with pytest.raises(ValueError, match=r"config.json: quantized checkpoints \(fp8\) are not supported"):
        load_model(path)
    text = json.loads((path / "config.json").read_text())["text_config"]
    moe = {k: v for k, v in text.items() if k != "intermediate_size"} | {"num_experts": 8, "moe_intermediate_size": 16}
    with pytest.raises(ValueError, match="num_experts is set, but mixture-of-experts \\(MoE\\) layers are not supp"):
        config_from_hf(moe)


# ----------------------------------------------------------------------------- the cache and sampling


def test_greedy_equals_transformers_generate(ours, hf_model):
    """Guards prefill of a ragged batch, the decode step and the fork of prompt rows: greedy tokens equal
    transformers.generate's, on prompts of lengths 5, 70, 1 and 33 in one batch (transformers left-pads them)."""
    ids, valid, _, _ = ragged(PROMPTS)
    ref = hf_model.generate(
        ids, attention_mask=valid.long(), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, ids.shape[1] :]
    ours_tokens = generate(ours, PROMPTS, max_new_tokens=24, temperature=0.0).tokens
    assert ours_tokens == ref.tolist()


def full_logprobs(model, prompt, completion):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(completion))


def test_sampler_logprobs_equal_a_full_forward(ours):
    g = generate(ours, PROMPTS, max_new_tokens=16, n=2, seed=3, stop_ids=[9])
    for i, (tokens, lp) in enumerate(zip(g.tokens, g.logprobs)):
        torch.testing.assert_close(torch.tensor(lp), full_logprobs(ours, PROMPTS[i // 2], tokens), **TOL)


def test_tree_sampling_equals_answers_from_a_reprefilled_thought(ours):
    """Guards the fork of a recurrent state: each of the M answers starts from a copy of its thought's state (rows
    that ended early pass over the later steps), so the tree's thoughts and answers have the log-probs of a full
    forward of prompt + thought + answer, and its greedy answers are those sampled from the thought re-prefilled."""
    P, K, M = 2, 3, 2
    kw = dict(k=K, m=M, max_thought_tokens=8, max_answer_tokens=6, seed=[1, 2])
    probe = sample_tree(ours, PROMPTS[:P], end_of_thought=[0, 0, 0], **kw)
    marker = probe.thoughts[1][2:4]  # a marker thought 1 emits: it ends early, others are cut off
    tree = sample_tree(ours, PROMPTS[:P], end_of_thought=marker, **kw)
    assert tree.thoughts[1] == probe.thoughts[1][:4]
    assert any(tree.thought_truncated) and not all(tree.thought_truncated)
    for i, th in enumerate(tree.thoughts):
        torch.testing.assert_close(
            torch.tensor(tree.thought_logprobs[i]), full_logprobs(ours, PROMPTS[i // K], th), **TOL
        )
    for a, ans in enumerate(tree.answers):
        full = full_logprobs(ours, PROMPTS[a // (K * M)], tree.thoughts[a // M] + ans)
        torch.testing.assert_close(torch.tensor(tree.answer_logprobs[a]), full[-len(ans) :], **TOL)
    greedy = sample_tree(ours, PROMPTS[:P], end_of_thought=marker, temperature=0.0, **kw)
    for a, ans in enumerate(greedy.answers):
        again = generate(ours, [PROMPTS[a // (K * M)] + greedy.thoughts[a // M]], max_new_tokens=6, temperature=0.0)
        assert ans == again.tokens[0]


def test_extend_after_decode_with_holes_equals_a_fresh_prefill(ours):
    """Guards a tool observation appended after decoding (extend), on rows that skipped steps (holes) and a ragged
    chunk: the chunk's logits equal a fresh forward of each row's real tokens."""
    with torch.no_grad():
        cache, _ = prefill(ours, [PROMPTS[0], PROMPTS[3]])
        cache = cache.fork(torch.arange(2), cache.length + 12)
        real = [list(PROMPTS[0]), list(PROMPTS[3])]
        for t, a in enumerate([[True, True], [True, False], [False, False], [True, True]]):
            tok = torch.tensor([30 + t, 40 + t])
            decode_step(ours, cache, tok, torch.tensor(a))
            real = [r + [tok[i].item()] if a[i] else r for i, r in enumerate(real)]
        forked = cache.fork(torch.tensor([1, 0, 1]), cache.length + 4)
        chunk, valid = torch.tensor([[0, 50, 51, 52]] * 3), torch.tensor([[False, True, True, True]] * 3)
        valid[1, 0], chunk[1, 0] = True, 49
        logits = extend(ours, forked, chunk, valid, logits_to_keep=3)
        for row, src in enumerate([1, 0, 1]):
            ref = ours(torch.tensor([real[src] + chunk[row][valid[row]].tolist()]))[0, -3:]
            torch.testing.assert_close(logits[row], ref, **TOL)


def text_marker(marker_token: int):
    from stop_text import StopText

    return StopText("m", [marker_token], lambda ids: "".join("m" if i == marker_token else "x" for i in ids), 128)


@pytest.mark.parametrize("path", ["static", "captured", "late-sync"])
def test_static_and_captured_decode_sample_what_eager_does(ours, monkeypatch, path):
    """Guards the static state buffers (graphs.StaticDecode adopts the states with the keys, in power-of-two rows)
    and the capture's warm-up, which must feed no row (a state, unlike a key slot, cannot be written twice): with a
    stand-in for CUDA graphs on CPU, a tree with a text marker samples the eager path's tokens. And the GPU's
    schedule (the text checked every SYNC_EVERY steps) must not feed a hybrid's row past its marker."""
    import graphs
    import sampler

    probe = sample_tree(ours, PROMPTS[:2], k=2, m=2, max_thought_tokens=12, max_answer_tokens=6, seed=[1, 2])
    args = dict(k=3, m=2, max_thought_tokens=12, max_answer_tokens=8, seed=[1, 2], stop_ids=[probe.answers[0][1]])
    args["end_of_thought"] = text_marker(probe.answers[0][3])
    ref = sample_tree(ours, PROMPTS[:2], **args)
    assert 0 < sum(ref.thought_truncated) < 6
    static = graphs.StaticDecode(capture=path == "captured")
    if path == "captured":
        monkeypatch.setattr(graphs, "warm_up", lambda fn: fn())
        monkeypatch.setattr(graphs, "record", lambda fn, pool: fn)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    if path == "late-sync":
        monkeypatch.setattr(sampler, "host_sync_every", lambda device: sampler.SYNC_EVERY)
        static = None
    out = sample_tree(ours, PROMPTS[:2], static_step=static, **args)
    assert out.thoughts == ref.thoughts and out.answers == ref.answers and out.answer_finish == ref.answer_finish
    for a, b in zip(out.answer_logprobs, ref.answer_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)
    if path == "captured":
        assert static.graphs and static.ssm is not None and static.ssm.shape[1] == len(static.tok)


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def hybrid_run_model(tmp_path_factory):
    """A tiny tied Qwen3.5 checkpoint with the bundled tiny model's tokenizer (vocabulary 28)."""
    from helpers import make_hybrid_run_checkpoint

    return make_hybrid_run_checkpoint(tmp_path_factory.mktemp("hybrid"))


def test_grpo_ma_on_a_hybrid_trains_and_resumes_bit_for_bit(hybrid_run_model, tmp_path):
    """Guards the whole loop on a hybrid: tree sampling, the packed rows' tree_hidden (shared prompts: each trunk
    from its prompt's state, each answer from its trunk's), the update and the checkpoint. Rewards flipped at
    random give the advantages a signal; the run continued from step 2 equals the uninterrupted one, bit for bit."""
    import train
    from helpers import SMALL_RUN
    from train import TrainConfig

    kw = SMALL_RUN | dict(model=hybrid_run_model, algo="grpo_ma", answers=2, mu=2, max_thought_tokens=40, max_steps=4)
    kw |= dict(reward_noise="0.3,0")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train.main(TrainConfig(**kw, out=a, save_every=2))
    train.main(TrainConfig(**kw, out=b, resume=f"{a}/step-2"))
    start, wa, wb = (load_model(p).state_dict() for p in (hybrid_run_model, f"{a}/final", f"{b}/final"))
    assert any(not torch.equal(start[k], wa[k]) for k in wa)  # the steps moved the weights
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_tool_rollouts_on_a_hybrid_train_and_resume_bit_for_bit(hybrid_run_model, tmp_path, monkeypatch):
    """Guards --tools on a hybrid through train.main: multi-turn rollouts (each observation appended to a row's
    DeltaNet states by one extend, the other rows held), their packed rows, the update, and a resume from step 2
    that ends where the uninterrupted run does, bit for bit; the calls are counted."""
    import json

    import train
    from helpers import SMALL_RUN, ScriptedEnv
    from methods import tools
    from train import TrainConfig

    monkeypatch.setattr(tools, "make_env", lambda cfg, tokenizer: ScriptedEnv("1", "=7"))  # "1": a bundled char
    kw = SMALL_RUN | dict(model=hybrid_run_model, algo="grpo", tools="python", max_thought_tokens=30, max_steps=3)
    kw |= dict(reward_noise="0.3,0", max_tool_calls=2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train.main(TrainConfig(**kw, out=a, save_every=2))
    train.main(TrainConfig(**kw, out=b, resume=f"{a}/step-2"))
    rows = [json.loads(line) for line in open(f"{a}/metrics.jsonl") if '"tool/calls"' in line]
    assert len(rows) == 3 and all(r["tool/calls"] > 0 for r in rows)
    start, wa, wb = (load_model(p).state_dict() for p in (hybrid_run_model, f"{a}/final", f"{b}/final"))
    assert any(not torch.equal(start[k], wa[k]) for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_gradient_checkpointing_and_eval_on_a_hybrid(hybrid_run_model, tmp_path):
    """Guards the rest of the trainer on a hybrid: a run with --gradient-checkpointing (each Block recomputed in
    backward, its DeltaNet state included) ends at the weights of the run without it, bit for bit; eval.py scores
    the result, greedy and sampled, with the hybrid's cache."""
    import train
    from eval import EvalConfig
    from eval import main as evaluate
    from helpers import SMALL_RUN
    from train import TrainConfig

    kw = SMALL_RUN | dict(model=hybrid_run_model, algo="grpo", reward_noise="0.3,0", max_thought_tokens=20)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train.main(TrainConfig(**kw, out=a))
    train.main(TrainConfig(**kw, out=b, gradient_checkpointing=True))
    wa, wb = (load_model(f"{p}/final").state_dict() for p in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    res = evaluate(EvalConfig(model=f"{a}/final", examples=3, n=2, max_new_tokens=12))
    assert 0.0 <= res["greedy_accuracy"] <= 1.0 and "mean@2" in res


def test_lora_on_every_projection_loads_in_peft_equal_to_the_merged_model(tmp_path):
    """Guards LoRA on a hybrid: adapters on the gated attention's and the DeltaNet's projections (in_proj_qkv, z, b,
    a, out_proj) and the MLPs, trained a few steps, load in PEFT to our logits, and merge into a checkpoint that
    transformers loads to the same logits; a DeltaNet target on a model without DeltaNet layers is refused."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel

    import lora
    from helpers import make_hf_checkpoint
    from logprobs import head_logprobs

    path = make_hf_checkpoint(tmp_path, "qwen3_5")
    targets = lora.parse_targets("q,k,v,o,qkv,z,b,a,out,gate,up,down")
    m = lora.add_lora(load_model(path), 4, 8, targets, seed=0)
    assert sum(p.numel() for p in lora.lora_parameters(m)) == lora.adapter_size(m.config, 4, targets)
    opt = torch.optim.AdamW(lora.lora_parameters(m), lr=1e-2)
    x = torch.tensor([PROMPTS[1]])
    for _ in range(3):
        (-head_logprobs(m, m(x[:, :-1], hidden=True), x[:, 1:])[0].mean()).backward()
        opt.step()
        opt.zero_grad()
    lora.save_adapters(m, tmp_path / "adapter", path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    save_model(m, tmp_path / "merged", state_dict=lora.merged_state_dict(m))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = m(x)
        with lora.adapters_off(m):
            assert (ours - m(x)).abs().max() > 1e-3  # trained: the comparisons see the adapters
        torch.testing.assert_close(theirs(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"target 'qkv' \(in_proj_qkv\) is in no layer of this model"):
        lora.add_lora(load_model(make_hf_checkpoint(tmp_path, "qwen3")), 4, 8, ("q", "qkv"))


def test_adapters_for_the_multimodal_layout_attach_in_peft_on_both_classes_and_load_back(tmp_path):
    """Guards an adapter that silently does nothing: PEFT matches an adapter's keys to the module names of the class
    it loads the base as, and only warns when they differ (model.layers.N vs model.language_model.layers.N), then
    runs the base. Adapters for the published multimodal checkpoint are written in its class's layout: PEFT attaches
    them to Qwen3_5ForConditionalGeneration as they are, and to AutoModelForCausalLM with the key_mapping
    docs/real-models.md gives, with our logits; load_adapters reads them, and PEFT's own from that class, back."""
    pytest.importorskip("peft")
    import warnings

    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    import lora

    path, _ = multimodal_checkpoint(tmp_path / "mm", tied=True)
    targets = lora.parse_targets("q,k,v,o,qkv,z,b,a,out,gate,up,down")
    m = lora.add_lora(load_model(path), 4, 8, targets, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in lora.lora_parameters(m)[1::2]:
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    lora.save_adapters(m, tmp_path / "adapter", path)
    x = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ours = m(x)
        with lora.adapters_off(m):
            assert (ours - m(x)).abs().max() > 0.1  # the adapters' effect, which a silent miss would drop
    mapping = {r"^model\.language_model\.": "model."}
    for cls, key_mapping in (
        (transformers.Qwen3_5ForConditionalGeneration, None),
        (transformers.AutoModelForCausalLM, mapping),
    ):
        hf = cls.from_pretrained(path, dtype=torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            theirs = PeftModel.from_pretrained(hf, tmp_path / "adapter", key_mapping=key_mapping).eval()
        assert not [w for w in caught if "missing adapter keys" in str(w.message)]
        with torch.no_grad():
            torch.testing.assert_close(theirs(input_ids=x).logits, ours, **TOL)
    back = lora.load_adapters(lora.add_lora(load_model(path), 4, 8, targets, seed=1), tmp_path / "adapter")
    assert all(torch.equal(a, b) for a, b in zip(lora.lora_parameters(back), lora.lora_parameters(m)))
    torch.manual_seed(0)
    config = LoraConfig(
        r=3, lora_alpha=5, target_modules=["q_proj", "in_proj_qkv", "down_proj"], init_lora_weights=False
    )
    peft = get_peft_model(transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path), config).eval()
    peft.save_pretrained(tmp_path / "peft")
    m = lora.load_adapters(lora.add_lora(load_model(path), 3, 5, ("q", "qkv", "down")), tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(m(x), peft(input_ids=x).logits, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_equal_one_on_a_hybrid(hybrid_run_model, tmp_path, mode):
    """Guards DDP and FSDP on a hybrid's GRPO-MA step (tree_hidden runs the trunks on the module and the answers
    through the wrapper, one wrapped forward per backward; FSDP shards each Block, its DeltaNet layer included): 2 CPU
    ranks (gloo) after one step equal 1 process."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["train.py", "--algo", "grpo_ma", "--answers", "2", "--model", hybrid_run_model, "--max-steps", "1"]
    args += ["--prompts-per-step", "4", "--thoughts", "2", "--max-thought-tokens", "24", "--max-answer-tokens", "6"]
    args += ["--eval-every", "0", "--eval-examples", "4", "--eval-samples", "0", "--micro-batch-rows", "3"]
    args += ["--reward-noise", "0.3,0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    subprocess.run([sys.executable, *args, "--out", one], cwd=root, check=True, env=env, capture_output=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", "29541"]
    fsdp = ["--fsdp"] if mode == "fsdp" else []
    r = subprocess.run([*torchrun, *args, *fsdp, "--out", two], cwd=root, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    start, w1, w2 = (load_model(p).state_dict() for p in (hybrid_run_model, f"{one}/final", f"{two}/final"))
    assert any(not torch.equal(start[k], w1[k]) for k in w1)  # the step moved the weights
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
