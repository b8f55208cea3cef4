"""Tokenizer wrapper: no fixed padding, truncation to max_seq_length, opt-out with a clear error."""

from __future__ import annotations

import pytest

from fusedserve.model.config import UnsupportedModel
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


@pytest.mark.parametrize("name", ["spm.model", "sentencepiece.bpe.model"])
def test_a_sentencepiece_model_without_tokenizer_json_is_refused_by_name(tmp_path, name):
    """DeBERTa-v3 checkpoints often ship spm.model alone: this server reads tokenizer.json only, and says so."""
    (tmp_path / name).write_bytes(b"\x0a\x00")  # its contents are never read
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UnsupportedModel, match=f"{name} without tokenizer.json: .*save_pretrained"):
        TextTokenizer(tmp_path, max_length=128)
    (tmp_path / name).unlink()
    with pytest.raises(UnsupportedModel, match="has no tokenizer.json"):
        TextTokenizer(tmp_path, max_length=128)


TEXTS = ["A man is eating food.", "naïve café, Ω 🙂 (byte fallback)", "", "Fused kernels make encoders fast. " * 8]


@pytest.mark.parametrize(("flags", "bos", "eos"), [
    ({"add_bos_token": True, "add_eos_token": True}, True, True),  # e5-mistral's and Linq-Embed-Mistral's
    ({"add_eos_token": True}, True, True),  # add_bos_token unset: LlamaTokenizerFast's default, true
    ({"add_bos_token": False, "add_eos_token": True}, False, True),
    ({"add_eos_token": False}, None, None),  # tokenizer.json as it is
    ({}, None, None),
], ids=["bos-eos", "eos", "no-bos-eos", "no-eos", "unset"])
def test_the_tokenizer_config_add_eos_token_appends_the_eos(tmp_path, flags, bos, eos):
    """tokenizer_config.json's add_eos_token: true appends the EOS to every text (the token a last-token embedder
    pools), as transformers' LlamaTokenizerFast does with the config's flags, which transformers 5 drops where a
    tokenizer.json exists (the reference gets them as explicit arguments); add_bos_token beside it. Truncation at
    either end keeps both special tokens."""
    from transformers import AutoTokenizer

    from tests.model.checkpoints import llama_tokenizer

    llama_tokenizer(tmp_path, **flags)
    explicit = {} if eos is None else {"add_bos_token": bos, "add_eos_token": eos}
    ours = TextTokenizer(tmp_path, max_length=12)
    for side in ("right", "left"):
        theirs = AutoTokenizer.from_pretrained(str(tmp_path), truncation_side=side, **explicit)
        expected = theirs(TEXTS, truncation=True, max_length=12)["input_ids"]
        assert [e.ids for e in ours.encodings(TEXTS, direction=side)] == expected
    whole = ours.untruncated.encode(TEXTS[0]).ids
    assert (whole[-1] == theirs.eos_token_id) == bool(eos) and (whole[0] == theirs.bos_token_id) == (bos is not False)


def test_add_eos_token_without_an_eos_in_the_vocabulary_is_refused(tmp_path):
    import json

    from fusedserve.model.config import UnsupportedModel
    from tests.model.checkpoints import llama_tokenizer

    llama_tokenizer(tmp_path, add_eos_token=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    with pytest.raises(UnsupportedModel, match="add_eos_token is true but eos_token names no token of the vocabulary "
                                               "\\('<\\|im_end\\|>'\\)"):
        TextTokenizer(tmp_path, max_length=12)
