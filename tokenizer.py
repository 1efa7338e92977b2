"""The tokenizer: a `tokenizers.Tokenizer` with the checkpoint's chat template written by hand (no
Jinja), its stop ids and pad id, and the completion text that rewards see.

Built-in chat templates, chosen from the tokenizer's special tokens:
* ChatML as Qwen2.5-Instruct renders it: a default system turn ("You are Qwen, ...") when the
  conversation has none.
* ChatML as Qwen3 renders it (the tokenizer has a <think> token): no default system turn, thoughts
  dropped from assistant turns before the last user turn, and the thinking switch: enable_thinking=False
  pre-fills an empty <think></think> block, so the model answers without thinking.
* ChatML as Qwen3.5/3.6 renders it (their 248k vocabulary): contents trimmed, a system turn only first,
  thoughts dropped before the last user query and shown (empty if none) after it, and the generation
  prompt opens a thought (<think>\n), or pre-fills an empty one with enable_thinking=False. The 0.8B/2B/4B
  template (thinking off by default, THINKING_OFF_BY_DEFAULT) is recognised as the same. No tool declarations.
* Llama 3.1 Instruct's header format: BOS, a system header with the knowledge cut-off and a date
  pinned to 26 Jul 2024 (the template's default), contents trimmed.
Each reproduces its official Jinja template exactly (tests/test_tokenizer.py renders both). A
checkpoint whose own template (tokenizer_config.json's chat_template, or chat_template.jinja) is not
the one reproduced gets a warning naming the built-in used instead (for Qwen3.8's, what differs).
"""

import hashlib
import itertools
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from hf import read_json

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA3_DATE = "26 Jul 2024"  # Llama 3.1's default; pinned so a prompt never changes with the calendar
QWEN35_IM_START = 248045  # <|im_start|>'s id in Qwen3.5/3.6's vocabulary (248,044 BPE ranks, then the specials)
# sha256 of the official templates the renderers reproduce (the Jinja text, stripped) -> built-in style
REPRODUCED = {
    "55b2f4a26ac9ee719330a61a0c39d9e538b0e9322212f048326318cff4f8674a": "qwen2.5",  # Qwen2.5-Instruct
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3",  # Qwen3 (hybrid thinking)
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3.5",  # Qwen3.5 (thinking by default)
    "93c0e9aa3629bbd77e68dbc0f5621f6e6b23aa8d74b932595cdb8d64684526d7": "llama3",  # Llama 3.1 Instruct
}
BUILT_IN_NAMES = {
    "qwen2.5": "ChatML as Qwen2.5-Instruct renders it",
    "qwen3": "ChatML as Qwen3 renders it",
    "qwen3.5": "ChatML as Qwen3.5 renders it",
    "llama3": "Llama 3.1 Instruct's header format",
}


def _render_chatml(messages: list[dict], add_generation_prompt: bool, enable_thinking: bool, qwen3: bool) -> str:
    """Qwen2.5 (default system turn injected) or Qwen3 (no default system; thinking stripped from
    assistant turns before the last user turn; enable_thinking=False pre-fills an empty think block)."""
    out = []
    if not qwen3 and (not messages or messages[0]["role"] != "system"):
        out.append(f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role in ("system", "user") or (role == "assistant" and not qwen3):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or ""
            if "</think>" in content and not reasoning:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            if "</think>" in content:
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_user and (i == len(messages) - 1 or reasoning):  # the turn being generated keeps its thought
                content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
            out.append(f"<|im_start|>assistant\n{content}<|im_end|>\n")
        else:
            raise ValueError(f"apply_chat_template: role {role!r} is not supported (system, user, assistant).")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if qwen3 and not enable_thinking else ""))
    return "".join(out)


def _render_qwen35(messages: list[dict], add_generation_prompt: bool, enable_thinking: bool) -> str:
    """Qwen3.5/3.6: contents trimmed; the system turn only first; an assistant turn after the last user query
    shows its thought, an empty one if it has none; before that query, thoughts are dropped. The generation
    prompt opens the thought (enable_thinking) or pre-fills an empty one. A user turn that is a wrapped
    <tool_response> is not a query."""
    text = [(m.get("content") or "").strip() for m in messages]
    queries = [i for i, m in enumerate(messages) if m["role"] == "user" and not _is_tool_response(text[i])]
    if not queries:
        raise ValueError("apply_chat_template: Qwen3.5's template needs a user message.")
    out = []
    for i, (m, content) in enumerate(zip(messages, text)):
        role, reasoning = m["role"], m.get("reasoning_content")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"apply_chat_template: role {role!r} is not supported (system, user, assistant).")
        if m.get("tool_calls"):
            raise ValueError("apply_chat_template: tool calls are not supported in the built-in templates.")
        if role == "system" and i > 0:
            raise ValueError("apply_chat_template: Qwen3.5's template takes a system message only at the beginning.")
        if role == "assistant" and not isinstance(reasoning, str):
            reasoning = ""
            if "</think>" in content:  # the thought written inline in the content
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        if role == "assistant" and i > queries[-1]:
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content}"
        out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n"))
    return "".join(out)


def _is_tool_response(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _style(template: str | None, tok) -> str | None:
    """The built-in renderer (a key of BUILT_IN_NAMES) for a chat format and vocabulary."""
    if template != "chatml":
        return template
    if tok.token_to_id("<|im_start|>") == QWEN35_IM_START:
        return "qwen3.5"
    return "qwen3" if tok.token_to_id("<think>") is not None else "qwen2.5"


def _render_llama3(messages: list[dict], add_generation_prompt: bool) -> str:
    """Llama 3.1/3.2 Instruct: BOS, an always-present system header with a fixed date, trimmed contents."""
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    out = [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {LLAMA3_DATE}\n\n{system}<|eot_id|>"
    ]
    for m in messages:
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"apply_chat_template: role {m['role']!r} is not supported (system, user, assistant).")
        out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


class Tokenizer:
    """A tokenizers.Tokenizer plus the checkpoint's chat template and stop ids."""

    def __init__(self, tok, template: str | None, stop_ids: list[int], pad_id: int, enable_thinking: bool = True):
        self.tok = tok
        self.template = template  # "chatml" | "llama3" | None (no known chat format)
        self.thinking = tok.token_to_id("<think>") is not None  # the thinking switch exists (Qwen3, Qwen3.5)
        self.style = _style(template, tok)  # the built-in renderer: a key of BUILT_IN_NAMES, or None
        self.enable_thinking = enable_thinking  # Qwen3's switch, apply_chat_template's default
        self.stop_ids = stop_ids
        # The token that closes an assistant turn in this chat format (a written-out reference completion
        # ends with it, as a sampled one does); without a known format, the first stop id.
        end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}.get(template or "")
        self.end_id = tok.token_to_id(end) if end else (stop_ids[0] if stop_ids else None)
        self.pad_id = pad_id
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Never add special tokens: Llama 3's post-processor would put a second BOS in front of
        # rendered chat text, which already starts with one. Special tokens in text stay atomic.
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def turn_opening(self) -> str:
        """What the generation prompt writes after the assistant header "<|im_start|>assistant\n": Qwen3.5's
        "<think>\n", enable_thinking=False's empty thought, else "" (and "" outside ChatML). A tool's <tool_response>
        turn is followed by it, as the template's generation prompt after a tool message (methods/tools.py)."""
        if self.template != "chatml":
            return ""
        return self.apply_chat_template([{"role": "user", "content": "x"}]).rsplit("<|im_start|>assistant\n", 1)[1]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool | None = None
    ) -> str:
        """The conversation as the checkpoint's chat format renders it; enable_thinking: Qwen3's
        switch (None: the tokenizer's own setting, load_tokenizer's enable_thinking)."""
        thinking = self.enable_thinking if enable_thinking is None else enable_thinking
        if self.style == "qwen3.5":
            return _render_qwen35(messages, add_generation_prompt, thinking)
        if self.template == "chatml":
            return _render_chatml(messages, add_generation_prompt, thinking, qwen3=self.style == "qwen3")
        if self.template == "llama3":
            return _render_llama3(messages, add_generation_prompt)
        raise ValueError(
            "apply_chat_template: this tokenizer has neither <|im_start|> nor <|start_header_id|>, "
            "so no chat format is known."
        )


def _ids(x: int | list[int] | None) -> list[int]:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def load_tokenizer(path: str | os.PathLike, enable_thinking: bool = True) -> Tokenizer:
    """tokenizer.json from an HF directory. Chat format from the special tokens; stop ids from
    generation_config.json, else config.json, else the format's end tokens, always including the
    format's end-of-turn token (a base model prompted with ChatML ends its turn with <|im_end|>).
    enable_thinking=False (Qwen3's thinking switch off) needs a Qwen3-style tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found.")
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; load_tokenizer needs a tokenizers tokenizer.json.")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{file}: not a valid tokenizers file ({e}).") from None
    cfg = read_json(path / "config.json") if (path / "config.json").is_file() else {}
    gen = read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    if tok.token_to_id("<|im_start|>") is not None:
        template, ends = "chatml", ["<|im_end|>", "<|endoftext|>"]
    elif tok.token_to_id("<|start_header_id|>") is not None:
        template, ends = "llama3", ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
    else:
        template, ends = None, []
    end_ids = [i for i in map(tok.token_to_id, ends) if i is not None]
    stop_ids = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id")) or end_ids
    if end_ids and end_ids[0] not in stop_ids:
        stop_ids.append(end_ids[0])
    tcfg = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    pad = tcfg.get("pad_token")
    pad_id = tok.token_to_id(pad.get("content", "") if isinstance(pad, dict) else pad) if pad else None
    if pad_id is None:
        pad_id = cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else (stop_ids or [0])[0]
    tokenizer = Tokenizer(tok, template, stop_ids, pad_id, enable_thinking)
    qwen3 = template == "chatml" and tokenizer.thinking
    if not enable_thinking and not qwen3:
        raise ValueError(
            f"{path}: enable_thinking=False (--no-enable-thinking) is Qwen3's switch and needs ChatML with a "
            "<think> token; this tokenizer has none."
        )
    if template is not None:
        warn_if_not_reproduced(path, own_template(path, tcfg), tokenizer.style)
    return tokenizer


def own_template(path: Path, tcfg: dict) -> str | None:
    """The checkpoint's Jinja chat template: chat_template.jinja, else tokenizer_config.json's
    chat_template (a string, or a list of named templates of which "default" is used)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    own = tcfg.get("chat_template")
    if isinstance(own, list):
        own = next((t.get("template") for t in own if isinstance(t, dict) and t.get("name") == "default"), None)
    return own if isinstance(own, str) else None


# Qwen3.5-0.8B/2B/4B's template is the larger models' with its generation prompt's thinking default turned off: the
# same text with this branch swapped. Either default renders what --enable-thinking / --no-enable-thinking ask for.
THINKING_OFF_BY_DEFAULT = (
    "    {%- if enable_thinking is defined and enable_thinking is true %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}"
)
THINKING_ON_BY_DEFAULT = (
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif %}"
)


def reproduced_style(own: str) -> str | None:
    """The built-in style that renders this official template (REPRODUCED), the thinking default aside; or None."""
    own = own.strip().replace(THINKING_OFF_BY_DEFAULT, THINKING_ON_BY_DEFAULT)
    return REPRODUCED.get(hashlib.sha256(own.encode()).hexdigest())


def warn_if_not_reproduced(path: Path, own: str | None, built_in: str) -> None:
    """A warning, at load, when the checkpoint has a chat template of its own that the
    built-in renderer does not reproduce: its prompts are the built-in's, and may differ from it."""
    if own is None or reproduced_style(own) == built_in:
        return
    knobs = [k for k in ("reasoning_effort", "preserve_thinking") if k in own]  # Qwen3.8's (docs/real-models.md)
    said = f", which ignores its {' and '.join(knobs)}: no reasoning-effort line in the system turn (Qwen3.8's adds"
    differs = said + " one at its default, xhigh) and earlier turns' thoughts always dropped" if knobs else ""
    warnings.warn(
        f"{path}: the checkpoint's own chat template is not one tokenizer.py reproduces; prompts use the "
        f"built-in {BUILT_IN_NAMES[built_in]} instead{differs}.",
        stacklevel=2,
    )


def decode_completion(tokenizer: Tokenizer, tokens: list[int], context: Sequence[bool] = ()) -> str:
    """Completion text as rewards see it: the policy's own tokens before its first stop token. context: per token,
    True where it was appended (a tool's output, multiturn.py): each such run reads as one "\\n" (observations are
    context, never the policy's answer, whatever they print), and its stop tokens end nothing (Qwen's
    <tool_response> turn holds an <|im_end|>)."""
    stops, own = set(tokenizer.stop_ids), list(context) + [False] * (len(tokens) - len(context))
    end = next((i for i, t in enumerate(tokens) if t in stops and not own[i]), len(tokens))
    runs = itertools.groupby(zip(tokens[:end], own[:end]), key=lambda pair: pair[1])  # the policy's, an observation
    return "".join("\n" if appended else tokenizer.decode([t for t, _ in run]) for appended, run in runs)
