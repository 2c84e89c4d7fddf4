"""Text <-> token ids, the same on the router and every worker.

    load_tokenizer("")                 -> ByteTokenizer (ids 0..255 are bytes; 256 <bos>, 257 <eos>, 258 <pad>)
    load_tokenizer("dir" or "x.json")  -> FileTokenizer over a local `tokenizer.json` (the `tokenizers` library);
                                          a directory without one falls back to bytes. A byte-level BPE
                                          one encodes long texts in chunks it keeps (chunked_encoding.py:
                                          the same ids, repeated prefixes not split and merged again)

Chat messages become text through the checkpoint's own chat template
(tokenizer_config.json or chat_template.jinja, rendered as transformers does:
chat_template.py); a checkpoint without one refuses chat requests. Only the
byte tokenizer of the presets uses a fixed, documented format:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

each message as `<|{role}|>\\n{content}\\n`, then the assistant's open turn.
Rendered text is encoded without adding special tokens (the template writes
them), as apply_chat_template(tokenize=True) does. Nothing is downloaded.
Knows nothing of models, keys or workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from prefixpool.model.chat_template import ChatTemplate, ChatTemplateError, read_chat_template
from prefixpool.model.chunked_encoding import ChunkedEncoder, refusal
from prefixpool.store.keys import TOKEN_DTYPE

BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
EOS_CANDIDATES = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "</s>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer path that does not exist or cannot be read."""


class Tokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> np.ndarray: ...  # int32 ids, ready for the block hash
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

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return chat_template(messages)


class FileTokenizer:
    """A `tokenizers` tokenizer read from a local tokenizer.json."""

    def __init__(self, path: Path, template: ChatTemplate | None = None) -> None:
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for unreadable files
            raise TokenizerError(f"{path}: cannot read tokenizer: {err}") from err
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._eos_id(path.parent / "tokenizer_config.json")
        self.template = template
        self.chunk_refusal = refusal(json.loads(self._tokenizer.to_str()))  # None: encodes in chunks
        self._chunked = None if self.chunk_refusal else ChunkedEncoder(self._encode_batch)

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

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # the batch "fast" path skips character offsets, which nothing here reads (the same ids;
        # measured 40 vs 53 ms for 19.5k tokens of the tiny checkpoint's BPE tokenizer)
        return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist() if self._chunked else self._encode_batch([text])[0]

    def encode_array(self, text: str) -> np.ndarray:
        if self._chunked:
            return self._chunked.encode(text)
        return np.array(self._encode_batch([text])[0], dtype=TOKEN_DTYPE)

    def decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.template is None:
            raise ChatTemplateError("this model's checkpoint has no chat_template (tokenizer_config.json or "
                                    "chat_template.jinja); send a prompt to /v1/completions instead")
        return self.template.render(messages)


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
    return FileTokenizer(target, read_chat_template(target.parent))
