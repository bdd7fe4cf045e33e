"""A checkpoint's chat template, rendered and tokenized the way `transformers` does it.

An OpenAI-style chat request must become the very token ids that
`tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)` gives, or the model sees a prompt it was not trained on and
answers worse, quietly. So the Jinja environment copies the one in
transformers' `utils/chat_template_utils.py` (`_compile_jinja_template`):
sandboxed, trim_blocks and lstrip_blocks on, loop controls, its `tojson`,
`raise_exception`, `strftime_now`, `dict` and `namespace`, and a `{% generation %}`
tag. The rendered text is then tokenized without adding special tokens, since the
template writes them itself. transformers is not needed at run time; only
Jinja2 and the `tokenizers` library.

Everything a request can get wrong, and everything a template can raise,
comes out as one ChatTemplateError with a one-line message, which the HTTP
layer answers with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# The named special tokens transformers hands every template (`special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Where transformers looks for a message's reasoning, the standard name first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that does not compile or render, or messages it cannot take: the client's 400."""


class ChatTemplate:
    """A compiled chat template with the special tokens and tokenizer it renders for."""

    def __init__(self, source: str, tokenizer: Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 origin: str = "chat template") -> None:
        # Compiled here, not per request, so that a broken template stops inferd at start-up.
        self.source = source
        self.origin = origin
        self.tokenizer = tokenizer
        tokens = dict(special_tokens or {})
        self.special_tokens = {"bos_token": tokens.pop("bos_token", ""), "eos_token": tokens.pop("eos_token", ""),
                               **tokens}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin} does not compile: line {exc.lineno}: {_one_line(exc.message)}") from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin} does not compile: {_one_line(exc)}") from None

    @property
    def bos_token(self) -> str:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str:
        return self.special_tokens["eos_token"]

    @classmethod
    def from_checkpoint(cls, model_dir: Path, tokenizer: Tokenizer,
                        override: Path | None = None) -> ChatTemplate | None:
        """The template transformers would use for `model_dir`, or `override` (`--chat-template FILE`) if given.

        None when the checkpoint has no template: base models often have none, and
        guessing one would give a prompt format the model never saw.

        The order is transformers': a `chat_template.jinja` file wins over the
        `chat_template` entry of tokenizer_config.json (checkpoints saved by newer
        transformers have only the file, older ones only the entry). A list of
        named templates gives the one named "default", as it does for
        apply_chat_template without `tools`.
        """
        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        special_tokens = _special_tokens(config, model_dir / "special_tokens_map.json")
        if override is not None:
            return cls(_read_text(override), tokenizer, special_tokens=special_tokens, origin=str(override))
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(_read_text(jinja_path), tokenizer, special_tokens=special_tokens, origin=str(jinja_path))
        source = _default_template(config.get("chat_template"), config_path)
        if source is None:
            return None
        return cls(source, tokenizer, special_tokens=special_tokens, origin=f"{config_path}'s chat_template")

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text; `extra` become template variables too (`tools=[...]`, `enable_thinking=False`).

        Like apply_chat_template, `tools` and `documents` are None unless given,
        and `extra` may override a special token.
        """
        variables = {**self.special_tokens, "tools": None, "documents": None, **_plain(extra),
                     "messages": normalize_messages(messages), "add_generation_prompt": add_generation_prompt}
        # The messages are a client's to fix, so these errors name no server path (origin).
        try:
            return self._template.render(variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {_one_line(exc)}") from None
        except Exception as exc:
            # The template is the checkpoint's code, run on the client's messages: whatever it
            # raises ('a' + 1, a bad index) means these messages cannot be rendered.
            raise ChatTemplateError(
                f"chat template failed to render: {type(exc).__name__}: {_one_line(exc)}") from None

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> list[int]:
        """The prompt's token ids.

        Special tokens are not added again: the template writes bos_token itself,
        and transformers encodes a rendered chat with add_special_tokens=False too,
        so a tokenizer whose post-processor prepends <s> would otherwise give two.
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as a template expects them.

    Content given as text parts becomes one string, since most templates
    concatenate `message['content']` as a string; the parts are joined by a
    newline, as vLLM and TensorRT-LLM join them, so a client gets the prompt it
    would get there. Other parts (images, audio) have nothing to become here.
    As in apply_chat_template, keys whose value is None are dropped (OpenAI
    clients send `"content": null` next to tool calls, which many templates
    would print as "None"), and reasoning is also given under the names
    templates read it by. Roles are not checked: the template decides.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is not an object")
        message = {str(key): _plain(value) for key, value in message.items() if value is not None}
        if "content" in message:
            message["content"] = _content_text(message["content"], i)
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{i}].content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ChatTemplateError(f"messages[{i}].content has a part without a type")
        if kind != "text":
            raise ChatTemplateError(f"{_one_line(kind)[:40]} parts are not supported (messages[{i}]): only text")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"messages[{i}].content has a text part without a text string")
        texts.append(part["text"])
    return "\n".join(texts)


def _plain(value: Any) -> Any:
    # Only JSON types reach the template, as in transformers: objects with methods the
    # sandbox does not know about (a pydantic model's, say) stay out of its reach.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _default_template(entry: Any, config_path: Path) -> str | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(t, dict) and "name" in t and "template" in t for t in entry):
        entry = {t["name"]: t["template"] for t in entry}
    if isinstance(entry, dict):
        if isinstance(entry.get("default"), str):
            return entry["default"]
        raise ChatTemplateError(f"{config_path}: chat_template names {', '.join(map(str, entry))} "
                                "but none 'default' (pass one with --chat-template)")
    raise ChatTemplateError(f"{config_path}: chat_template is neither a string nor a list of named templates")


def _special_tokens(config: Mapping[str, Any], legacy_map: Path) -> dict[str, str]:
    # Newer transformers also hands the template any other `*_token` string of the config
    # (image_token, ...); special_tokens_map.json is where older checkpoints kept them.
    tokens: dict[str, str] = {}
    sources = [config]
    if legacy_map.is_file():
        sources.append(_read_json(legacy_map))
    for source in sources:
        for name, value in source.items():
            if name in tokens or not name.endswith("_token"):
                continue
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                tokens[name] = value
    return tokens


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ChatTemplateError(f"{path}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: not a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path}: {_one_line(exc)}") from None


def _one_line(message: object) -> str:
    return " ".join(str(message).split()) or "(no message)"


def _raise_exception(message: object) -> None:
    # The template's own words, e.g. "Conversation roles must alternate user/assistant/user/assistant/...".
    raise ChatTemplateError(_one_line(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    # The global `dict` as transformers gives it: no class to climb out of the sandbox through.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # transformers refuses underscore names on a namespace: they reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore names like {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    # transformers marks the assistant's text with {% generation %}...{% endgeneration %} to build
    # training masks; templates that carry it must still parse, and the block renders as it is. A
    # call block, as in transformers, gives its body a scope of its own.
    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now, "dict": _Dict(),
                    "namespace": _Namespace}
    return env
