"""Text <-> token ids, the same on the router and every worker.

    load_tokenizer("")                 -> ByteTokenizer (ids 0..255 are bytes; 256 <bos>, 257 <eos>, 258 <pad>)
    load_tokenizer("dir" or "x.json")  -> FileTokenizer over a local `tokenizer.json` (the `tokenizers` library);
                                          a directory without one falls back to bytes

The chat template is the model's own Jinja template when its directory has one
(`chat_template.jinja`, or `chat_template` in tokenizer_config.json), rendered
the way transformers and vLLM render it, so a vLLM node computes the very
tokens the router hashed. Otherwise one simple, documented format:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

each message as `<|{role}|>\\n{content}\\n`, then the assistant's open turn.
Nothing is downloaded. Knows nothing of models, keys or workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
EOS_CANDIDATES = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "</s>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer path that does not exist or cannot be read."""


class Tokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


def chat_template(messages: list[dict[str, str]]) -> str:
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids above 255 are specials and decode to nothing."""

    eos_token_id: int | None = BYTE_EOS
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return chat_template(messages)


class FileTokenizer:
    """A `tokenizers` tokenizer read from a local tokenizer.json."""

    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for unreadable files
            raise TokenizerError(f"{path}: cannot read tokenizer: {err}") from err
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config_path = path.parent / "tokenizer_config.json"
        self._config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.eos_token_id = self._eos_id(config_path)
        self._template = JinjaTemplate.find(path.parent, self._config)

    def _eos_id(self, config_path: Path) -> int | None:
        names = list(EOS_CANDIDATES)
        if config_path.is_file():
            eos = json.loads(config_path.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos:
                names.insert(0, eos)
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            return chat_template(messages)
        return self._template.render(messages, _token_text(self._config.get("bos_token")),
                                     _token_text(self._config.get("eos_token")))


def _token_text(token: str | dict | None) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


class JinjaTemplate:
    """A model's Jinja chat template, rendered as transformers does (sandboxed, trim and lstrip blocks)."""

    def __init__(self, source: str) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_template_error
        self._template = environment.from_string(source)

    @classmethod
    def find(cls, directory: Path, config: dict) -> "JinjaTemplate | None":
        path = directory / "chat_template.jinja"
        source = path.read_text() if path.is_file() else config.get("chat_template")
        return cls(source) if isinstance(source, str) and source else None

    def render(self, messages: list[dict[str, str]], bos_token: str, eos_token: str) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                                     eos_token=eos_token)


def _raise_template_error(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def load_tokenizer(path: str | Path = "") -> Tokenizer:
    """A tokenizer.json file, a directory that may hold one, or "" for bytes."""
    if not str(path):
        return ByteTokenizer()
    target = Path(path)
    if not target.exists():
        raise TokenizerError(f"{target}: no such file or directory")
    if target.is_dir():
        target = target / "tokenizer.json"
        if not target.is_file():
            return ByteTokenizer()
    return FileTokenizer(target)
