"""Tokenizers: bytes by default, a local tokenizer.json through `tokenizers` when given."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prefixpool.model.tokenizer import BYTE_EOS, ByteTokenizer, FileTokenizer, TokenizerError, load_tokenizer
from prefixpool.store.keys import TOKEN_DTYPE


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


def test_a_bpe_tokenizer_gives_the_ids_of_the_library_plain_encode(tmp_path):
    """encode skips offsets (the batch fast path); the ids and the int32 array are those of a plain encode."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["the cache holds the prefix", "héllo wörld, 世界 ✓", "prefix caches route by the longest prefix"]
    bpe.train_from_iterator(corpus * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    for text in [*corpus, "", "  spaces\tand\nlines  ", "unseen wörds </s> and specials" * 20]:
        want = bpe.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == want
        assert tokenizer.encode_array(text).tolist() == want and tokenizer.encode_array(text).dtype == TOKEN_DTYPE
