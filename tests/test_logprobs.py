"""The log-prob functions of logprobs.py: token_logprobs / token_entropy on existing logits (the
sampler's), and head_logprobs, which turns hidden states into target log-probs through lm_head
chunk by chunk and must equal the unchunked formula in value and gradient while never holding
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
def test_head_logprobs_equal_unchunked(tied, chunk):
    """Guards the hand-written backward and the chunk loop: values, entropy and gradients w.r.t.
    the hidden states AND lm_head.weight (the embedding itself when tied) must equal the unchunked
    log_softmax(lm_head(h).float() / T)[target] within 1e-6, for chunk 1, a chunk that does not
    divide N, chunk = N, chunk > N and the default. A wrong softmax-gradient sign, a missing 1/T,
    a chunk's rows skipped or written to the wrong slice, or a weight gradient kept from only the
    last chunk all fail here."""
    m = tiny_model(tied)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 96, (37,), generator=g)
    T = 0.7
    weight = m.lm_head.weight
    assert (weight is m.model.embed_tokens.weight) == tied

    ours, (gh, gw) = grads_of(lambda: L.head_logprobs(m, hidden, targets, T, chunk_tokens=chunk)[0], hidden, weight)
    ref, (rh, rw) = grads_of(lambda: reference(m.lm_head, hidden, targets, T)[0], hidden, weight)
    assert ours.dtype == torch.float32 and ours.shape == (37,)
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(gh, rh, **TOL)
    torch.testing.assert_close(gw, rw, **TOL)

    logp, ent = L.head_logprobs(m.lm_head, hidden, targets, T, entropy=True, chunk_tokens=chunk)  # the Linear too
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
        return L.head_logprobs(m, m(ids, hidden=True)[:, :-1], ids[:, 1:], T, chunk_tokens=5)[0]

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
            lambda: L.head_logprobs(m, hidden, targets, 0.8, chunk_tokens=6)[0], hidden, m.lm_head.weight
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
    the (N, V) logits or more (chunk 64 of N = 512 rows is 1/8 of them). Materialising the logits
    for the whole batch, saving every chunk's logits or softmax for backward and concatenating
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
        logp, ent = L.head_logprobs(head, hidden, targets, 0.9, entropy=True, chunk_tokens=64)
        (logp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert probe.largest < N * V // 2, f"{probe.op} returned {probe.largest} elements (N * V = {N * V})"
    with LargestOutput() as probe:
        reference(head, hidden, targets, 0.9)[0].sum().backward()
    assert probe.largest >= N * V


# ----------------------------------------------------------------------------- the fused backward (head_logprobs' loss)


def packed_micro_batch(model: M.Transformer):
    """A packed micro-batch of 2 prompts x 3 thoughts x 2 answers (tree rows), and per-token fields for policy_loss:
    mask (every completion token), adv, weight, old_logp and ref_logp near the model's log-probs (ratios off 1)."""
    import train
    from pack import rollouts
    from sampler import Tree

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 96, (n,), generator=g).tolist()  # noqa: E731
    P, K, m = 2, 3, 2
    thoughts = [rand(2 + (i * 5) % 7) for i in range(P * K)]
    answers = [rand(1 + (a * 3) % 5) for a in range(P * K * m)]
    zeros = lambda seqs: [[0.0] * len(s) for s in seqs]  # noqa: E731
    tree = Tree(thoughts, zeros(thoughts), [False] * (P * K), answers, zeros(answers), ["stop"] * len(answers))
    batch = train.pack(rollouts([{}] * P, [rand(5), rand(8)], tree, K, m), pad_id=0, device=torch.device("cpu"))
    mask = batch.thought | (batch.answer_id >= 0)
    with torch.no_grad():
        lp, _ = train.token_stats(model, batch, 0.7)
    near = lambda: torch.where(mask, lp + 0.3 * torch.randn(mask.shape, generator=g), 0.0)  # noqa: E731
    fields = dict(adv=torch.randn(mask.shape, generator=g), weight=mask.float() / mask.sum(), mask=mask)
    fields["selected"] = mask & (torch.arange(mask.shape[1]) % 3 == 0)  # KL-Cov's tokens (only kl_cov takes them)
    return batch, fields, near(), near()


def micro_batch_update(model, batch, fields, old, hp, objective, fused: bool):
    """train.update's micro-batch: token_stats (the head in chunks of 5 tokens), Tokens, policy_loss, backward;
    fused: token_stats gets the loss (losses.token_loss), so the head's backward runs in its forward. Returns the
    loss and every parameter's gradient."""
    import functools

    import train
    from losses import Tokens, policy_loss, token_loss

    model.zero_grad()
    loss_of = functools.partial(token_loss, fields, old, hp, objective, 1.0) if fused else None
    logp, _ = train.token_stats(model, batch, 0.7, chunk_tokens=5, loss=loss_of)
    loss, _ = policy_loss(Tokens(logp, logp.detach() if old is None else old, **fields), hp, objective)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def head_recomputes(monkeypatch) -> list:
    """A list that grows by one each time _HeadLogprobs' backward recomputes the logits (the speculation missed, or
    there was none)."""
    calls, plain = [], L._head_backward
    monkeypatch.setattr(L, "_head_backward", lambda *a: calls.append(1) or plain(*a))
    return calls


@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_fused_head_backward_equals_the_plain_one_for_every_loss(mu, beta, monkeypatch):
    """Guards the fused backward (head_logprobs' loss): for every --loss, with and without the KL term, on-policy
    (mu = 1: old_logp is the log-probs) and off (mu > 1), one micro-batch update through a tied tiny model must give
    the plain path's loss and every parameter's gradient within 1e-6 (in fact bitwise: the same logits, g and
    kernels). A wrong sign or 1/T in the forward's d, a chunk's g taken at the wrong slice, a g_W kept from one chunk,
    or a speculation accepted when the incoming gradient differs fail here. A token-separable loss must not recompute
    the logits in the backward; GSPO's and GMPO's sequence statistics at mu > 1 must (the fallback), still exact."""
    import dataclasses
    import types

    from config import TrainConfig
    from methods import LOSSES

    model = tiny_model(tied=True)
    batch, fields, old, ref = packed_micro_batch(model)
    hp = types.SimpleNamespace(**{**dataclasses.asdict(TrainConfig()), "beta": beta})
    fields = fields | dict(ref_logp=ref if beta else None)
    recomputes = head_recomputes(monkeypatch)
    for name, objective in LOSSES.items():
        loss, grads = micro_batch_update(model, batch, fields, old if mu > 1 else None, hp, objective, fused=False)
        assert len(recomputes) == 1
        recomputes.clear()
        loss_f, grads_f = micro_batch_update(model, batch, fields, old if mu > 1 else None, hp, objective, fused=True)
        torch.testing.assert_close(loss_f, loss, **TOL)
        for a, b in zip(grads_f, grads):
            torch.testing.assert_close(a, b, **TOL, msg=f"--loss {name}")
        # at mu = 1 every ratio is 1, so even GSPO's and GMPO's per-token gradients ignore the other tokens
        sequence_statistics = objective.sequence_level and mu > 1
        assert len(recomputes) == int(sequence_statistics), f"--loss {name}: recomputed {len(recomputes)} times"
        recomputes.clear()


def test_fused_head_backward_falls_back_when_the_gradient_depends_on_other_tokens(monkeypatch):
    """Guards the speculation's check: a loss whose per-token gradient reads other tokens' current log-probs (a
    weight from the row's mean log-prob, as DeepSeek-V3.2's sequence mask or a sequence-level importance weight
    computes one), or a gradient scaled after the fact, must be caught in the backward (a recomputation) and give
    the plain path's gradients, not the assumed ones."""
    m = tiny_model(tied=False)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 9, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 96, (2, 9), generator=g)
    coupled = lambda lp: (lp * lp.detach().mean(-1, keepdim=True).exp()).sum()  # noqa: E731 (2, 9) -> ()
    separable = lambda lp: (lp * lp.detach().exp()).sum()  # noqa: E731
    recomputes = head_recomputes(monkeypatch)
    for loss, scale, misses in ((coupled, 1.0, 1), (separable, 3.0, 1), (separable, 1.0, 0)):
        grads = []
        for fused in (False, True):
            logp, _ = L.head_logprobs(m, hidden, targets, 0.7, chunk_tokens=4, loss=loss if fused else None)
            grads.append(torch.autograd.grad(loss(logp) * scale, (hidden, m.lm_head.weight)))
        assert len(recomputes) == 1 + misses
        recomputes.clear()
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, **TOL)


def test_fused_head_backward_under_autocast_equals_the_plain_one(monkeypatch):
    """Guards the fused backward under bf16 autocast (the trainer's GPU path): the forward's bf16 logits and the
    chunk products summed into the float32 weight gradient must be those the plain backward recomputes, so the
    speculation holds (no recomputation) and the gradients are the plain path's."""
    m = tiny_model(tied=True)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 7, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 96, (3, 7), generator=g)
    loss = lambda lp: (lp * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))).sum()  # noqa: E731
    recomputes = head_recomputes(monkeypatch)
    grads = []
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = L.head_logprobs(m, hidden, targets, 0.7, chunk_tokens=4, loss=loss if fused else None)
            grads.append(torch.autograd.grad(loss(logp), (hidden, m.lm_head.weight)))
    assert len(recomputes) == 1
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("loss_kind", ["plain", "fused", "fused_miss"])
def test_vocab_grads_sum_micro_batches_and_hand_them_over_once(tied, loss_kind):
    """Guards model.VocabGrads (train.update's micro-batches): lm_head's and the embedding's gradients summed over
    micro-batches (one float32 buffer; the lookups' rows) and handed to autograd by the last must equal one backward
    per micro-batch, every parameter within 1e-6, with the plain head backward, the fused one, and a fused one whose
    speculation misses (the guess's share leaves the step's buffer). Before the last micro-batch the tables must have
    no gradient (one handed over early would be counted twice), and after it nothing may stay behind (it would be
    lost)."""
    m = tiny_model(tied=tied)
    g = torch.Generator().manual_seed(6)
    ids = [torch.randint(0, 96, (2, 7), generator=g) for _ in range(3)]
    scale = [torch.rand(2, 6, generator=g) for _ in ids]
    coupled = loss_kind == "fused_miss"

    def loss_of(lp, s):  # coupled: each token's gradient reads the row's mean log-prob (a miss)
        return (lp * s * (lp.detach().mean(-1, keepdim=True).exp() if coupled else 1)).sum()

    tables = [m.model.embed_tokens.weight, m.lm_head.weight]
    grads = []
    for sums in (None, M.VocabGrads()):
        m.zero_grad(set_to_none=True)
        for i, (x, s) in enumerate(zip(ids, scale)):
            if sums is not None:
                sums.last = i == len(ids) - 1
            h = m(x[:, :-1], hidden=True, vocab_grads=sums)
            fn = None if loss_kind == "plain" else (lambda lp, s=s: (lp * s).sum())
            logp, _ = L.head_logprobs(m, h, x[:, 1:], 0.7, chunk_tokens=5, loss=fn, vocab_grads=sums)
            loss_of(logp, s).backward()
            if sums is not None and not sums.last:
                assert all(t.grad is None for t in tables)
        assert sums is None or (sums.head is None and sums.rows == [])
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)
