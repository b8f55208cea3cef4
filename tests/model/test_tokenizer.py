"""Tokenizer wrapper: no fixed padding, truncation to max_seq_length, opt-out with a clear error."""

from __future__ import annotations

import pytest

from fusedserve.model.tokenizer import InputTooLong, TextTokenizer
from fusedserve.model.weights import default_model_dir

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(default_model_dir(), max_length=256)


def test_no_fixed_padding(tokenizer):
    short, = tokenizer.encode(["hello world"])
    assert short == [CLS, 7592, 2088, SEP]


def test_truncates_to_max_length_with_special_tokens(tokenizer):
    ids, = tokenizer.encode(["word " * 1000])
    assert len(ids) == 256 and ids[0] == CLS and ids[-1] == SEP


def test_no_truncation_raises_with_index(tokenizer):
    with pytest.raises(InputTooLong, match="input 1 has 1002 tokens, over the limit of 256") as info:
        tokenizer.encode(["fine", "word " * 1000], truncate=False)
    assert info.value.index == 1
    assert tokenizer.encode(["fine"], truncate=False) == tokenizer.encode(["fine"])


def test_empty_text_is_just_special_tokens(tokenizer):
    assert tokenizer.encode([""]) == [[CLS, SEP]]
