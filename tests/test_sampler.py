"""Tests of sampler.py: greedy generation equals transformers.generate, the KV cache (decode,
forks, holes, chunks, compaction, the static path) equals a clean full forward, tree sampling
shares its prefixes and reports the trainer's log-probs, sampling matches its target
distribution, seeds are per prompt, and misuse is a clear error. Tiny random models, CPU."""

from collections import Counter

import pytest
import torch

import sampler
from helpers import make_char_tokenizer, make_hf_checkpoint
from hf import load_model
from logprobs import token_logprobs
from model import ModelConfig, Transformer
from sampler import KVCache, StopText, decode_step, extend, generate, prefill, sample_next, sample_tree
from tokenizer import load_tokenizer

PROMPTS = [[5, 9, 17, 3, 44, 2, 7, 60], [11, 12], [99, 100, 101, 4, 8]]  # different lengths


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny random checkpoint per family, loaded with hf.load_model (float32)."""
    d = tmp_path_factory.mktemp("ckpt")
    return {f: load_model(make_hf_checkpoint(d, f, tied=f == "qwen3")) for f in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    """A qwen2 model whose lm_head is scaled x4: peaked next-token distributions, so frequent tokens
    repeat (natural stops) and wrong sampling temperatures are detectable."""
    m = load_model(make_hf_checkpoint(tmp_path_factory.mktemp("peaky"), "qwen2"))
    with torch.no_grad():
        m.lm_head.weight.mul_(4)
    return m


def full_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The trainer's view: log-probs of `completion` from one plain causal forward of prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(completion), temperature)


def record_forwards(model, monkeypatch) -> list[tuple[int, int]]:
    """Wrap model.forward to log the (B, T) shape of every call."""
    shapes, forward = [], model.forward

    def wrapped(input_ids, *args, **kw):
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids, *args, **kw)

    monkeypatch.setattr(model, "forward", wrapped)
    return shapes


# ----------------------------------------------------------------------------- greedy vs transformers


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(models, tmp_path, family):
    """Guards against any cache / position / padding / RoPE bug in batched decoding (left padding
    with per-row positions, a key mask), and against stop ids that end the wrong row or drop the
    stop token: token-for-token equality with HF generate on a left-padded batch."""
    import transformers

    ours = models[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        make_hf_checkpoint(tmp_path, family, tied=family == "qwen3"), dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    T = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in PROMPTS])
    am = torch.arange(T) >= torch.tensor([T - len(p) for p in PROMPTS])[:, None]  # left padding

    def hf_new(**kw) -> list[list[int]]:
        out = hf.generate(
            ids,
            attention_mask=am.long(),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.0,
            pad_token_id=0,
            **kw,
        )[:, T:].tolist()
        stop = kw.get("eos_token_id")
        return [r[: r.index(stop) + 1] if stop in r else r for r in out]  # up to and including the stop

    g = generate(ours, PROMPTS, max_new_tokens=16, temperature=0)
    assert g.tokens == hf_new()
    assert g.finish == ["length"] * 3
    # a token row 0 emits at step ~3 that rows 1 and 2 never emit: row 0 must stop there, the others go on
    stop = next(t for t in g.tokens[0][3:] if t not in g.tokens[1] + g.tokens[2])
    s = generate(ours, PROMPTS, max_new_tokens=16, temperature=0, stop_ids=[stop])
    assert s.tokens == hf_new(eos_token_id=stop)
    assert s.tokens[0] == g.tokens[0][: g.tokens[0].index(stop) + 1] and s.tokens[1:] == g.tokens[1:]
    assert s.finish == ["stop", "length", "length"]


# ----------------------------------------------------------------------------- the cache


def test_cached_decode_matches_full_forward(models):
    """Guards against wrong positions, masks or cache slots in prefill + decode: every decode
    step's logits equal a plain full forward of the row's own (unpadded) tokens."""
    model = models["llama"]
    prompts = [PROMPTS[0], PROMPTS[1]]
    cache, logits = prefill(model, prompts)
    cache = cache.fork(torch.arange(2), cache.length + 5)
    feed = torch.tensor([[7, 8, 9, 10, 11], [20, 21, 22, 23, 24]])
    steps = [logits]
    with torch.no_grad():
        for t in range(5):
            steps.append(decode_step(model, cache, feed[:, t], torch.ones(2, dtype=torch.bool)))
        for i, p in enumerate(prompts):
            ref = model(torch.tensor([p + feed[i].tolist()]))[0, len(p) - 1 :]  # (6, V)
            torch.testing.assert_close(torch.stack([s[i] for s in steps]), ref, atol=1e-5, rtol=1e-5)


def test_forked_cache_with_holes_and_chunk_matches_clean_forward(models):
    """Guards against holes (slots of a row that had finished) leaking into attention, fork copying
    the wrong rows, and a chunk appended to a non-empty cache using a top-left (is_causal) mask:
    logits of the chunk equal a clean forward of the row's real tokens."""
    model = models["qwen3"]
    cache, _ = prefill(model, [PROMPTS[2], PROMPTS[1]])
    cache = cache.fork(torch.arange(2), cache.length + 10)
    real = [list(PROMPTS[2]), list(PROMPTS[1])]
    alive = [[True, True], [True, False], [True, False], [True, True]]  # row 1 has 2 holes
    with torch.no_grad():
        for t, a in enumerate(alive):
            tok = torch.tensor([30 + t, 40 + t])
            decode_step(model, cache, tok, torch.tensor(a))
            for i in range(2):
                real[i] += [tok[i].item()] if a[i] else []
        forked = cache.fork(torch.tensor([1, 1, 0]), cache.length + 3)
        chunk = torch.tensor([[50, 51, 52]] * 3)
        logits = extend(model, forked, chunk, torch.ones(3, 3, dtype=torch.bool), logits_to_keep=3)
        for row, src in enumerate([1, 1, 0]):
            ref = model(torch.tensor([real[src] + [50, 51, 52]]))[0, -3:]
            torch.testing.assert_close(logits[row], ref, atol=1e-5, rtol=1e-5)


def test_kv_cache_compact_restore_fork_keep_rows_aligned():
    """Guards against compaction losing track of which cache row holds which sequence: compact,
    restore_order and fork (which takes the caller's row ids) must move keys, values, key_valid,
    positions and row ids together."""
    c = KVCache(2, 4, 1, 6, 2, dtype=torch.float32, device=torch.device("cpu"))
    c.length = 3
    c.k[:, :, :, :3] = torch.arange(4.0)[None, :, None, None, None]  # row r's keys are all r
    c.v[:, :, :, :3] = -torch.arange(4.0)[None, :, None, None, None]
    c.key_valid[:, :3] = True
    c.key_valid[2, 1] = False
    c.next_pos[:] = torch.tensor([3, 3, 2, 3])
    perm = c.compact(torch.tensor([False, True, False, True]))
    assert perm.tolist() == [1, 3, 0, 2] and c.batch == 2 and c.rows.tolist() == [1, 3, 0, 2]
    assert c.k[0, :, 0, 0, 0].tolist() == [1, 3, 0, 2] and c.next_pos.tolist() == [3, 3, 3, 2]
    f = c.fork(torch.tensor([2, 2, 1]), 8)  # caller's rows, whatever the cache order
    assert f.k[1, :, 0, 2, 0].tolist() == [2, 2, 1] and f.v[1, :, 0, 0, 0].tolist() == [-2, -2, -1]
    assert f.key_valid[:, :3].tolist() == [[True, False, True]] * 2 + [[True] * 3] and f.length == 3
    c.restore_order()
    assert c.batch == 4 and c.rows.tolist() == [0, 1, 2, 3] and c.k[1, :, 0, 1, 1].tolist() == [0, 1, 2, 3]
    assert c.key_valid[2].tolist()[:3] == [True, False, True] and c.next_pos.tolist() == [3, 3, 2, 3]


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_compaction_changes_no_output(peaky, monkeypatch, fraction):
    """Guards against compaction (dropping finished rows from the forward) corrupting the live rows
    or the parked caches tree answers are decoded from: compacting at every step (0.0) and never
    (1.0) give the same tokens as the default."""
    args = dict(k=4, m=2, max_thought_tokens=12, max_answer_tokens=8, seed=[1, 2])
    probe = sample_tree(peaky, PROMPTS[:2], end_of_thought=[0, 0, 0], **args)
    counts = Counter(t for th in probe.thoughts for t in set(th[:-3]))
    marker = counts.most_common(1)[0][0]  # ends several thoughts early
    args |= dict(end_of_thought=[marker], stop_ids=[t for t, _ in counts.most_common(4)[1:]])
    ref = sample_tree(peaky, PROMPTS[:2], **args)
    assert sum(not t for t in ref.thought_truncated) >= 2 and "stop" in ref.answer_finish
    monkeypatch.setattr(sampler, "COMPACT_WHEN_DONE", fraction)
    out = sample_tree(peaky, PROMPTS[:2], **args)
    assert out.thoughts == ref.thoughts and out.answers == ref.answers and out.answer_finish == ref.answer_finish
    for a, b in zip(out.answer_logprobs + out.thought_logprobs, ref.answer_logprobs + ref.thought_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_static_decode_path_matches_dynamic(models):
    """Guards against the static-shape decode step (static_step=decode_step_static, what a caller
    compiles) diverging from the default one: in-place writes at a tensor slot and attention over
    all slots give the same samples. Run eagerly (torch.compile itself and CUDA graphs are not
    exercised on CPU)."""
    model = models["qwen2"]
    args = dict(max_new_tokens=10, n=2, temperature=1.0, stop_ids=[3, 17, 50], seed=[4, 5, 6])
    ref = generate(model, PROMPTS, **args)
    out = generate(model, PROMPTS, static_step=sampler.decode_step_static, **args)
    assert out.tokens == ref.tokens and out.finish == ref.finish
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- log-probs and trees


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (0.7, 5)])
def test_logprobs_match_trainer_forward(models, temperature, top_k):
    """Guards against sampler log-probs that are not those of the distribution sampled from (wrong
    temperature, a missing renormalisation after top-k) or that drift from the trainer's full
    forward (one log-prob function): equal to token_logprobs of a full forward within 1e-5."""
    model = models["qwen3"]
    g = generate(model, PROMPTS, max_new_tokens=12, n=2, temperature=temperature, top_k=top_k, stop_ids=[3, 40], seed=0)
    for i, (toks, lps) in enumerate(zip(g.tokens, g.logprobs)):
        prompt = PROMPTS[i // 2]
        ids = torch.tensor([prompt + toks])
        with torch.no_grad():
            logits = model(ids)[0, len(prompt) - 1 : -1]
        if top_k:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[:, -1:], float("-inf"))
        ref = token_logprobs(logits, torch.tensor(toks), temperature)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)


def test_tree_logprobs_match_full_forward_and_prefix_is_computed_once(peaky, monkeypatch):
    """Guards against tree sampling answering from the wrong thought or cache row, a forced marker
    without its true log-prob, and recomputing shared prefixes: thought and answer log-probs equal
    a full forward of prompt + thought + answer, and only the prompt (batch P) and one marker chunk
    (batch P*K) are ever fed more than one token at a time."""
    P, K, M, Tt, Ta = 2, 4, 3, 12, 6
    probe = sample_tree(
        peaky, PROMPTS[:P], k=K, m=M, max_thought_tokens=Tt, max_answer_tokens=Ta, end_of_thought=[0, 0, 0], seed=[1, 2]
    )
    assert probe.thought_truncated == [True] * (P * K)
    # a two-token marker that thought 1 emits: it ends there, the others are (mostly) cut off
    marker = probe.thoughts[1][2:4]
    shapes = record_forwards(peaky, monkeypatch)
    tree = sample_tree(
        peaky,
        PROMPTS[:P],
        k=K,
        m=M,
        max_thought_tokens=Tt,
        max_answer_tokens=Ta,
        end_of_thought=marker,
        stop_ids=[91],
        seed=[1, 2],
    )
    shapes = list(shapes)  # the sampler's forwards only
    assert tree.thoughts[1] == probe.thoughts[1][:4] and not tree.thought_truncated[1]
    assert any(tree.thought_truncated) and "stop" in tree.answer_finish
    for i, (th, lp) in enumerate(zip(tree.thoughts, tree.thought_logprobs)):
        assert th[-2:] == marker and len(lp) == len(th) and len(th) <= Tt + (2 if tree.thought_truncated[i] else 0)
        torch.testing.assert_close(torch.tensor(lp), full_logprobs(peaky, PROMPTS[i // K], th), atol=1e-5, rtol=0)
    assert len(tree.answers) == P * K * M
    for a, (ans, lp) in enumerate(zip(tree.answers, tree.answer_logprobs)):
        full = full_logprobs(peaky, PROMPTS[a // (K * M)], tree.thoughts[a // M] + ans)
        torch.testing.assert_close(torch.tensor(lp), full[-len(ans) :], atol=1e-5, rtol=0)
    multi = [s for s in shapes if s[1] > 1]
    assert multi == [(P, len(PROMPTS[0])), (P * K, len(marker) + 1)]
    assert all(T == 1 for B, T in shapes if B > P * K)
    total = sum(B * T for B, T in shapes)
    assert total <= P * 8 + P * K * (Tt - 1) + P * K * 3 + P * K * M * (Ta - 1)  # < P*K*M*(prompt+thought)


def test_tree_without_thought_phase_is_group_sampling(models):
    """Guards against the M = 1 / no-marker path differing from plain group sampling with G = K*M
    (the trainer's GRPO path): identical to generate(n=K*M) with the same seeds."""
    model = models["llama"]
    ref = generate(model, PROMPTS, max_new_tokens=7, n=6, stop_ids=[9], seed=[3, 4, 5])
    for tree in (
        sample_tree(model, PROMPTS, k=3, m=2, max_thought_tokens=5, max_answer_tokens=7, stop_ids=[9], seed=[3, 4, 5]),
        sample_tree(
            model,
            PROMPTS,
            k=3,
            m=2,
            max_thought_tokens=0,
            max_answer_tokens=7,
            end_of_thought=[1],
            stop_ids=[9],
            seed=[3, 4, 5],
        ),
    ):
        assert tree.answers == ref.tokens and tree.answer_logprobs == ref.logprobs and tree.answer_finish == ref.finish
        assert tree.thoughts == [[]] * 9 and tree.thought_truncated == [False] * 9


# ----------------------------------------------------------------------------- sampling statistics


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of integer samples against probs (V,); bins with expected count < 5 merged."""
    n = len(samples)
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def threshold(df: int) -> float:
    """Far in the chi-square tail (mean df, sd sqrt(2 df)): a correct sampler exceeds it with
    probability < 1e-6, while every wrong distribution below lands orders of magnitude above it."""
    return df + 8 * (2 * df) ** 0.5 + 10


def target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The intended distribution, written independently of sampler.truncate."""
    p = torch.softmax(logits.double() / temperature, -1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    order = p.argsort(descending=True)
    if top_k:
        order = order[:top_k]
    q = p[order] / p[order].sum()
    n = int((q.cumsum(0) < top_p - 1e-12).sum()) + 1 if top_p < 1 else len(order)  # smallest set with mass >= p
    keep[order[:n]] = True
    return torch.where(keep, p, 0) / p[keep].sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,wrong",
    [
        (1.0, 0, 1.0, (0.8, 0, 1.0)),
        (0.6, 0, 1.0, (1.0, 0, 1.0)),
        (1.3, 6, 1.0, (1.3, 0, 1.0)),
        (1.0, 0, 0.7, (1.0, 0, 1.0)),
        (0.8, 8, 0.8, (0.8, 8, 1.0)),
    ],
)
def test_sample_next_matches_target_distribution(temperature, top_k, top_p, wrong):
    """Guards against a biased sampler (wrong temperature, top-k / top-p applied in the wrong order
    or not renormalised, inverse-CDF off by one, zero-probability tokens drawn): 40k draws pass a
    chi-square test that the `wrong` distribution fails, never leave the support, and report
    log-probs of the target distribution."""
    logits = torch.linspace(2.0, -2.0, 24)[torch.randperm(24, generator=torch.Generator().manual_seed(0))]
    u = torch.rand(40_000, generator=torch.Generator().manual_seed(1))
    tok, lp = sample_next(logits.expand(len(u), -1), u, temperature, top_k, top_p)
    p = target(logits, temperature, top_k, top_p)
    assert (p[tok] > 0).all()
    stat, df = chi_square(tok, p)
    assert stat < threshold(df)
    stat_wrong, df_wrong = chi_square(tok, target(logits, *wrong))
    assert stat_wrong > 5 * threshold(df_wrong)
    torch.testing.assert_close(lp, p.log()[tok].float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("V,block", [(1000, 64), (1024, 64), (24, 1024)])
def test_block_draw_is_the_scan_draw(V, block):
    """Guards the GPU's two-level draw (sampler.draw_in_blocks: the block, then the token within it; no scan
    of the whole vocabulary) drawing another token than the reference scan for the same uniform (a block
    off by one, the remainder block lost, the earlier blocks' mass not subtracted), or a zero-probability
    token: a whole zero block, zeros at block edges, masked tails, and uniforms 0 and just below 1. In
    float64, where rounding cannot move a boundary, it equals draw() exactly."""
    g = torch.Generator().manual_seed(V)
    e = torch.rand(512, V, generator=g, dtype=torch.float64) ** 4
    e[:, block : 2 * block] = 0  # the second block has no mass
    e[::2, : 3 * block : 3] = 0
    e[1::4, V // 2 :] = 0  # top-k / top-p style masked tails
    e[:, -1] = 0
    u = torch.rand(512, generator=g, dtype=torch.float64)
    u[:8], u[8:16] = (
        0.0,
        torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)),
    )
    tok = sampler.draw_in_blocks(e, u, block=block)
    assert torch.equal(tok, sampler.draw(e, u)) and (e.gather(1, tok[:, None]) > 0).all()
    e32, u32 = e.float(), u.float()
    tok = sampler.draw_in_blocks(e32, u32, block=block)
    assert (e32.gather(1, tok[:, None]) > 0).all() and (tok == sampler.draw(e32, u32)).float().mean() > 0.99


def test_generate_samples_first_token_from_softmax_over_temperature(peaky):
    """Guards against generate sampling from something other than softmax(logits / T) end to end
    (e.g. the fork replicating the wrong logits, uniforms shared across rows): 4000 first tokens of
    one prompt pass a chi-square test that the temperature-1 distribution fails."""
    g = generate(peaky, [PROMPTS[0]], max_new_tokens=1, n=4000, temperature=0.6, seed=0)
    tok = torch.tensor([t[0] for t in g.tokens])
    with torch.no_grad():
        logits = peaky(torch.tensor([PROMPTS[0]]))[0, -1]
    stat, df = chi_square(tok, torch.softmax(logits.double() / 0.6, -1))
    assert stat < threshold(df)
    stat_wrong, df_wrong = chi_square(tok, torch.softmax(logits.double(), -1))
    assert stat_wrong > 2 * threshold(df_wrong)


def test_greedy_is_argmax(models):
    """Guards against temperature 0 sampling instead of taking the argmax, and against greedy
    log-probs other than the documented temperature-1 ones."""
    tok, lp = sample_next(torch.tensor([[0.1, 3.0, -1.0], [2.0, 1.0, 0.0]]), torch.tensor([0.999, 0.999]), 0.0)
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(
        lp, torch.log_softmax(torch.tensor([[0.1, 3.0, -1.0], [2.0, 1.0, 0.0]]), -1)[[0, 1], [1, 0]]
    )


# ----------------------------------------------------------------------------- seeds


def test_same_seed_same_samples_and_per_prompt_seeds_ignore_the_batch(models):
    """Guards against shared or global random state: the same seed gives the same samples, another
    seed different ones, and a prompt's samples with its seed are the same alone or batched with
    other prompts (what makes DDP rollouts equal single-process rollouts)."""
    model = models["qwen2"]
    a = generate(model, PROMPTS, max_new_tokens=10, n=3, seed=7)
    assert generate(model, PROMPTS, max_new_tokens=10, n=3, seed=7).tokens == a.tokens
    assert generate(model, PROMPTS, max_new_tokens=10, n=3, seed=8).tokens != a.tokens
    alone = generate(model, [PROMPTS[1]], max_new_tokens=10, n=3, stop_ids=[5, 6, 7], seed=[42])
    batched = generate(model, [PROMPTS[0], PROMPTS[1]], max_new_tokens=10, n=3, stop_ids=[5, 6, 7], seed=[1, 42])
    assert batched.tokens[3:] == alone.tokens and batched.finish[3:] == alone.finish
    torch.testing.assert_close(
        torch.tensor(sum(batched.logprobs[3:], [])), torch.tensor(sum(alone.logprobs, [])), atol=1e-5, rtol=0
    )
    kw = dict(k=2, m=2, max_thought_tokens=6, max_answer_tokens=4, end_of_thought=[3])
    t_alone = sample_tree(model, [PROMPTS[1]], seed=[42], **kw)
    t_batched = sample_tree(model, [PROMPTS[2], PROMPTS[1]], seed=[9, 42], **kw)
    assert t_batched.thoughts[2:] == t_alone.thoughts and t_batched.answers[4:] == t_alone.answers


# ----------------------------------------------------------------------------- stops, limits, errors


def test_stop_ids_and_length_limit(models):
    """Guards against tokens after a stop id, a dropped stop token, wrong finish reasons, and
    rows running past max_new_tokens."""
    model = models["qwen3"]
    stops = [10, 20, 30, 40, 50, 60, 70, 80]
    g = generate(model, PROMPTS, max_new_tokens=9, n=4, stop_ids=stops, seed=3)
    assert {"stop", "length"} == set(g.finish)
    for toks, lps, fin in zip(g.tokens, g.logprobs, g.finish):
        assert 1 <= len(toks) <= 9 and len(lps) == len(toks)
        assert not set(toks[:-1]) & set(stops)
        assert fin == ("stop" if toks[-1] in stops else "length")
        assert fin == "stop" or len(toks) == 9


def test_misuse_is_a_clear_error(models):
    """Guards against silent nonsense on bad input: an empty prompt list, an empty prompt, a prompt
    that with its new tokens exceeds the model's context, bad seeds or sampling settings."""
    model = models["llama"]  # max_position_embeddings = 256
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(model, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        generate(model, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        generate(model, [[1] * 200], max_new_tokens=57)
    generate(model, [[1] * 200], max_new_tokens=56, temperature=0)  # exactly fits
    with pytest.raises(ValueError, match="exceeds the model's context"):
        sample_tree(model, [[1] * 200], k=2, m=2, max_thought_tokens=40, max_answer_tokens=15, end_of_thought=[5, 6])
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generate(model, PROMPTS, max_new_tokens=4, seed=[1, 2])
    with pytest.raises(ValueError, match="top_p"):
        generate(model, PROMPTS, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[1, 128]], max_new_tokens=4)


def test_bfloat16_and_autocast(models, tmp_path):
    """Guards against dtype mismatches on the bf16 path (cache dtype vs the keys the model writes,
    sampling on bf16 logits): a bf16 model and a float32 model under bf16 autocast both sample
    tree rollouts whose log-probs stay close to the float32 trainer forward."""
    model32 = models["qwen2"]
    model16 = load_model(make_hf_checkpoint(tmp_path, "qwen2"), dtype=torch.bfloat16)
    kw = dict(k=2, m=2, max_thought_tokens=6, max_answer_tokens=5, end_of_thought=[3, 4], stop_ids=[7], seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = sample_tree(model32, PROMPTS, **kw)
    for tree in (sample_tree(model16, PROMPTS, **kw), auto):
        for a, (ans, lp) in enumerate(zip(tree.answers, tree.answer_logprobs)):
            full = full_logprobs(model32, PROMPTS[a // 4], tree.thoughts[a // 2] + ans)[-len(ans) :]
            assert (torch.tensor(lp) - full).abs().mean() < 0.02  # measured ~3e-3


# ----------------------------------------------------------------------------- end-of-thought marker as text

MARKER = "</think>"
SPELLINGS = {  # how Qwen2.5's vocabulary writes the marker (it has no </think> token)
    "</think>": [522, 26865, 29],
    "</think>\n": [522, 26865, 397],
    "</think>\n\n": [522, 26865, 1339],
    " </think>": [690, 26865, 29],
}
THOUGHT = "12+30: the tens give 10+30=40, the ones 2+0=2, so 42."
ANSWER = r" The answer is \boxed{42}."
IM_END = 151645


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The real Qwen2.5 tokenizer (tests/qwen_fixture.py, built once per session) loaded with
    tokenizer.load_tokenizer, and the StopText for </think> over its vocabulary."""
    from qwen_fixture import qwen25_dir

    tok = load_tokenizer(qwen25_dir(tmp_path_factory))
    return tok, StopText(MARKER, tok.encode(MARKER), tok.decode, tok.vocab_size)


class Scripted(Transformer):
    """A tiny random Transformer over Qwen2.5's padded vocabulary (151936) whose sampling is forced:
    the token at RoPE position p is script[p - start] (a +1e4 logit: drawn at any temperature, log-prob
    0); past the script's end it samples freely. So a prompt of length start + d reads the script
    from index d. The cache, masks and positions are the sampler's real ones, and the weights are
    large (N(0, 0.5)) so that a wrong cache changes the free tokens' log-probs."""

    def __init__(self, script: list[int], start: int):
        cfg = ModelConfig(
            vocab_size=151936,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            attention_bias=True,
            tie_word_embeddings=True,
            max_position_embeddings=512,
        )
        super().__init__(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        self.script, self.start = torch.tensor(script), start

    def forward(self, input_ids, positions=None, logits_to_keep=0, **kw):
        logits = super().forward(input_ids, positions=positions, logits_to_keep=logits_to_keep, **kw)
        i = positions.expand(input_ids.shape)[:, -logits.shape[1] :] + 1 - self.start  # script index predicted
        forced = self.script[i.clamp(0, len(self.script) - 1)]
        bias = 1e4 * ((i >= 0) & (i < len(self.script)))
        return logits.scatter_add_(-1, forced[..., None], bias[..., None].to(logits.dtype))


def first_marker_end(tok, ids: list[int], marker: str = MARKER) -> int | None:
    """The oracle: index of the first token at which the decoded text contains the marker."""
    return next((i for i in range(len(ids)) if marker in tok.decode(ids[: i + 1])), None)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_text_marker_ends_thought_at_the_right_token(qwen, spelling):
    """Guards the Qwen2.5/Llama case the exact-id match misses: a model writes </think> as ordinary
    tokens, often merged with what follows (">\\n" is 397, ">\\n\\n" 1339) or with a space before
    (690). With a StopText the thought ends at the token that completes the marker text (that token
    included), and the answers start right after it; the exact-id marker never stops on the other
    spellings (the bug this fixes)."""
    tok, stop = qwen
    thought = tok.encode(THOUGHT)
    assert tok.encode(spelling) == SPELLINGS[spelling]
    script = thought + SPELLINGS[spelling] + tok.encode(ANSWER) + [IM_END]
    model, prompt = Scripted(script, start=5), [[1, 2, 3, 4, 5]]
    kw = dict(k=2, m=2, max_thought_tokens=40, max_answer_tokens=24, stop_ids=[IM_END], seed=0)
    tree = sample_tree(model, prompt, end_of_thought=stop, **kw)
    assert tree.thoughts == [thought + SPELLINGS[spelling]] * 2 and tree.thought_truncated == [False] * 2
    assert tree.answers == [tok.encode(ANSWER) + [IM_END]] * 4 and tree.answer_finish == ["stop"] * 4
    assert tok.decode(tree.thoughts[0]).endswith(spelling)
    assert all(len(lp) == len(th) for lp, th in zip(tree.thought_logprobs, tree.thoughts))
    exact = sample_tree(model, prompt, end_of_thought=tok.encode(MARKER), **kw)
    assert exact.thought_truncated == [spelling != "</think>"] * 2


def test_text_marker_split_across_tokens_any_way(qwen):
    """Guards the tail decoding: every way of splitting </think> into pieces (each piece tokenized on
    its own, 128 ways), after text that merges with its first characters or not and followed by
    more text, ends at the token that completes it; so does a marker whose last character is split
    into bytes (a CJK marker spelled with single-byte tokens). Several rows at once, checked every
    step (CPU) and in windows of 8 steps (GPU)."""
    from qwen_fixture import byte_to_unicode

    tok, stop = qwen
    rows = []
    for cut in range(2 ** (len(MARKER) - 1)):
        pieces, start = [], 0
        for i in range(1, len(MARKER)):
            if cut >> (i - 1) & 1:
                pieces.append(MARKER[start:i])
                start = i
        pieces.append(MARKER[start:])
        before = ["so 42.", "x", "a)", "ok ", "\n\n"][cut % 5]
        rows.append(tok.encode(before) + sum((tok.encode(p) for p in pieces), []) + tok.encode("\n\nThe answer"))
    rows += [tok.encode(t) for t in ("42.</think>", "done </think>\n\n4", ")</think>\n", "</think></think>", "<think>")]
    ends = [first_marker_end(tok, r) for r in rows]
    assert ends[-1] is None and all(e is not None for e in ends[:-1])
    T = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    for every in (1, 8):
        n_tokens, found = torch.tensor([len(r) for r in rows]), {}
        for lo in range(0, T, every):
            hit_rows, hit_steps = sampler.text_hits(stop, stop.candidates, tokens, n_tokens, lo, min(T, lo + every))
            for r, s in zip(hit_rows, hit_steps):
                assert r not in found
                found[r], n_tokens[r] = s, s + 1  # as decode() does: the row's later steps are not checked
        assert [found.get(i) for i in range(len(rows))] == ends
    b2u = byte_to_unicode()
    byte_ids = [tok.token_to_id(b2u[b]) for b in "好答".encode()]  # one token per UTF-8 byte
    cjk = StopText("答", tok.encode("答"), tok.decode, tok.vocab_size)
    assert sampler.text_hits(cjk, cjk.candidates, torch.tensor([byte_ids]), torch.tensor([6]), 0, 6) == ([0], [5])


def test_cut_off_thought_gets_marker_ids_appended(qwen):
    """Guards the thought limit in text mode: a thought that has not completed the marker text when
    it reaches max_thought_tokens (here it stopped inside it, at "</th") gets the marker's token ids
    appended with the model's log-probs, and its answers continue after them."""
    tok, stop = qwen
    thought = tok.encode(THOUGHT + " </th")
    script = thought + tok.encode("ink> never") + tok.encode(ANSWER) * 2
    model = Scripted(script, start=3)
    Tt = len(thought)
    tree = sample_tree(
        model, [[7, 8, 9]], k=2, m=2, max_thought_tokens=Tt, max_answer_tokens=6, end_of_thought=stop, seed=1
    )
    assert tree.thought_truncated == [True, True]
    assert tree.thoughts == [thought + [522, 26865, 29]] * 2
    assert all(len(lp) == Tt + 3 and all(-1e9 < x <= 0 for x in lp) for lp in tree.thought_logprobs)  # finite
    assert tree.answers == [script[Tt + 3 : Tt + 9]] * 4  # the marker took 3 positions


@pytest.mark.parametrize("static", [False, True])
def test_text_marker_found_late_is_cut_back(qwen, monkeypatch, static):
    """Guards the GPU schedule, where the text is checked only every SYNC_EVERY steps, so a row may
    have decoded (and fed to the cache) a few tokens past its marker before it is seen: the row must
    be cut back to the marker (tokens dropped, their cache slots holes, its position rewound), so
    thoughts, answers and every log-prob equal the every-step (CPU) schedule. Prompts of different
    lengths read the script from different offsets, so the marker ends at step 28 (found 3 steps
    late), 31 (on a check), 33 (the last step) or not at all (cut off); the answers end in freely
    sampled tokens, which see the whole cache. Also on the static path (static_step=decode_step_static),
    run eagerly."""
    tok, stop = qwen
    script = tok.encode(THOUGHT) + [522, 26865, 1339] + tok.encode(ANSWER)
    e = first_marker_end(tok, script)  # 35
    prompts = [[5] * 4, [6] * 6, [7] * 8, [8] * 11]  # offsets 0, 2, 4, 7 into the script
    kw = dict(k=2, m=2, max_thought_tokens=e - 1, max_answer_tokens=len(script) - e + 2, end_of_thought=stop)
    kw |= dict(temperature=1.0, seed=[1, 2, 3, 4], static_step=sampler.decode_step_static if static else None)
    model = Scripted(script, start=4)
    ref = sample_tree(model, prompts, **kw)
    assert ref.thought_truncated == [True] * 2 + [False] * 6
    assert [len(t) - 1 for t in ref.thoughts[2::2]] == [e - 2, e - 4, e - 7]  # the steps the marker ends at
    assert sampler.SYNC_EVERY == 8 and [(e - d) % 8 for d in (2, 4, 7)] == [1, 7, 4]
    monkeypatch.setattr(sampler, "host_sync_every", lambda device: sampler.SYNC_EVERY)
    late = sample_tree(model, prompts, **kw)
    assert late.thoughts == ref.thoughts and late.answers == ref.answers
    assert late.thought_truncated == ref.thought_truncated and late.answer_finish == ref.answer_finish
    for a, b in zip(late.thought_logprobs + late.answer_logprobs, ref.thought_logprobs + ref.answer_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for i, th in enumerate(ref.thoughts):  # the free tokens came from the right cache
        ans, lp = ref.answers[2 * i], ref.answer_logprobs[2 * i]
        ids = torch.tensor([prompts[i // 2] + th + ans])
        with torch.no_grad():
            logits = model(ids, positions=torch.arange(ids.shape[1]), logits_to_keep=len(ans) + 1)[0, :-1]
        torch.testing.assert_close(torch.tensor(lp), token_logprobs(logits, torch.tensor(ans)), atol=1e-4, rtol=0)


def test_text_marker_on_single_token_marker_is_bit_identical_to_ids(tmp_path):
    """Guards the bundled model's path: where </think> is one added token, matching it as text ends
    every thought where the exact ids do, with the same tokens and the very same log-probs."""
    tok = load_tokenizer(make_char_tokenizer(tmp_path))
    model = load_model(make_hf_checkpoint(tmp_path, "qwen2", vocab_size=tok.vocab_size), dtype=torch.float32)
    marker = tok.encode(MARKER)
    assert len(marker) == 1
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in ("12+34=?", "7*8?")]
    probe = sample_tree(
        model, prompts, k=4, m=2, max_thought_tokens=12, max_answer_tokens=6, end_of_thought=[0], seed=5
    )
    frequent = Counter(t for th in probe.thoughts for t in th[:-1]).most_common(1)[0][0]  # stands in for </think>
    with torch.no_grad():  # make the </think> token as likely as the frequent one, so thoughts end early
        model.lm_head.weight[marker[0]] = model.lm_head.weight[frequent]
    kw = dict(k=4, m=2, max_thought_tokens=12, max_answer_tokens=6, stop_ids=tok.stop_ids, seed=[3, 4])
    ids = sample_tree(model, prompts, end_of_thought=marker, **kw)
    text = sample_tree(model, prompts, end_of_thought=StopText(MARKER, marker, tok.decode, tok.vocab_size), **kw)
    assert 0 < sum(ids.thought_truncated) < len(ids.thoughts)
    assert text == ids  # dataclass equality: every list, log-probs included, exactly


def test_stop_text_needs_text_and_ids():
    """Guards misuse: an empty marker or one without ids (needed for cut-off thoughts) is an error."""
    decode = lambda ids: "".join(map(chr, ids))
    with pytest.raises(ValueError, match="non-empty marker text and its token ids"):
        StopText("", [1], decode, 10)
    with pytest.raises(ValueError, match="non-empty marker text and its token ids"):
        StopText(MARKER, [], decode, 10)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused_in_one_sentence(models, bad):
    """Guards against weights holding NaN or inf (a diverged update) reaching the sampler as `index 28 is
    out of bounds for dimension 1`: searchsorted over a NaN cdf answers V; the sampler now names the cause."""
    model = models["qwen2"]
    broken = {k: v.clone() for k, v in model.state_dict().items()}
    broken["model.norm.weight"][0] = bad
    copy = Transformer(model.config)
    copy.load_state_dict(broken)
    expected = r"^sampling: the model's next-token logits are not finite \(NaN or inf\) in 6 of 6 rows: its weights"
    with pytest.raises(ValueError, match=expected):
        generate(copy, PROMPTS, max_new_tokens=4, n=2, seed=0)
    with pytest.raises(ValueError, match=expected):
        generate(copy, PROMPTS, max_new_tokens=4, n=2, temperature=0)
    tok, lp = sample_next(torch.tensor([[0.0, bad, 1.0]]), torch.tensor([0.5]), 1.0)
    assert tok.item() in (0, 1, 2) and not torch.isfinite(lp).item()  # in range: no index error
