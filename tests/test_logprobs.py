"""The log-prob functions of logprobs.py: token_logprobs / token_entropy on existing logits (the
sampler's), and head_logprobs, which turns hidden states into target log-probs through lm_head
a slice of the vocabulary at a time and must equal the unsliced formula in value and gradient while never holding
(N, V) logits, in forward or backward. Tiny random models, CPU."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprobs as L
import model as M

TOL = dict(atol=1e-6, rtol=1e-6)


def tiny_model(tied: bool, vocab_size: int = 96, hidden_size: int = 32, seed: int = 0) -> M.Transformer:
    torch.manual_seed(seed)
    cfg = M.ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        attention_bias=True,
        model_type="qwen2",
    )
    return M.Transformer(cfg)


def reference(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, T: float):
    """The unchunked computation: full (N, V) logits, log_softmax, gather; entropy -sum p log p."""
    logp_all = torch.log_softmax(head(hidden).float() / T, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), ent.detach()


def grads_of(fn, *leaves: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """logp = fn(); backward of a random weighted sum; (logp, grads of leaves)."""
    logp = fn()
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(7))
    return logp.detach(), list(torch.autograd.grad((logp * w).sum(), leaves))


# ----------------------------------------------------------------------------- token_logprobs on logits


def test_token_logprobs_and_entropy_match_reference():
    """Guards THE log-prob formula on logits: values must equal log_softmax(logits / T) gathered at
    the targets, in float32 even for bf16 logits, identically whether or not rows are chunked; the
    entropy helper must equal -sum p log p."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 3
    targets = torch.randint(0, 50, (3, 7), generator=g)
    for T in (1.0, 0.7):
        ref = torch.log_softmax(logits.double() / T, -1).gather(-1, targets[..., None]).squeeze(-1)
        for chunk in (None, 1, 4):
            out = L.token_logprobs(logits, targets, temperature=T, chunk_rows=chunk)
            assert out.dtype == torch.float32 and out.shape == targets.shape
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        p = torch.softmax(logits.double() / T, -1)
        ent = L.token_entropy(logits, temperature=T, chunk_rows=4)
        torch.testing.assert_close(ent.double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    bf = L.token_logprobs(logits.bfloat16(), targets)
    assert bf.dtype == torch.float32
    ref_bf = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(bf.double(), ref_bf, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        L.token_logprobs(logits, targets, temperature=0.0)


def test_token_logprobs_gradient_through_chunks():
    """Guards the chunk path on logits: gradients w.r.t. the logits must equal those
    of a plain log_softmax + gather (a chunk dropped from the graph gives zero grads)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 30, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (4, 5), generator=g)
    w = torch.randn(4, 5, generator=g)
    (L.token_logprobs(logits, targets, 0.8, chunk_rows=3) * w).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    (torch.log_softmax(logits / 0.8, -1).gather(-1, targets[..., None]).squeeze(-1) * w).sum().backward()
    torch.testing.assert_close(ours, logits.grad, atol=1e-6, rtol=1e-5)
    logits.grad = None
    L.token_entropy(logits, chunk_rows=3).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    p = torch.softmax(logits, -1)
    (-(p * torch.log_softmax(logits, -1)).sum(-1)).sum().backward()
    torch.testing.assert_close(ours, logits.grad, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- head_logprobs


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [1, 7, 37, 1000, None])
def test_head_logprobs_equal_unsliced(tied, chunk):
    """Guards the hand-written backward and the loop over vocabulary slices: values, entropy and gradients w.r.t.
    the hidden states AND lm_head.weight (the embedding itself when tied) must equal the unsliced
    log_softmax(lm_head(h).float() / T)[target] within 1e-6, for slices of 1 word, a slice that does not
    divide V, one larger than V and the default. A wrong softmax-gradient sign, a missing 1/T,
    a slice's gradient rows written to the wrong rows, hidden's gradient kept from only the last slice or a
    target's gradient added in a slice that does not hold it all fail here."""
    m = tiny_model(tied)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 96, (37,), generator=g)
    T = 0.7
    weight = m.lm_head.weight
    assert (weight is m.model.embed_tokens.weight) == tied

    ours, (gh, gw) = grads_of(lambda: L.head_logprobs(m, hidden, targets, T, chunk_vocab=chunk)[0], hidden, weight)
    ref, (rh, rw) = grads_of(lambda: reference(m.lm_head, hidden, targets, T)[0], hidden, weight)
    assert ours.dtype == torch.float32 and ours.shape == (37,)
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(gh, rh, **TOL)
    torch.testing.assert_close(gw, rw, **TOL)

    logp, ent = L.head_logprobs(m.lm_head, hidden, targets, T, entropy=True, chunk_vocab=chunk)  # the Linear too
    torch.testing.assert_close(logp.detach(), ref, **TOL)
    torch.testing.assert_close(ent, reference(m.lm_head, hidden, targets, T)[1], **TOL)
    assert ent.dtype == torch.float32 and not ent.requires_grad
    assert L.head_logprobs(m, hidden, targets, T)[1] is None


def test_hidden_forward_then_head_logprobs_equal_full_logits_path():
    """Guards forward(hidden=True) and the trainer's path end to end: the hidden states must be the
    final-norm output lm_head sees (logits_to_keep applied), the default forward must be unchanged
    bit for bit, and head_logprobs on (B, T-1, C) hidden states must give the same log-probs,
    entropy and gradients on EVERY parameter (a tied embedding gets both of its uses) as
    token_logprobs / token_entropy on the full logits."""
    m = tiny_model(tied=True)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    h = m(ids, hidden=True)
    assert h.shape == (2, 11, 32)
    assert torch.equal(m.lm_head(h), m(ids))
    assert torch.equal(m(ids, logits_to_keep=3, hidden=True), h[:, -3:])

    params = list(m.parameters())
    T = 0.6

    def ours():
        return L.head_logprobs(m, m(ids, hidden=True)[:, :-1], ids[:, 1:], T, chunk_vocab=5)[0]

    def full():
        return L.token_logprobs(m(ids)[:, :-1], ids[:, 1:], T)

    a, ga = grads_of(ours, *params)
    b, gb = grads_of(full, *params)
    assert a.shape == (2, 10)
    torch.testing.assert_close(a, b, **TOL)
    for p, x, y in zip(params, ga, gb):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=lambda s: f"{p.shape}: {s}")
    with torch.no_grad():
        ent = L.head_logprobs(m, m(ids, hidden=True), ids, T, entropy=True)[1]
        torch.testing.assert_close(ent, L.token_entropy(m(ids), T), **TOL)
    with pytest.raises(ValueError, match="temperature"):
        L.head_logprobs(m, h, ids, 0.0)


def test_head_logprobs_respect_autocast():
    """Guards the autocast contract: under bf16 autocast the head matmul must run in bf16 (as
    `lm_head(h)` would: values equal to that reference, and far from the float32 matmul's) with
    the log-softmax in float32; gradients must come back in the float32 dtypes of the hidden
    states and weight, close to autocast's own. A Function that ignores autocast would silently
    double the logits' memory and disagree with the sampler's bf16 log-probs."""
    m = tiny_model(tied=False)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(20, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 96, (20,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, (gh, gw) = grads_of(
            lambda: L.head_logprobs(m, hidden, targets, 0.8, chunk_vocab=13)[0], hidden, m.lm_head.weight
        )
        ref, (rh, rw) = grads_of(lambda: reference(m.lm_head, hidden, targets, 0.8)[0], hidden, m.lm_head.weight)
    fp32 = reference(m.lm_head, hidden, targets, 0.8)[0].detach()
    assert ours.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert (ours - fp32).abs().max() > 1e-3  # so the check above really saw a bf16 matmul
    torch.testing.assert_close(gh, rh, atol=2e-3, rtol=2e-2)  # bf16 rounding of the gradients
    torch.testing.assert_close(gw, rw, atol=2e-3, rtol=2e-2)


class LargestOutput(TorchDispatchMode):
    """Records the largest numel of any tensor an op returns while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_logprobs_never_allocate_full_logits(tied):
    """Guards the point of head_logprobs: no op in forward or backward may produce a tensor of half
    the (N, V) logits or more (a slice of 1024 of V = 8192 words is 1/8 of them). Materialising the logits
    for the whole batch, saving every slice's logits or softmax for backward and concatenating
    them, or a gradient built for all rows at once all trip it; the unchunked reference shows the
    probe does catch (N, V) tensors."""
    N, V, C = 512, 8192, 16
    head = torch.nn.Linear(C, V, bias=False)
    if tied:
        emb = torch.nn.Embedding(V, C)
        head.weight = emb.weight
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(N, C, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    with LargestOutput() as probe:
        logp, ent = L.head_logprobs(head, hidden, targets, 0.9, entropy=True, chunk_vocab=1024)
        (logp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert probe.largest < N * V // 2, f"{probe.op} returned {probe.largest} elements (N * V = {N * V})"
    with LargestOutput() as probe:
        reference(head, hidden, targets, 0.9)[0].sum().backward()
    assert probe.largest >= N * V


def test_head_logprobs_in_one_slice_are_the_unsliced_formulas_bit_for_bit():
    """Guards the combination of the slices: with the whole vocabulary in one slice (a small vocabulary, the default
    for few tokens) the log-probs and entropy must be token_logprobs' and token_entropy's on the full logits bit for
    bit, so runs on a small vocabulary (the bundled model's, the golden runs) compute what the unsliced head did; with
    several slices, the same within float32 rounding. A combination that rescales one slice's sums (an online
    logsumexp) or a target picked from the wrong slice fails here."""
    m = tiny_model(tied=False)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(40, 32, generator=g)
    targets = torch.randint(0, 96, (40,), generator=g)
    targets[:6] = torch.tensor([0, 95, 6, 7, 13, 14])  # the vocabulary's ends and slice edges (slices of 7)
    logits = m.lm_head(hidden)
    with torch.no_grad():
        for cols, exact in ((None, True), (96, True), (7, False), (1, False)):
            logp, ent = L.head_logprobs(m, hidden, targets, 0.8, entropy=True, chunk_vocab=cols)
            want, want_ent = L.token_logprobs(logits, targets, 0.8), L.token_entropy(logits, 0.8)
            if exact:
                assert torch.equal(logp, want) and torch.equal(ent, want_ent), cols
            else:
                torch.testing.assert_close(logp, want, **TOL)
                torch.testing.assert_close(ent, want_ent, **TOL)


@pytest.mark.parametrize("tied", [True, False])
def test_vocab_grads_sum_micro_batches_and_hand_them_over_once(tied):
    """Guards model.VocabGrads (train.update's micro-batches): lm_head's and the embedding's gradients summed over
    micro-batches (one float32 buffer, slice by slice; the lookups' rows) and handed to autograd by the last must
    equal one backward per micro-batch, every parameter within 1e-6. Before the last micro-batch the tables must have
    no gradient (one handed over early would be counted twice), and after it nothing may stay behind (it would be
    lost)."""
    m = tiny_model(tied=tied)
    g = torch.Generator().manual_seed(6)
    ids = [torch.randint(0, 96, (2, 7), generator=g) for _ in range(3)]
    scale = [torch.rand(2, 6, generator=g) for _ in ids]
    tables = [m.model.embed_tokens.weight, m.lm_head.weight]
    grads = []
    for sums in (None, M.VocabGrads()):
        m.zero_grad(set_to_none=True)
        for i, (x, s) in enumerate(zip(ids, scale)):
            if sums is not None:
                sums.last = i == len(ids) - 1
            h = m(x[:, :-1], hidden=True, vocab_grads=sums)
            logp, _ = L.head_logprobs(m, h, x[:, 1:], 0.7, chunk_vocab=10, vocab_grads=sums)
            (logp * s).sum().backward()
            if sums is not None and not sums.last:
                assert all(t.grad is None for t in tables)
        assert sums is None or (sums.head is None and sums.rows == [])
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)
