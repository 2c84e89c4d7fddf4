"""Tokenizers: bytes by default, a local tokenizer.json through `tokenizers` when given."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from router.contract.tokenizer import BYTE_EOS, ByteTokenizer, FileTokenizer, TokenizerError, load_tokenizer


def test_bytes_round_trip_and_specials_decode_to_nothing():
    tokenizer = load_tokenizer("")
    assert isinstance(tokenizer, ByteTokenizer)
    text = "héllo, 世界 ✓"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tokenizer.decode(ids + [BYTE_EOS, 256]) == text
    assert (tokenizer.eos_token_id, tokenizer.vocab_size) == (257, 259)


def test_the_chat_template_is_the_documented_one():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ByteTokenizer().apply_chat_template(messages) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def write_word_tokenizer(directory):
    vocab = {"[UNK]": 0, "</s>": 1, "<|im_end|>": 2, "hello": 3, "world": 4, "cache": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["</s>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def test_a_local_tokenizer_json_is_used(tmp_path):
    write_word_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, FileTokenizer)
    assert tokenizer.encode("hello cache world") == [3, 5, 4]
    assert tokenizer.encode("hello nope") == [3, 0]
    assert tokenizer.decode([3, 5, 1]) == "hello cache"
    assert tokenizer.vocab_size == 6
    assert tokenizer.eos_token_id == 2                       # "<|im_end|>" comes before "</s>" in the candidates
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_token_id == 1


def test_missing_and_unreadable_paths(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)   # a checkpoint without a tokenizer
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
