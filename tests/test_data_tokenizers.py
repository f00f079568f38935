"""Tokenizers: the bundled GPT-2 BPE (token counts of the bundled sample), Llama 3 layout, bad files."""

import base64
import dataclasses
import gzip
import hashlib
import json
import sys

import numpy as np
import pytest

from fp4jax.data import DataError, load_tokenizer
from fp4jax.data.assets import BUNDLED_DATA_DIR
from fp4jax.data.tokenizers import LLAMA3_ENV, MAX_RUN

# c4_en_sample/SOURCE.md: GPT-2 tokens per file, encode_ordinary of each text, no EOD.
BUNDLED_GPT2_TOKENS = {
    "c4-train.00000-of-00002.json.gz": 442_918,
    "c4-train.00001-of-00002.json.gz": 91_120,
    "c4-validation.00000-of-00001.json.gz": 478_224,
}
LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"


def _texts(name):
    with gzip.open(BUNDLED_DATA_DIR / name, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_gpt2_layout(gpt2):
    assert (gpt2.name, gpt2.vocab_size, gpt2.eod_id) == ("gpt2", 50257, 50256)
    assert gpt2.token_dtype == np.uint16
    assert gpt2.encode("hello world") == [31373, 995]


@pytest.mark.parametrize("name", sorted(BUNDLED_GPT2_TOKENS))
def test_gpt2_counts_of_bundled_files(gpt2, name):
    texts = _texts(name)
    ids = gpt2.encode_documents(texts)
    assert len(ids) - len(texts) == BUNDLED_GPT2_TOKENS[name]
    assert int(np.sum(ids == gpt2.eod_id)) == len(texts)  # no document contains an EOD of its own
    assert gpt2.decode(gpt2.encode(texts[0])) == texts[0]


def test_special_token_text_is_plain_text(gpt2):
    ids = gpt2.encode("a<|endoftext|>b")
    assert gpt2.eod_id not in ids
    assert gpt2.decode(ids) == "a<|endoftext|>b"


def test_encode_documents_appends_eod(gpt2):
    ids = gpt2.encode_documents(["hello world", "", "hi"])
    assert ids.tolist() == [31373, 995, 50256, 50256, 5303, 50256]
    assert gpt2.encode_documents([]).tolist() == []


def test_long_runs_do_not_crash(gpt2):
    # tiktoken's regex panics (stack overflow) on ~1M spaces; the runs are cut like Meta's tokenizer does.
    text = "a" * (3 * MAX_RUN) + " " * (4 * MAX_RUN + 7) + "b"
    assert gpt2.decode(gpt2.encode(text)) == text


def _write_fake_llama3_file(path):
    """A tiktoken ranks file with Llama 3's rank count: the 256 bytes, then unique multi-byte tokens."""
    tokens = [bytes([i]) for i in range(256)] + [b"tok%d" % i for i in range(128_000 - 256)]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))


def test_llama3_layout_from_a_path(tmp_path):
    path = tmp_path / "tokenizer.model"
    _write_fake_llama3_file(path)
    tok = load_tokenizer(str(path))
    assert (tok.name, tok.vocab_size, tok.eod_id, tok.bos_id) == ("llama3", 128_256, 128_001, 128_000)
    assert tok.token_dtype == np.uint32
    assert tok.decode([128_000, 128_001, 128_255]) == (
        "<|begin_of_text|><|end_of_text|><|reserved_special_token_247|>"
    )


def test_llama3_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.model"
    _write_fake_llama3_file(path)
    monkeypatch.setenv(LLAMA3_ENV, str(path))
    assert load_tokenizer("llama3").file == str(path)


def test_llama3_from_llama_models_package(monkeypatch):
    pytest.importorskip("llama_models")
    monkeypatch.delenv(LLAMA3_ENV, raising=False)
    tok = load_tokenizer("llama3")
    with open(tok.file, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == LLAMA3_SHA256
    assert tok.encode("hello world") == [15339, 1917]
    assert (tok.vocab_size, tok.eod_id) == (128_256, 128_001)


def test_llama3_not_found_says_the_command_lines_key(monkeypatch):
    monkeypatch.delenv(LLAMA3_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "llama_models", None)  # not installed
    with pytest.raises(DataError, match="Llama 3 tokenizer not found") as err:
        load_tokenizer("llama3")
    assert "--config.data.tokenizer=/path/to/tokenizer.model" in str(err.value)


def test_missing_tokenizer_path():
    with pytest.raises(DataError, match="tokenizer file /no/such/tokenizer.model does not exist"):
        load_tokenizer("/no/such/tokenizer.model")


def test_unreadable_tokenizer_file(tmp_path):
    path = tmp_path / "bad.tiktoken"
    path.write_text("this is not a ranks file\n")
    with pytest.raises(DataError, match="cannot read tokenizer file") as err:
        load_tokenizer(str(path))
    assert "\n" not in str(err.value)


def test_unknown_rank_count(tmp_path):
    path = tmp_path / "small.tiktoken"
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    with pytest.raises(DataError, match="has 256 ranks"):
        load_tokenizer(str(path))


def test_encode_documents_separators(gpt2):
    """ "eod" after each document, "bos" before each, "none" nothing; GPT-2 has no BOS: one-line error."""
    texts = ["hello world", "", "hi"]
    with_bos = dataclasses.replace(gpt2, bos_id=7)  # GPT-2 has none; any id shows where it goes
    assert with_bos.encode_documents(texts, "bos").tolist() == [7, 31373, 995, 7, 7, 5303]
    assert gpt2.encode_documents(texts, "none").tolist() == [31373, 995, 5303]
    assert gpt2.encode_documents(texts, "eod").tolist() == gpt2.encode_documents(texts).tolist()
    with pytest.raises(DataError, match="no BOS token: set data.separator"):
        gpt2.encode_documents(texts, "bos")
    with pytest.raises(DataError, match="unknown data.separator 'newline'"):
        gpt2.encode_documents(texts, "newline")
