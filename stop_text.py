"""Ending a thought on text: an end-of-thought marker (StopText) matched against the decoded tokens, however
the tokenizer spells it, the way inference engines match stop strings (sampler.py's docstring says when it runs).
Only tokens whose own text holds the marker's last character can complete it (a bool over the vocabulary, built
once), and only for those is the tail of the row decoded."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class StopText:
    """An end-of-thought marker matched on text: `text` (e.g. "</think>"), its token `ids`
    (tokenizer.encode(text), appended to a thought cut off at the limit), and the tokenizer's
    `decode` (ids -> text, special tokens kept). Build it once per run: it decodes each of the
    vocab_size tokens once (~0.2 s for a 152k vocabulary) to find the tokens that can complete the
    marker. A marker ending in a space is not supported by decoders that strip a leading space."""

    text: str
    ids: Sequence[int]
    decode: Callable[[list[int]], str]
    vocab_size: int
    candidates: Tensor = field(init=False, repr=False)  # (vocab_size,) bool: the token can end the marker
    window: int = field(init=False)  # tokens decoded per check: each token holds >= 1 byte of the text

    def __post_init__(self):
        if not self.text or not self.ids:
            raise ValueError(
                f"StopText: need a non-empty marker text and its token ids, got {self.text!r}, {self.ids}."
            )
        last = self.text[-1]
        partial = not last.isascii()  # a multi-byte last character may end in a token that decodes to U+FFFD
        pieces = [self.decode([i]) for i in range(self.vocab_size)]
        self.candidates = torch.tensor([last in p or (partial and "\ufffd" in p) for p in pieces], dtype=torch.bool)
        self.window = len(self.text.encode()) + 1  # + 1: room for a leading space a decoder might strip


@functools.cache
def stop_text_for(tokenizer, text: str) -> StopText:
    """The StopText of `text` (an environment's call marker), built once per tokenizer: it decodes the vocabulary."""
    return StopText(text, tokenizer.encode(text), tokenizer.decode, tokenizer.vocab_size)


@dataclass
class TextWatch:
    """Matching a StopText against the rows' decoded tokens: where the rows started (to cut a row
    back to its marker) and how many steps have been checked."""

    stop: StopText
    can_end: Tensor  # (V,) bool over the model's vocabulary: the token can end the marker
    start_slot: int  # cache slot of every row's first sampled token
    start_pos: Tensor  # (B,) RoPE position of each caller row's first sampled token
    checked: int = 0  # steps before this one have been matched against the text


def watch_text(stop: StopText, vocab_size: int, cache) -> TextWatch:
    """A TextWatch for the active rows of `cache` (a kvcache.KVCache), about to sample their first token."""
    can_end = torch.zeros(vocab_size, dtype=torch.bool)  # the model's vocab may be padded
    n = min(vocab_size, len(stop.candidates))
    can_end[:n] = stop.candidates[:n]
    B = cache.batch
    start_pos = torch.empty_like(cache.next_pos[:B])
    start_pos[cache.rows[:B]] = cache.next_pos[:B]
    return TextWatch(stop, can_end.to(cache.k.device), cache.length, start_pos)


def text_hits(
    stop: StopText, can_end: Tensor, tokens: Tensor, n_tokens: Tensor, lo: int, hi: int
) -> tuple[list[int], list[int]]:
    """Rows (caller order) whose decoded text first contains stop.text at a step in [lo, hi), and
    that step. Only steps whose token can end the marker (can_end) are decoded, each as the tail of
    stop.window tokens: a marker completed there lies inside it, and one completed earlier was
    found earlier."""
    steps = torch.arange(lo, hi, device=tokens.device)
    maybe = (can_end[tokens[:, lo:hi]] & (steps < n_tokens[:, None])).cpu()  # (B, hi - lo); the host sync
    rows = maybe.any(1).nonzero()[:, 0]
    if len(rows) == 0:
        return [], []
    w0 = max(0, lo + 1 - stop.window)
    tails = tokens[rows.to(tokens.device), w0:hi].tolist()
    hit_rows, hit_steps = [], []
    for r, tail, flags in zip(rows.tolist(), tails, maybe[rows].tolist()):
        for j in (j for j, f in enumerate(flags) if f):
            end = lo + j + 1 - w0  # tail[:end] ends with the token of step lo + j
            if stop.text in stop.decode(tail[max(0, end - stop.window) : end]):
                hit_rows.append(r)
                hit_steps.append(lo + j)
                break
    return hit_rows, hit_steps
