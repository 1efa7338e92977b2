"""Tests of multiturn.py: completions that pause for an observation appended to their KV cache. The appended ids
are exactly those the callback returned (token in, token out), the log-probs after an observation equal a fresh
forward of the whole row (tiny and real-shape models), budgets and call limits hold, seeds reproduce, and a row
with no call is sampler.generate's. Tiny random models, CPU."""

from collections import Counter

import pytest
import torch

from helpers import make_hf_checkpoint
from hf import load_model
from logprobs import token_logprobs
from model import ModelConfig, Transformer
from multiturn import sample_turns
from sampler import generate
from stop_text import StopText

PROMPTS = [[5, 9, 17, 3, 44, 2, 7, 60], [11, 12], [99, 100, 101, 4, 8]]
V = 128


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_hf_checkpoint(tmp_path_factory.mktemp("mt"), "qwen2"))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5 hybrid: a DeltaNet layer's state must take each observation as a fresh forward would."""
    return load_model(make_hf_checkpoint(tmp_path_factory.mktemp("mt-hybrid"), "qwen3_5"))


def real_shape() -> Transformer:
    """Qwen2.5-0.5B's layer shape (hidden 896, 14 query heads, 2 key/value heads of 64, SwiGLU 4864, q/k/v bias,
    RoPE theta 1e6), one layer and a small vocabulary, randomly initialised."""
    config = ModelConfig(
        vocab_size=V,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=1,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        attention_bias=True,
        model_type="qwen2",
        max_position_embeddings=512,
    )
    m = Transformer(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.05 * torch.randn(p.shape, generator=g)
            )
    return m.eval()


def marker_on(model, k: int = 3) -> StopText:
    """A call's end marker "m" that k of the tokens a row commonly samples spell: rows call often, at random."""
    probe = generate(model, PROMPTS, max_new_tokens=40, n=4, seed=0)
    common = {t for t, _ in Counter(t for row in probe.tokens for t in row).most_common(k)}
    return StopText("m", [min(common)], lambda ids: "".join("m" if i in common else "x" for i in ids), V)


class Recorder:
    """A respond callback: an observation of 1-5 ids depending on the row and its call, each call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], list[int]]] = []  # (row, completion so far, observation)

    def __call__(self, row: int, completion: list[int]) -> list[int]:
        obs = [20 + (row + len(completion) + j) % 50 for j in range(1 + (row + len(completion)) % 5)]
        self.calls.append((row, completion, obs))
        return obs


def full_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's view: every completion position's log-prob from one plain causal forward of the whole row."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(completion))


def run(model, respond, **kw):
    args = dict(n=4, max_tokens=60, call_end=marker_on(model), respond=respond, max_calls=3, seed=[1, 2, 3])
    return sample_turns(model, PROMPTS, **(args | kw))


@pytest.mark.parametrize("shape", ["tiny", "real", "hybrid"])
def test_logprobs_after_an_observation_equal_a_fresh_forward_of_the_whole_row(model, hybrid, shape):
    """Guards the cache append at a tool call: the observation extended onto the row's cache (its last sampled
    token, which decode does not feed, then the observation's ids) must leave keys, values and RoPE positions
    exactly as a fresh forward of prompt + everything written and appended so far would, so every log-prob the
    sampler reports, those right after an observation included, equals the trainer's to float32 rounding. On the
    tiny model, on Qwen2.5-0.5B's layer shape and on a Qwen3.5 hybrid."""
    m = {"tiny": model, "hybrid": hybrid}.get(shape) or real_shape()
    out = run(m, Recorder())
    assert sum(out.calls) >= 3, "the test needs rows that called"
    for i, (toks, lps, ctx) in enumerate(zip(out.tokens, out.logprobs, out.context)):
        full = full_logprobs(m, PROMPTS[i // 4], toks)
        own = torch.tensor([not c for c in ctx])
        torch.testing.assert_close(torch.tensor(lps)[own], full[own], atol=1e-4 if shape == "real" else 1e-5, rtol=0)


def test_token_in_token_out_every_id_is_the_one_sampled_or_appended(model):
    """Guards re-tokenization at the assistant/tool boundary (verl issue 6719: a separator token dropped at every
    boundary when the conversation was re-encoded from text): a multi-call row's ids are, in order, exactly what
    the policy sampled up to its marker and the observation ids the callback returned, and the context mask marks
    exactly the appended ones (with log-prob 0)."""
    rec = Recorder()
    out = run(model, rec)
    multi = [r for r, c in enumerate(out.calls) if c >= 2]
    assert multi, "the test needs a row with two calls"
    for r in range(len(out.tokens)):
        mine = [(c, o) for row, c, o in rec.calls if row == r]
        if len(mine) > out.calls[r]:  # the last observation did not fit the budget: the row ended there
            assert len(mine) == out.calls[r] + 1 and out.finish[r] == "length" and mine[-1][0] == out.tokens[r]
            mine = mine[:-1]
        expect_ctx, pos = [False] * len(out.tokens[r]), 0
        for completion, obs in mine:
            assert out.tokens[r][: len(completion)] == completion  # what the callback saw is the row's prefix
            pos = len(completion)
            assert out.tokens[r][pos : pos + len(obs)] == obs  # then exactly its observation
            expect_ctx[pos : pos + len(obs)] = [True] * len(obs)
        assert out.context[r] == expect_ctx
        assert all(lp == 0.0 for lp, c in zip(out.logprobs[r], out.context[r]) if c)
        assert all(lp < 0.0 for lp, c in zip(out.logprobs[r], out.context[r]) if not c)


def test_budget_call_limit_and_ending_rows(model):
    """Guards the limits: no completion over max_tokens (sampled and appended together), no row over max_calls, a
    row whose callback answers None ends ("stop") without an observation, and a row cut at its budget is
    "length"."""
    rec = Recorder()
    out = run(model, rec, max_tokens=30, max_calls=1)
    assert all(len(t) <= 30 for t in out.tokens) and max(out.calls) == 1
    assert all(f == "length" for t, f in zip(out.tokens, out.finish) if len(t) == 30)

    def ends(row: int, completion: list[int]) -> None:
        return None

    out = run(model, ends)
    assert sum(out.calls) == 0 and not any(any(c) for c in out.context)
    assert "stop" in out.finish


def test_same_seed_same_rollouts_and_no_call_is_generate(model):
    """Guards the sampler's seeded reproducibility with tools: the same seeds give the same rows, tokens and
    log-probs; and where no row calls (a marker never written), each row is exactly sampler.generate's."""
    a, b = run(model, Recorder()), run(model, Recorder())
    assert a.tokens == b.tokens and a.logprobs == b.logprobs and a.context == b.context and a.calls == b.calls
    never = StopText("m", [0], lambda ids: "x" * len(ids), V)
    out = run(model, Recorder(), call_end=never)
    ref = generate(model, PROMPTS, max_new_tokens=60, n=4, seed=[1, 2, 3])
    assert out.tokens == ref.tokens and out.finish == ref.finish and sum(out.calls) == 0
    for x, y in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", ["tiny", "hybrid"])
def test_static_decode_path_samples_what_the_eager_path_does(model, hybrid, shape):
    """Guards the GPU's path (a graphs.StaticDecode adopts each turn's cache into its static buffers: power-of-two
    rows and slots, the batch shrinking by buckets), run eagerly here: the same rows, calls, tokens and log-probs
    as the eager decode, across forks and observation appends."""
    from kvcache import decode_step_static

    model = hybrid if shape == "hybrid" else model
    ref = run(model, Recorder())
    out = run(model, Recorder(), static_step=decode_step_static)
    assert out.tokens == ref.tokens and out.context == ref.context and out.calls == ref.calls
    for x, y in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)
