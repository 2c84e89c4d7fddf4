"""A checkpoint's own chat template, rendered with jinja2 the way transformers' apply_chat_template does.

    <dir>/chat_template.jinja                      the template (transformers 5 writes it here) ...
    <dir>/tokenizer_config.json  "chat_template"   ... or here: a string, or [{"name", "template"}] (the "default")
                                 "bos_token", ...  special tokens the template sees, strings or {"content": ...}

Same environment as transformers: a sandbox with trim_blocks and lstrip_blocks,
loop controls, `tojson` without HTML escaping, `raise_exception`, `strftime_now`
and the `{% generation %}` tag (rendered as its body). Variables: `messages`,
`add_generation_prompt`, and the special tokens. A template that raises (say,
roles that do not alternate) gives a ChatTemplateError with its message, a
client error. Knows nothing of token ids, models or HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """A template that cannot be read, or that refuses these messages."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_compiled", _environment().from_string(self.source))
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ChatTemplateError(f"chat_template does not parse: {err}") from err

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"the model's chat template refused the messages: {err}") from err


def read_chat_template(directory: Path) -> ChatTemplate | None:
    """The directory's chat template with its special tokens, or None when it has none."""
    config_path = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except json.JSONDecodeError as err:
        raise ChatTemplateError(f"{config_path}: {err}") from err
    template_file = directory / TEMPLATE_FILE
    source = template_file.read_text() if template_file.is_file() else _named_default(config.get("chat_template"))
    if source is None:
        return None
    tokens = {name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    return ChatTemplate(source, tokens)


def _named_default(template: str | list[dict[str, str]] | None) -> str | None:
    if template is None or isinstance(template, str):
        return template
    named = {entry.get("name"): entry.get("template") for entry in template}
    if "default" not in named:
        raise ChatTemplateError(f"tokenizer_config.json chat_template has no 'default' among {sorted(named)}")
    return named["default"]


def _content(token: str | dict[str, Any]) -> str:
    return token["content"] if isinstance(token, dict) else str(token)
