"""pack.py: a step's rollouts as one record (per prompt, thought and answer), as training rows, and the
log-probs of their tokens.

The record: a Group per prompt holds its K Thoughts, each holding its M Answers; an Answer is one
completion (GRPO-Zero's episode): its tokens, the sampler's log-probs, its text, reward, correctness.
`per_completion` reads a field of every completion as a [P, K, M] tensor, so no code indexes flat lists.
The rows: one per thought, thought | answer_1 .. answer_M, the thought's tokens once, with tree
attention so each answer sees only the prompt, its thought and itself. With a shared prompt (the
default) each distinct prompt runs once and its K rows attend to its keys and values. `token_stats`
runs the model on those rows and returns every completion token's log-prob (and entropy) in the
logical layout where the advantages and weights of the loss live.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcache import PromptRows, Prompts, TrunkKV, prompt_pass
from logprobs import head_logprobs
from model import VocabGrads


@dataclass
class Answer:
    """One completion of a step (GRPO-Zero's episode): an answer to its thought, and what the task made of
    thought + answer. With --answers 1 the thought is empty and the answer is the whole completion."""

    tokens: list[int]
    logprobs: list[float]  # the sampler's log-prob of each token
    finish: str  # "stop" | "length"
    text: str = ""  # thought + answer up to the stop token, as the reward functions read it
    reward: float = 0.0
    correct: float = 0.0  # the task's own 0/1 correctness (the reward may add shaping or noise)
    credit: float = 0.0  # the fine-grained score DaGRPO's pair mask compares (--pair-delta), else the reward
    components: dict[str, float] = field(default_factory=dict)  # the task's reward components (Task.components)
    sampled: bool = True  # False: not sampled from the policy (an anchor), trained off-policy
    context: list[bool] = field(default_factory=list)  # per token: True = appended (a tool's output), never trained;
    # empty: every token is the policy's


@dataclass
class Thought:
    tokens: list[int]  # ends with the end-of-thought marker (empty with --answers 1)
    logprobs: list[float]
    truncated: bool  # cut at its limit, the marker appended
    answers: list[Answer]  # M


@dataclass
class Group:
    """One prompt of a step and its K thoughts x M answers: GRPO's group."""

    example: dict
    prompt: list[int]  # token ids
    thoughts: list[Thought]  # K


def rollouts(examples: list[dict], prompts: list[list[int]], tree, k: int, m: int) -> list[Group]:
    """The sampler's tree (flat lists, prompt-major: prompt p's thought i at p*K + i, its answer j at
    (p*K + i)*M + j) as the step's record. A tree from multi-turn sampling (methods/tools.py) also carries each
    answer's context mask (answer_context: the tokens appended from a tool, not written by the policy)."""

    answers = [Answer(*a) for a in zip(tree.answers, tree.answer_logprobs, tree.answer_finish)]
    for a, context in zip(answers, getattr(tree, "answer_context", ())):
        a.context = context
    thoughts = zip(tree.thoughts, tree.thought_logprobs, tree.thought_truncated)
    thoughts = [Thought(*t, answers[i * m : (i + 1) * m]) for i, t in enumerate(thoughts)]
    return [Group(ex, prompt, thoughts[p * k : (p + 1) * k]) for p, (ex, prompt) in enumerate(zip(examples, prompts))]


def completions(groups: list[Group]) -> Iterator[tuple[Group, Thought, Answer]]:
    """Every completion of the step with its group and thought, prompt-major."""
    return ((g, t, a) for g in groups for t in g.thoughts for a in t.answers)


def per_completion(groups: list[Group], field: str) -> torch.Tensor:
    """A field of every completion (Answer), float32 [P, K, M]."""
    return torch.tensor([[[getattr(a, field) for a in t.answers] for t in g.thoughts] for g in groups])


def per_group(groups: list[Group], field: str) -> torch.Tensor:
    """A field of every completion, float32 [P, G] (G = K*M: one row per group, thought-major)."""
    return per_completion(groups, field).flatten(1)


@dataclass
class Batch:
    """A step's rollouts in two layouts, both one row per thought.

    Logical: its completion tokens thought | answer_1 .. answer_M from column 0, right-padded to T.
    The advantages, weights and masks of the loss live here.
    Packed, what the model runs on: prompt | thought | answer_1 | ... | answer_M, the thought once,
    with tree attention (an answer sees the prompt, the thought and itself, not the other answers)
    and RoPE positions as if each answer's sequence stood alone. With --share-prompt the prompt is
    not in the row: each distinct prompt is run once (prompt_ids) and the rows of its K thoughts
    attend to its keys and values, so gradients still reach it. token_stats maps packed log-probs
    to logical positions.
    """

    ids: torch.Tensor  # (B, T) completion token ids, logical
    thought: torch.Tensor  # (B, T) bool: thought tokens (trained once, with the thought advantage)
    answer_id: torch.Tensor  # (B, T) long: j for tokens of answer j, -1 elsewhere
    sampler_logp: torch.Tensor  # (B, T) float32: log-probs reported by the sampler
    packed_ids: torch.Tensor  # (B, T') token ids
    packed_pos: torch.Tensor  # (B, T') RoPE positions
    packed_attn: torch.Tensor | None  # (B, 1, T', T') bool tree attention within the row; None = plain causal
    jumps: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (row, token, source slot) of segments not predicted
    # by the token before them: answer j > 0 (its thought's end), and with shared prompts a row's first
    # token (source -1: the prompt's last token, in the prompt pass)
    to_logical: torch.Tensor  # (B, T') long: b * T + t of the logical token at this slot, -1 = none (prompt, padding)
    group: torch.Tensor | None = None  # (B,) long: the group (prompt) of each row
    off_policy: torch.Tensor | None = None  # (B, T) bool: tokens the policy did not sample (anchors); None if none
    context: torch.Tensor | None = None  # (B, T) bool: tokens appended from a tool (no loss, no ratio); None if none
    prompt_ids: torch.Tensor | None = None  # (P, Lp) left-padded shared prompts (--share-prompt), else None
    prompt_valid: torch.Tensor | None = None  # (P, Lp) bool: not padding
    prompt_of: torch.Tensor | None = None  # (B,) long: the prompt_ids row each packed row continues
    # Filled by the trainer's later steps, (B, T) each: the score pass, then the advantages.
    score_logp: torch.Tensor | None = None  # the policy's log-probs in the score pass (None when nothing needs them)
    old_logp: torch.Tensor | None = None  # log-probs before the update (mu > 1; None: the update's own, detached)
    ref_logp: torch.Tensor | None = None  # under the reference model (beta > 0)
    teacher_logp: torch.Tensor | None = None  # under a teacher (methods.scores: --teacher, RLSD's, SDPO's), else None
    entropy: torch.Tensor | None = None  # token entropy before the update (None: measured in the first epoch)
    adv: torch.Tensor | None = None
    weight: torch.Tensor | None = None  # the loss weight of each token: the step's aggregation, whole
    keep: torch.Tensor | None = None  # bool: the tokens the step's selections keep (Clip-Cov, 80/20), else None
    mask: torch.Tensor | None = None  # bool: the tokens the update trains
    selected: torch.Tensor | None = None  # bool: KL-Cov's tokens for its objective (--loss kl_cov), else None

    TOKENS: ClassVar[tuple[str, ...]] = ("adv", "weight", "keep", "ref_logp", "selected", "off_policy")

    def per_token(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `rows` of the per-token fields the loss reads (losses.Tokens has them by these names): the
        advantages and weights, and those the methods and the score pass filled (None ones left out)."""
        return {k: getattr(self, k)[rows] for k in self.TOKENS if getattr(self, k) is not None}


def pack(groups: list[Group], pad_id: int, device: torch.device, share_prompt: bool = False) -> Batch:
    """The step's rows, one per thought. A row's completion tokens are thought | answer_1 .. answer_M in both
    layouts: from column 0 in the logical one, after the row's prompt (none when shared) in the packed one. Each
    segment's positions continue its own sequence, prompt | thought | answer_j; a segment not predicted by the
    slot before it (answer j > 0, a row after a shared prompt) records where its first token's predictor is."""
    rows = [(g.prompt, t) for g in groups for t in g.thoughts]
    lead = [0 if share_prompt else len(prompt) for prompt, _ in rows]  # the prompt tokens each row runs itself
    n = [len(t.tokens) + sum(len(a.tokens) for a in t.answers) for _, t in rows]  # completion tokens
    B, T, Tp = len(rows), max(n), max(map(sum, zip(lead, n)))
    ids, answer_id, context = torch.full((B, T), pad_id), torch.full((B, T), -1), torch.zeros(B, T, dtype=torch.bool)
    sampler_logp, off = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    packed_ids, packed_pos = torch.full((B, Tp), pad_id), torch.zeros(B, Tp, dtype=torch.long)
    to_logical, jumps = torch.full((B, Tp), -1), []
    for b, (prompt, t) in enumerate(rows):
        col, L = 0, lead[b]
        for j, seg in enumerate([t, *t.answers]):  # j = 0: the thought; j > 0: answer j - 1
            k = len(seg.tokens)
            # start: the segment's first position after the prompt (every answer continues the thought, not the
            # answer before it); src: the packed slot that predicts its first token (-1: a shared prompt's last)
            start, src = (0, L - 1) if j == 0 else (len(t.tokens), L + len(t.tokens) - 1)
            ids[b, col : col + k], sampler_logp[b, col : col + k] = torch.tensor(seg.tokens), torch.tensor(seg.logprobs)
            answer_id[b, col : col + k], off[b, col : col + k] = j - 1, j > 0 and not seg.sampled
            if j > 0 and seg.context:  # a tool's output: context the row attends to, neither thought nor answer
                context[b, col : col + k] = torch.tensor(seg.context)
            packed_pos[b, L + col : L + col + k] = torch.arange(len(prompt) + start, len(prompt) + start + k)
            jumps += [(b, L + col, src)] if k and (src != L + col - 1 or src < 0) else []  # not the slot before
            col += k
        packed_ids[b, :L], packed_pos[b, :L] = torch.tensor(prompt[:L], dtype=torch.long), torch.arange(L)
        packed_ids[b, L : L + col], to_logical[b, L : L + col] = ids[b, :col], b * T + torch.arange(col)
    used = torch.arange(T) < torch.tensor(n)[:, None]
    attn = None
    if len(rows[0][1].answers) > 1:  # tree attention: causal, and an answer token sees no other answer's tokens
        ans = torch.where(to_logical >= 0, answer_id.flatten()[to_logical.clamp(min=0)], -1)
        causal = torch.ones(Tp, Tp, dtype=torch.bool).tril()
        attn = (causal & ((ans[:, None, :] == -1) | (ans[:, None, :] == ans[:, :, None])))[:, None].to(device)
    answer_id = answer_id.masked_fill(context, -1)  # so no mask built from thought | answer_id counts a context token
    group = torch.tensor([p for p, g in enumerate(groups) for _ in g.thoughts], device=device)
    jumps = tuple(torch.tensor(jumps, dtype=torch.long).view(-1, 3).T.to(device))
    thought = used & (answer_id == -1) & ~context
    tensors = [x.to(device) for x in (ids, thought, answer_id, sampler_logp, packed_ids, packed_pos)]
    batch = Batch(*tensors, attn, jumps, to_logical.to(device), group=group)
    if not all(a.sampled for _, t in rows for a in t.answers):  # the tokens of answers the policy did not sample
        batch.off_policy = off.to(device)
    if context.any():
        batch.context = context.to(device)
    if share_prompt:
        prompts = [g.prompt for g in groups]
        Lp = max(map(len, prompts))
        batch.prompt_ids = torch.tensor([[pad_id] * (Lp - len(p)) + p for p in prompts], device=device)
        batch.prompt_valid = torch.arange(Lp) >= torch.tensor([Lp - len(p) for p in prompts])[:, None]
        batch.prompt_valid, batch.prompt_of = batch.prompt_valid.to(device), group
    return batch


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """A micro-batch: the rows `rows` (long indices), trimmed to their longest packed row (and, with
    shared prompts, to the prompts they continue, trimmed to the longest); jumps and indices re-based."""
    B, T = batch.ids.shape
    new = torch.full((B,), -1, dtype=torch.long, device=rows.device).index_put_(
        (rows,), torch.arange(len(rows), device=rows.device)
    )
    width = int((batch.to_logical[rows] >= 0).nonzero()[:, 1].max()) + 1  # a packed row ends with a completion token
    jb, jt, js = batch.jumps
    keep = new[jb] >= 0
    to_logical = batch.to_logical[rows, :width]
    mb = Batch(
        batch.ids[rows],
        batch.thought[rows],
        batch.answer_id[rows],
        batch.sampler_logp[rows],
        batch.packed_ids[rows, :width],
        batch.packed_pos[rows, :width],
        None if batch.packed_attn is None else batch.packed_attn[rows, :, :width, :width],
        (new[jb[keep]], jt[keep], js[keep]),
        torch.where(to_logical >= 0, new[to_logical // T] * T + to_logical % T, -1),
        group=None if batch.group is None else batch.group[rows],
    )
    if batch.prompt_ids is not None:
        prompts, mb.prompt_of = torch.unique(batch.prompt_of[rows], return_inverse=True)
        valid = batch.prompt_valid[prompts]
        Lp = int(valid.sum(1).max())  # left padding: keep the last Lp columns
        mb.prompt_ids, mb.prompt_valid = batch.prompt_ids[prompts, -Lp:], valid[:, -Lp:]
    return mb


def split_rows(batch: Batch, size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Rows sorted by packed length, cut into micro-batches of at most `size` rows and, with
    max_tokens, at most that many padded token slots per forward (rows x longest row, plus the
    distinct shared prompts x their longest prompt): rows of similar length run together, so little
    compute goes to padding. A row longer than the budget runs alone. The update is a sum over rows:
    neither the order nor the cut changes it."""
    length = torch.where(
        batch.to_logical >= 0, torch.arange(batch.to_logical.shape[1], device=batch.ids.device) + 1, 0
    ).amax(1)
    order = torch.argsort(length, stable=True)
    if not max_tokens:
        return list(order.split(size))
    prompt_len = batch.prompt_valid.sum(1).tolist() if batch.prompt_ids is not None else None
    cuts, rows, prompts = [], [], set()
    for r, n in zip(order.tolist(), length[order].tolist()):  # ascending: the newest row is the longest
        p = batch.prompt_of[r].item() if prompt_len else None
        with_p = prompts | {p} if prompt_len else prompts
        cost = (len(rows) + 1) * n + (len(with_p) * max(prompt_len[q] for q in with_p) if prompt_len else 0)
        if rows and (len(rows) == size or cost > max_tokens):
            cuts.append(torch.tensor(rows, device=order.device))
            rows, with_p = [], {p} if prompt_len else set()
        rows.append(r)
        prompts = with_p
    return cuts + [torch.tensor(rows, device=order.device)]


def rows_mask(own: torch.Tensor | None, keys: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """The packed rows' attention mask: their own (B, 1, T, T) (tree attention; None: plainly causal), after their
    shared prompt's keys (B, Lp) when they have one."""
    if keys is None:
        return own
    if own is None:
        own = torch.ones(T, T, dtype=torch.bool, device=keys.device).tril().expand(len(keys), 1, T, T)
    return torch.cat([keys[:, None, None, :].expand(-1, 1, T, -1), own], 3)  # (B, 1, T, Lp + T)


def tree_hidden(model, batch: Batch, prompts: PromptRows | None = None, prompt_valid=None, vocab_grads=None):
    """The packed rows' hidden states (B, T', C) for a model with Gated DeltaNet layers (a Qwen3.5 hybrid), whose
    state no attention mask can keep from reading across the answers of a tree row. Each row's trunk (its prompt,
    unless shared, then its thought) runs once, recording each layer's keys and values and each DeltaNet layer's
    state at the trunk's end (PromptKV); its M answers then run as M rows of their own, attending to the trunk's keys
    and starting from its state, so each answer sees the prompt, its thought and itself, as the tree mask says. The
    hidden states go back to their packed slots. Cost: the packed row's tokens, in two forwards (no T' x T' mask);
    each answer reads a copy of the trunk's state (Hv dk dv floats per layer). prompts, prompt_valid (B, Lp): with a
    shared prompt, the trunks continue it (its rows and their padding). vocab_grads: as token_stats'."""
    ids, pos, dev = batch.packed_ids, batch.packed_pos, batch.packed_ids.device
    B, Tp = ids.shape
    ans = torch.where(batch.to_logical >= 0, batch.answer_id.flatten()[batch.to_logical.clamp(min=0)], -1)
    M, slot = int(ans.max()) + 1, torch.arange(Tp, device=dev)
    trunk_len = torch.where(ans >= 0, slot, Tp).amin(1)  # the trunk is what comes before the first answer
    Lt = max(int(trunk_len.max()), 1)
    valid = slot[:Lt] < trunk_len[:, None]  # (B, Lt)
    keys = valid if prompt_valid is None else torch.cat([prompt_valid, valid], 1)  # the trunk's keys, (B, Sk)
    causal = torch.ones(Lt, Lt, dtype=torch.bool, device=dev).tril()
    mask = torch.cat([keys[:, None, None, : keys.shape[1] - Lt].expand(-1, 1, Lt, -1), causal.expand(B, 1, Lt, Lt)], 3)
    trunk = TrunkKV(prompts)
    kw = dict(cache=trunk, attn_mask=mask, valid=valid, hidden=True, vocab_grads=vocab_grads)
    h = getattr(model, "module", model)(ids[:, :Lt], positions=pos[:, :Lt], **kw)  # DDP: the answers' pass is its own
    # each answer as a row: its slots start[b, j] .. + length[b, j] (contiguous), right-padded to La
    length = torch.stack([(ans == j).sum(1) for j in range(M)], 1)  # (B, M)
    start = torch.stack([torch.where(ans == j, slot, Tp).amin(1) for j in range(M)], 1)
    La = max(int(length.max()), 1)
    own = torch.arange(La, device=dev) < length[..., None]  # (B, M, La)
    at = (start[..., None] + torch.arange(La, device=dev)).clamp(max=Tp - 1).view(B, M * La)
    of = torch.arange(B, device=dev).repeat_interleave(M)
    tril = torch.ones(La, La, dtype=torch.bool, device=dev).tril()
    mask = torch.cat([keys[of][:, None, None, :].expand(-1, 1, La, -1), tril.expand(B * M, 1, La, La)], 3)
    a_ids, a_pos = (x.gather(1, at).view(B * M, La) for x in (ids, pos))
    kw = dict(cache=trunk.rows(of), attn_mask=mask, valid=own.view(B * M, La), hidden=True, vocab_grads=vocab_grads)
    ha = model(a_ids, positions=a_pos, **kw)
    out = torch.cat([h, h.new_zeros(B, Tp - Lt, h.shape[-1])], 1) if Tp > Lt else h[:, :Tp]
    flat = (torch.arange(B, device=dev)[:, None] * Tp + at).view(B, M, La)[own]  # packed slot of each answer token
    return out.flatten(0, 1).index_copy(0, flat, ha.flatten(0, 1)[own.flatten()]).view(B, Tp, -1)


def step_prompts(model, batch: Batch, micro: list[tuple[torch.Tensor, Batch]], vocab_grads=None) -> Prompts | None:
    """The step's shared prompts run once for all its micro-batches, when more than one micro-batch reads a prompt
    (each would run it again) and the pass is no larger than a micro-batch (its activations live through the epoch,
    beside each micro-batch's); None otherwise. The micro-batches before the last read `leaves`, values cut from the
    pass's graph that sum the gradients sent back to them; the last reads the pass itself, and Prompts.backward runs
    the pass's backward with its own, once (DDP and FSDP see one backward through the prompts, as per micro-batch)."""
    if batch.prompt_ids is None or len(micro) < 2:
        return None
    again = sum(int(mb.prompt_valid.sum()) for _, mb in micro) > int(batch.prompt_valid.sum())
    fits = batch.prompt_ids.numel() <= max(mb.packed_ids.numel() + mb.prompt_ids.numel() for _, mb in micro)
    return prompt_pass(model, batch.prompt_ids, batch.prompt_valid, True, vocab_grads) if again and fits else None


def token_stats(
    model,
    batch: Batch,
    temperature: float,
    entropy: bool = False,
    chunk_vocab: int | None = None,
    entropy_grad: bool = False,
    states: bool = False,
    prompts: Prompts | None = None,
    vocab_grads: VocabGrads | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and optionally entropy; with entropy_grad, differentiable) of every completion token under `model`,
    (B, T) float32 in the logical layout (0 at prompt and padding positions).

    The model runs on the packed rows and returns hidden states; only the completion tokens' ones go
    through lm_head, a slice of the vocabulary at a time (logprobs.head_logprobs), so no (rows, T, V) logits ever exist.
    Token t is predicted by the hidden state at t - 1, except the first token of a segment that does
    not follow its predecessor (the `jumps`: answer j > 0 is predicted from its thought's end, a
    row's first token from its shared prompt's end). prompts: the step's shared prompts, already run (step_prompts;
    the rows' batch.group index them), else the batch's own run here.
    vocab_grads: the step's sum of the embedding's and lm_head's gradients over micro-batches (model.VocabGrads)."""
    ids, first, keys = batch.packed_ids, None, None
    head = getattr(model, "module", model)
    if batch.prompt_ids is not None:  # 1. each prompt once, recording its keys/values (a hybrid's states too)
        of = batch.prompt_of if prompts is None else batch.group
        prompts = prompts or prompt_pass(model, batch.prompt_ids, batch.prompt_valid, vocab_grads=vocab_grads)
        first = prompts.first.index_select(0, of)  # (B, C); index_select: see PromptRows.update
        prompts, keys = prompts.kv.rows(of), prompts.valid.index_select(0, of)  # 2. the rows attend to their keys
    if batch.packed_attn is not None and "linear_attention" in (head.config.layer_types or ()):
        hidden = tree_hidden(model, batch, prompts, keys, vocab_grads)  # a hybrid's tree rows: no mask parts answers
    else:
        mask = rows_mask(batch.packed_attn, keys, ids.shape[1])
        hidden = model(ids, batch.packed_pos, prompts, mask, hidden=True, vocab_grads=vocab_grads)  # (B, T', C)

    # The slot whose hidden state predicts each packed token: the one before it, or its jump's source.
    source = torch.arange(-1, ids.shape[1] - 1, device=ids.device).expand_as(ids).clone()
    source[batch.jumps[:2]] = batch.jumps[2]  # (row, token, source slot)
    rows, cols = (batch.to_logical >= 0).nonzero(as_tuple=True)  # every completion token, row-major
    src = source[rows, cols]
    # (N, C); answers share their thought's last slot: index_select, see PromptRows.update
    h = hidden.flatten(0, 1).index_select(0, rows * hidden.shape[1] + src.clamp(min=0))
    if first is not None:  # source -1: the shared prompt's last position
        h = torch.where((src >= 0)[:, None], h, first.index_select(0, rows))
    if states:  # the predicting hidden states (N, C) of the completion tokens, row-major, and the tokens (N,)
        return h, ids[rows, cols]
    index, shape = (batch.to_logical[rows, cols],), batch.ids.shape
    to_logical = lambda x: x.new_zeros(shape.numel()).index_put(index, x).view(shape)  # noqa: E731 (N,) -> (B, T)
    kw = dict(entropy=entropy or entropy_grad, entropy_grad=entropy_grad, chunk_vocab=chunk_vocab)
    logp, ent = head_logprobs(head, h, ids[rows, cols], temperature, **kw, vocab_grads=vocab_grads)
    return to_logical(logp), None if ent is None else to_logical(ent)
