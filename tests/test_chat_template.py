"""ChatTemplate gives the token ids transformers' apply_chat_template gives, and fails as one error.

transformers is the reference: every conversation is encoded by both, from
the same checkpoint directory, and the ids must be equal. All in-process and
offline: the checkpoints are tiny ones written into tmp_path.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest

from inferd.chat_template import ChatTemplate, ChatTemplateError, normalize_messages
from inferd.checkpoint import load_tokenizer
from inferd.tiny import CHAT_TEMPLATE, make_tiny_model

CONVERSATIONS = {
    "system+user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Hello! How are you today?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "Tell me a story about a cat."},
        {"role": "assistant", "content": "Once upon a time a cat learned to fly."},
        {"role": "user", "content": "And then?"},
    ],
    "user only": [{"role": "user", "content": "Hi"}],
    "non-ASCII": [
        {"role": "user", "content": "Grüße aus Köln! 日本語のテキスト, emoji 🚀, Ελληνικά, עברית."},
        {"role": "assistant", "content": "¡Hola! ça va? — «ok» ‘quotes’ \u00a0nbsp\ttab"},
        {"role": "user", "content": "  leading and trailing spaces  \n\n"},
    ],
    "developer": [
        {"role": "developer", "content": "Follow the spec."},
        {"role": "user", "content": "Specials in text: <s> and </s> and <|user|>"},
    ],
}

# Llama 3's template, with its header tokens, a bad-role check and a loop control.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role'] + '. Use system, user, assistant or tool.') }}"
    "{% endif %}"
    "{% if message['content'] == '' %}{% continue %}{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen 2.5's shape: a default system prompt, tools as JSON, a namespace, {% generation %}, break.
CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'stop' %}
        {%- break %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MARKERS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
           "<|im_end|>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place, e.g. <Zürich> & \"Köln\"",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("chat") / "tiny", arch="llama", seed=0)


@pytest.fixture(scope="module")
def marked(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Path:
    """The tiny checkpoint with real templates' markers as special tokens, so they encode as one id each."""
    out = tmp_path_factory.mktemp("chat") / "marked"
    shutil.copytree(tiny, out)
    tokenizer = load_tokenizer(out)
    tokenizer.add_special_tokens(MARKERS)
    tokenizer.save(str(out / "tokenizer.json"))
    # eos_token as older checkpoints write it, an AddedToken object.
    _edit_config(out, bos_token="<|begin_of_text|>", eos_token={
        "__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True})
    return out


@pytest.fixture
def copy_of(tmp_path: Path) -> Callable[[Path], Path]:
    def copy(model_dir: Path) -> Path:
        return Path(shutil.copytree(model_dir, tmp_path / model_dir.name))
    return copy


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _load(model_dir: Path, override: Path | None = None) -> ChatTemplate:
    template = ChatTemplate.from_checkpoint(model_dir, load_tokenizer(model_dir), override)
    assert template is not None
    return template


def _hf_ids(model_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding by default; 4.x returned the list of ids.
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tiny_template_matches_transformers(tiny: Path, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    ids = _load(tiny).encode(messages, add_generation_prompt=add_generation_prompt)
    assert ids == _hf_ids(tiny, messages, add_generation_prompt=add_generation_prompt)


def test_tiny_template_renders_zephyr_style(tiny: Path) -> None:
    template = _load(tiny)
    assert template.source == CHAT_TEMPLATE
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    text = template.render(CONVERSATIONS["system+user"])
    assert text == ("<s><|system|>\nYou are a terse assistant.</s>\n"
                    "<|user|>\nWhat is the capital of France?</s>\n<|assistant|>\n")
    assert template.render(CONVERSATIONS["system+user"], add_generation_prompt=False) == text.removesuffix(
        "<|assistant|>\n")
    ids = template.encode(CONVERSATIONS["system+user"])
    tokenizer = load_tokenizer(tiny)
    # bos once: written by the template, not added again by the tokenizer.
    assert ids[0] == tokenizer.token_to_id("<s>") and ids.count(tokenizer.token_to_id("<s>")) == 1


def test_text_parts_become_one_string(tiny: Path) -> None:
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."},
                                     {"type": "text", "text": "Zweiter Teil ✓"}]},
    ]
    as_strings = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First part.\nZweiter Teil ✓"},
    ]
    template = _load(tiny)
    assert template.render(as_parts) == template.render(as_strings)
    assert template.encode(as_parts) == _hf_ids(tiny, as_strings, add_generation_prompt=True)


def test_messages_are_normalized_like_transformers() -> None:
    messages = [
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}], "reasoning": "hmm"},
    ]
    assert normalize_messages(messages) == [
        {"role": "user", "content": "hi", "name": "alice"},
        {"thinking": "hmm", "role": "assistant", "tool_calls": [{"id": "1", "type": "function"}], "reasoning": "hmm",
         "reasoning_content": "hmm"},
    ]
    assert messages[1]["content"] is None  # the caller's messages are left alone


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", ["system+user", "multi-turn", "non-ASCII"])
@pytest.mark.parametrize("source", [LLAMA3_TEMPLATE, CHATML_TEMPLATE], ids=["llama3", "chatml"])
def test_real_world_templates_match_transformers(marked: Path, tmp_path: Path, source: str, name: str,
                                                 add_generation_prompt: bool) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(source)
    template = _load(marked, override=file)
    messages = CONVERSATIONS[name]
    ids = template.encode(messages, add_generation_prompt=add_generation_prompt)
    assert ids == _hf_ids(marked, messages, chat_template=source, add_generation_prompt=add_generation_prompt)
    tokenizer = load_tokenizer(marked)
    assert any(tokenizer.token_to_id(marker) in ids for marker in MARKERS)


def test_llama3_template_writes_bos_from_the_config(marked: Path, tmp_path: Path) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(LLAMA3_TEMPLATE)
    template = _load(marked, override=file)
    assert (template.bos_token, template.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    messages = [{"role": "user", "content": ""}, {"role": "user", "content": "  Hi  "}]  # the empty one is skipped
    assert template.render(messages) == ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert template.encode(messages) == _hf_ids(marked, messages, chat_template=LLAMA3_TEMPLATE,
                                                add_generation_prompt=True)


def test_tools_render_as_json_like_transformers(marked: Path, tmp_path: Path) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(CHATML_TEMPLATE)
    template = _load(marked, override=file)
    messages = CONVERSATIONS["user only"]
    text = template.render(messages, tools=TOOLS)
    assert 'e.g. <Zürich> & \\"Köln\\""' in text  # not HTML-escaped, not ASCII-escaped
    assert template.encode(messages, tools=TOOLS) == _hf_ids(marked, messages, chat_template=CHATML_TEMPLATE,
                                                             tools=TOOLS, add_generation_prompt=True)
    stopped = [*CONVERSATIONS["multi-turn"][:3], {"role": "stop", "content": ""}, {"role": "user", "content": "x"}]
    assert template.render(stopped, add_generation_prompt=False).endswith("I am fine, thank you.<|im_end|>\n")


def test_override_wins(tiny: Path, tmp_path: Path) -> None:
    file = tmp_path / "override.jinja"
    file.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    template = _load(tiny, override=file)
    assert template.origin == str(file)
    assert template.render(CONVERSATIONS["user only"]) == "[user] Hi\n"
    with pytest.raises(ChatTemplateError, match=r"no-such\.jinja: "):
        ChatTemplate.from_checkpoint(tiny, load_tokenizer(tiny), tmp_path / "no-such.jinja")


def test_chat_template_jinja_wins_over_config_as_in_transformers(tiny: Path, copy_of: Callable[[Path], Path]) -> None:
    model_dir = copy_of(tiny)
    (model_dir / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}|{% endfor %}")
    template = _load(model_dir)
    messages = CONVERSATIONS["multi-turn"]
    assert template.render(messages).startswith("<s>Answer in one sentence.|Hello!")
    assert template.encode(messages) == _hf_ids(model_dir, messages, add_generation_prompt=True)


def test_chat_template_jinja_alone(tiny: Path, copy_of: Callable[[Path], Path]) -> None:
    model_dir = copy_of(tiny)
    _edit_config(model_dir, chat_template=None)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert _load(model_dir).encode(CONVERSATIONS["multi-turn"]) == _load(tiny).encode(CONVERSATIONS["multi-turn"])


def test_named_templates_pick_default(tiny: Path, copy_of: Callable[[Path], Path]) -> None:
    model_dir = copy_of(tiny)
    _edit_config(model_dir, chat_template=[
        {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
        {"name": "rag", "template": "RAG"},
    ])
    template = _load(model_dir)
    assert template.render(CONVERSATIONS["user only"]) == "DEFAULT Hi"
    assert template.encode(CONVERSATIONS["user only"]) == _hf_ids(model_dir, CONVERSATIONS["user only"])

    _edit_config(model_dir, chat_template=[{"name": "tool_use", "template": "TOOLS"}])
    with pytest.raises(ChatTemplateError, match="none 'default'"):
        ChatTemplate.from_checkpoint(model_dir, load_tokenizer(model_dir))


def test_no_template_gives_none(tiny: Path, copy_of: Callable[[Path], Path]) -> None:
    model_dir = copy_of(tiny)
    tokenizer = load_tokenizer(model_dir)
    _edit_config(model_dir, chat_template=None)
    assert ChatTemplate.from_checkpoint(model_dir, tokenizer) is None
    (model_dir / "tokenizer_config.json").unlink()
    assert ChatTemplate.from_checkpoint(model_dir, tokenizer) is None


def test_special_tokens_from_config(tiny: Path, copy_of: Callable[[Path], Path]) -> None:
    model_dir = copy_of(tiny)
    _edit_config(model_dir, bos_token={"__type": "AddedToken", "content": "<s>", "special": True}, eos_token=None,
                 pad_token="</s>", add_bos_token=True)
    template = _load(model_dir)
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "", "pad_token": "</s>"}
    assert template.render(CONVERSATIONS["user only"]) == "<s><|user|>\nHi\n<|assistant|>\n"


def test_raise_exception_is_a_one_line_chat_template_error(marked: Path, tmp_path: Path) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(LLAMA3_TEMPLATE)
    template = _load(marked, override=file)
    messages = [{"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(ChatTemplateError) as caught:
        template.encode(messages)
    assert str(caught.value) == "Unknown role: wizard. Use system, user, assistant or tool."
    with pytest.raises(jinja2.TemplateError, match="wizard"):
        _hf_ids(marked, messages, chat_template=LLAMA3_TEMPLATE)


def test_image_parts_are_refused(tiny: Path) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    with pytest.raises(ChatTemplateError, match=r"^image_url parts are not supported") as caught:
        _load(tiny).encode(messages)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("messages", "match"), [
    ([], "empty"),
    ("hello", "list"),
    (["hello"], r"messages\[0\] is not an object"),
    ([{"role": "user", "content": 3}], "string or a list"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "without a type"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "without a text string"),
])
def test_bad_messages(tiny: Path, messages: Any, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        _load(tiny).encode(messages)


@pytest.mark.parametrize(("source", "messages", "match"), [
    (LLAMA3_TEMPLATE, [{"content": "no role"}], "failed to render: .*role"),
    ("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}], "failed to render: TypeError"),
    ("{{ ''.__class__.__mro__ }}", [{"role": "user", "content": "x"}], "failed to render: .*unsafe"),
    ("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}], "underscore"),
])
def test_render_failures_are_one_line(tiny: Path, tmp_path: Path, source: str, messages: list[dict[str, Any]],
                                      match: str) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(source)
    with pytest.raises(ChatTemplateError, match=match) as caught:
        _load(tiny, override=file).render(messages)
    assert "\n" not in str(caught.value)


def test_a_template_that_does_not_compile(tiny: Path, tmp_path: Path) -> None:
    file = tmp_path / "broken.jinja"
    file.write_text("{% for m in messages %}\n{{ m.content }\n")
    with pytest.raises(ChatTemplateError, match=r"broken.jinja does not compile: line \d+: ") as caught:
        _load(tiny, override=file)
    assert "\n" not in str(caught.value)


def test_generation_tag_and_strftime_now(tiny: Path) -> None:
    source = "{% generation %}{% set x = 1 %}{{ strftime_now('%Y') }}{% endgeneration %}{{ x is defined }}"
    template = ChatTemplate(source, load_tokenizer(tiny))
    years = {str(datetime.now().year - 1), str(datetime.now().year)}
    text = template.render(CONVERSATIONS["user only"])
    assert text[:4] in years and text[4:] == "False"
