"""Chunked encoding equals whole encoding, for every pre-tokenizer it accepts, on drawn texts; the rest refused."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from prefixpool.model.chunked_encoding import KNOWN_SPLITS, ChunkedEncoder, cuts, refusal
from prefixpool.model.tokenizer import load_tokenizer
from prefixpool.testing.tiny_llama import train_tokenizer

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>"]
CORPUS = [
    "You are a careful assistant. Answer in one short sentence, using plain words only.",
    "The quick brown fox jumps over the lazy dog's tail; it's 12345 o'clock, isn't it?\n\n",
    "Prefix caching keeps the KEY and Value tensors of shared prompt blocks for later requests.\r\n",
    "Café naïve coöperate ÉCOLE straße 東京 данные λόγος  \t tabs\tand   spaces   ",
    "def f(x):\n    return x  # comment\n<|eot_id|><|im_start|>user\n",
]
FRAGMENTS = [
    "a b", "the cat", " dog", "A B", "x's y", "it's", "don't", "'re", "'ll ", "I'M", "word", "Word", "WORD",
    "  ", " ", "\n", "\r\n", "\t", "\n\n  ", "123", "4567 89", "3.14", "!!", "?!", " ,", ". ", "...", "--",
    "é", "e\u0301", "\u0301", "ß", "東京", "Ω", "ǅ", "ʰ", "٣", "²", "<|eot_id|>", "<|im_start|>", "<|", "|>",
    "a<|eot_id|>b", "q\u200b", "/", "a/b", "z z", "Q Q", "a  b", "a\nb", "a \nb", "a \tb",
    ". ", ") {", "7 ", "\ufffd ", "\ufffd\ufffd", "x\x1c y", "\x1f ", "\xa0 ", "\x85 ", "\u2028 ", "\u180e ",
    "\u200b ", "\ufeff ", "\u3000 ", "' ", "'s ", "\u0301 ", "e\u0301 x", "\r ", "\n ", "\t ",
]
TEXTS = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), min_size=1, max_size=60).map("".join)


def byte_level_bpe(pre_tokenizer, normalizer=None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


ACCEPTED = {
    "gpt2 byte-level": byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "tiny llama (bench)": train_tokenizer(384),
    **{name: byte_level_bpe(split_then_bytes(pattern)) for name, pattern in KNOWN_SPLITS.items()},
    "cl100k + NFC": byte_level_bpe(split_then_bytes(KNOWN_SPLITS["cl100k (Llama 3)"]), normalizers.NFC()),
}


def whole(tokenizer: Tokenizer):
    return lambda texts: [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_each_accepted_tokenizer_is_accepted(name):
    assert refusal(json.loads(ACCEPTED[name].to_str())) is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, min_chars=st.integers(1, 12), name=st.sampled_from(list(ACCEPTED)))
def test_chunked_ids_equal_whole_ids(text, min_chars, name):
    encode = whole(ACCEPTED[name])
    encoder = ChunkedEncoder(encode, min_chars=min_chars)
    expected = encode([text])[0]
    assert encoder.encode(text).tolist() == expected
    assert encoder.encode(text).tolist() == expected  # again, every chunk from the cache
    num_chunks = len(cuts(text, min_chars)) + 1
    assert num_chunks == 1 or encoder.num_hits >= num_chunks  # one chunk: encoded whole, nothing kept


@settings(max_examples=100, deadline=None)
@given(shared=TEXTS, tails=st.lists(TEXTS, min_size=2, max_size=4))
def test_texts_sharing_a_beginning_reuse_its_chunks_and_stay_exact(shared, tails):
    tokenizer = ACCEPTED["cl100k (Llama 3)"]
    encode = whole(tokenizer)
    encoder = ChunkedEncoder(encode, min_chars=3)
    for tail in tails:
        assert encoder.encode(shared + tail).tolist() == encode([shared + tail])[0]
    full_chunks = [b for b in cuts(shared, 3) if b + 1 < len(shared)]  # cuts that do not depend on the tail
    assert encoder.num_hits >= (len(tails) - 1) * len(full_chunks)


def test_missing_chunks_are_encoded_one_call_each():
    """A batch of two or more runs on the tokenizer's thread pool, whose wake-up costs more than the work."""
    encode = whole(ACCEPTED["cl100k (Llama 3)"])
    calls: list[list[str]] = []
    encoder = ChunkedEncoder(lambda texts: calls.append(list(texts)) or encode(texts), min_chars=4)
    text = "one two three four five six seven eight nine ten"
    assert encoder.encode(text).tolist() == encode([text])[0]
    assert len(calls) == len(cuts(text, 4)) + 1 >= 5 and all(len(batch) == 1 for batch in calls)


def test_cuts_are_content_defined_and_before_a_space_after_non_whitespace():
    text = "alpha beta, gamma (delta) epsilon: 42 zeta? \ufffd eta  theta\t iota\u00a0 kappa lambda mu"
    found = cuts(text, 10)
    assert found and all(text[b] == " " and not text[b - 1].isspace() for b in found)
    assert all(b - a >= 10 for a, b in zip([0, *found], found))
    assert cuts(text + " and then something else entirely", 10)[: len(found) - 1] == found[:-1]
    assert cuts("1 2 3 4 5 6 7 8 9 0 ! ? . , ; :" * 4, 2)  # digits and punctuation cut too
    assert cuts("\u200b \ufeff \u180e \x1c \u3000 \u2028 \xa0 \t \n " * 4, 1) == []  # never after whitespace


def test_random_token_text_cuts_often():
    """vLLM's benchmark datasets decode random token ids; most of such a text is now cached chunks."""
    tokenizer = ACCEPTED["tiny llama (bench)"]
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, tokenizer.get_vocab_size(), 512).tolist()
    encode = whole(tokenizer)
    encoder = ChunkedEncoder(encode)
    texts = [tokenizer.decode(prefix + rng.integers(3, tokenizer.get_vocab_size(), 32).tolist()) for _ in range(4)]
    for text in texts:
        assert encoder.encode(text).tolist() == encode([text])[0]
    assert len(cuts(texts[0])) >= len(texts[0]) // 200
    assert encoder.num_hits >= 3 * (len(cuts(texts[0])) - 2)


@pytest.mark.parametrize("words", ["данные модель запрос ответ кэш", "λόγος δεδομένα μοντέλο αίτημα",
                                   "डेटा मॉडल अनुरोध उत्तर सर्वर", "{'a': 1, 'b': [2, 3]} x = f(y) + 1"])
def test_text_without_ascii_words_is_cut_and_reused(words):
    """Scripts other than Latin, JSON and code cut too (before, only "ASCII letter|space ASCII letter" did)."""
    encode = whole(ACCEPTED["cl100k (Llama 3)"])
    encoder = ChunkedEncoder(encode, min_chars=16)
    shared = " ".join([words] * 20)
    for tail in (" один?", " δύο?", " 3?"):
        assert encoder.encode(shared + tail).tolist() == encode([shared + tail])[0]
    assert len(cuts(shared, 16)) >= 10 and encoder.num_hits >= 2 * (len(cuts(shared, 16)) - 1)


def test_the_cache_is_bounded_and_keeps_the_recently_used():
    encode = whole(ACCEPTED["gpt2 byte-level"])
    encoder = ChunkedEncoder(encode, min_chars=4, max_chunks=3)
    encoder.encode("aaaa bbbb cccc dddd")  # chunks "aaaa", " bbbb", " cccc", " dddd": the oldest leaves
    assert len(encoder._cache) == 3 and "aaaa" not in encoder._cache
    encoder.encode("xxxx bbbb")
    assert list(encoder._cache) == [" dddd", " bbbb", "xxxx"]  # " bbbb" was used again: " cccc" left


def test_a_chunk_longer_than_max_chars_is_encoded_but_not_kept():
    encode = whole(ACCEPTED["gpt2 byte-level"])
    encoder = ChunkedEncoder(encode, min_chars=4, max_chars=8)
    text = "abcd efgh" + "1234567890" * 5 + "x y"  # chunks "abcd", " efgh1234...890x", " y"
    assert encoder.encode(text).tolist() == encode([text])[0]
    assert sorted(encoder._cache) == [" y", "abcd"]


def test_a_checkpoint_tokenizer_encodes_in_chunks_with_the_same_ids(tmp_path):
    path = tmp_path / "tokenizer.json"
    ACCEPTED["cl100k (Llama 3)"].save(str(path))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.chunk_refusal is None
    text = " ".join(CORPUS) * 3
    ids = tokenizer.encode_array(text)
    assert ids.dtype == np.dtype("<i4") and ids.tolist() == whole(ACCEPTED["cl100k (Llama 3)"])([text])[0]
    assert tokenizer.encode(text) == ids.tolist() and tokenizer.encode_array(text).tolist() == ids.tolist()
    assert tokenizer._chunked.num_hits > 0


def refused_spec(**changes) -> dict:
    spec = json.loads(ACCEPTED["cl100k (Llama 3)"].to_str())
    spec.update(changes)
    return spec


@pytest.mark.parametrize("spec, why", [
    (json.loads(Tokenizer(models.BPE()).to_str()), "no pre-tokenizer"),
    (refused_spec(normalizer={"type": "Lowercase"}), "normalizer Lowercase"),
    (refused_spec(truncation={"max_length": 8}), "truncation"),
    (refused_spec(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}), "Metaspace"),
    (refused_spec(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}), "prefix space"),
    (refused_spec(pre_tokenizer=json.loads(byte_level_bpe(split_then_bytes(r"\w+|\s+|[^\w\s]+")).to_str())[
        "pre_tokenizer"]), "not known"),
    (refused_spec(model={"type": "WordPiece"}), "model WordPiece"),
    (refused_spec(model={"type": "BPE", "dropout": 0.1}), "dropout 0.1"),
])
def test_other_tokenizers_are_refused_with_a_reason(spec, why):
    assert why in (refusal(spec) or "")


def test_an_added_token_that_strips_or_holds_a_space_is_refused():
    tokenizer = byte_level_bpe(split_then_bytes(KNOWN_SPLITS["Qwen2"]))
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert "strips" in refusal(json.loads(tokenizer.to_str()))
    spaced = byte_level_bpe(split_then_bytes(KNOWN_SPLITS["Qwen2"]))
    spaced.add_tokens(["new york"])
    assert "space" in refusal(json.loads(spaced.to_str()))
