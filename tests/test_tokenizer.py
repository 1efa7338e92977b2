"""model.py's tokenizer: hand-written chat templates against the official Jinja templates, encoding
without a second BOS, atomic special tokens, stop ids and pad id. Tokenizers are built in the test
(ByteLevel BPE with Qwen / Llama 3 specials, and a character-level one like the bundled model's)."""

import json

import pytest

import model as M
from helpers import make_bpe_tokenizer, make_char_tokenizer

# Official chat templates (tokenizer_config.json "chat_template") of Qwen2.5-Instruct, Qwen3 (the
# original hybrid-thinking release) and Llama 3.1-Instruct, kept as fixtures. Rendered here with
# the Jinja settings transformers uses.
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
"""

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
def toks(tmp_path_factory) -> dict[str, M.Tokenizer]:
    root = tmp_path_factory.mktemp("tok")
    return {fam: M.load_tokenizer(make_bpe_tokenizer(root / fam, fam)) for fam in ("qwen2", "qwen3", "llama3")}


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_templates_match_official_jinja(conv, gen, toks):
    """Guards the hand-written templates against the checkpoints' own: a missing Qwen2.5 default
    system turn, Qwen3 thinking kept in history (or not pre-filled when thinking is off), an
    untrimmed Llama 3 content or a wrong header/date block all change the prompt the model sees."""
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
    """Guards the exact prompts recorded in reference/model-compat.md section 2.2 (independent of the
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
    plain = M.load_tokenizer(tmp_path)
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
    tok = M.load_tokenizer(make_char_tokenizer(tmp_path))
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
    tok = M.load_tokenizer(path)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.stop_ids == [im_end, eot] and tok.pad_id == im_end
    (path / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert M.load_tokenizer(path).stop_ids == [eot, im_end]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot, 7]}))
    (path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    tok = M.load_tokenizer(path)
    assert tok.stop_ids == [im_end, eot, 7] and tok.pad_id == eot


def test_missing_or_corrupt_tokenizer(tmp_path):
    """Guards the error a user sees for a wrong --model path or a damaged tokenizer.json: one
    sentence naming the file."""
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json: missing"):
        M.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizers file"):
        M.load_tokenizer(tmp_path)
