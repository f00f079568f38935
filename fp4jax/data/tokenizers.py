"""Tokenizers through tiktoken: the bundled GPT-2 BPE and Meta's Llama 3.1 `tokenizer.model`.

`encode` is ordinary BPE: text that spells a special token (`<|endoftext|>`) is encoded as plain text, so a
document can never inject an EOD or BOS; `encode_documents` adds the separator between documents (the
data config's `separator`: EOD after each document, BOS before each, or nothing; docs/data.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import lzma
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load

from fp4jax.data.assets import ASSETS_DIR, first_line
from fp4jax.data.errors import DataError

__all__ = [
    "GPT2_FILE",
    "GPT2_PAT",
    "LLAMA3_ENV",
    "LLAMA3_PAT",
    "MAX_RUN",
    "SEPARATORS",
    "Tokenizer",
    "find_llama3_file",
    "load_tokenizer",
]

SEPARATORS = ("eod", "bos", "none")
# Stored xz-compressed (a third of the size); its content is byte-identical to the file tiktoken pins for
# r50k_base, so the load checks that hash.
GPT2_FILE = ASSETS_DIR / "tokenizers" / "gpt2" / "r50k_base.tiktoken.xz"
_GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_ENV = "FP4JAX_LLAMA3_TOKENIZER"
_GPT2_RANKS = 50_256
_LLAMA3_RANKS = 128_000
_LLAMA3_NUM_SPECIAL = 256
# tiktoken's regex overflows its stack on very long runs of whitespace or of non-whitespace (a panic, not an
# exception); like Meta's reference tokenizer, such runs are cut into pieces of at most this many characters.
MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_RUN + 1},}}|(?<!\s)\s{{{MAX_RUN + 1},}}")


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A tiktoken BPE with an end-of-document id.

    Invariants: `decode(encode(t)) == t`; every id is < `vocab_size`; `fingerprint` changes whenever the
    ids of some text could change (it hashes the ranks file, the split regex and the special tokens).
    """

    name: str
    encoding: tiktoken.Encoding
    eod_id: int
    bos_id: int | None
    file: str
    fingerprint: str

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def token_dtype(self) -> type[np.unsignedinteger]:
        """The smallest unsigned dtype that holds every id (uint16 for GPT-2, uint32 for Llama 3)."""
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of `text` as uint32, special-token spellings encoded as plain text."""
        pieces = _split_long_runs(text)
        arrays = [
            self.encoding.encode_to_numpy(p, allowed_special=set(), disallowed_special=()) for p in pieces
        ]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def encode_documents(self, texts: Sequence[str], separator: str = "eod") -> np.ndarray:
        """The texts' ids concatenated (uint32), each text marked by `separator`: "eod" appends eod_id
        after it, "bos" puts bos_id before it, "none" adds nothing. Releases the GIL while it encodes."""
        before, after = self.separator_ids(separator)
        parts = [a for t in texts for a in (before, self.encode_array(t), after)]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)

    def separator_ids(self, separator: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids before, ids after) each document for `separator`; DataError for one this tokenizer lacks."""
        none = np.zeros(0, np.uint32)
        if separator == "eod":
            return none, np.array([self.eod_id], np.uint32)
        if separator == "bos" and self.bos_id is not None:
            return np.array([self.bos_id], np.uint32), none
        if separator == "none":
            return none, none
        if separator == "bos":
            raise DataError(f"tokenizer {self.name} has no BOS token: set data.separator to 'eod' or 'none'")
        raise DataError(f"unknown data.separator {separator!r}: use one of {', '.join(SEPARATORS)}")

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.encoding.decode([int(i) for i in ids])


def _split_long_runs(text: str) -> list[str]:
    """Pieces that concatenate to `text`, none holding a whitespace or non-whitespace run over MAX_RUN."""
    pieces, start = [], 0
    for run in _LONG_RUN.finditer(text):
        for cut in range(run.start() + MAX_RUN, run.end(), MAX_RUN):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


def load_tokenizer(spec: str | Tokenizer) -> Tokenizer:
    """A tokenizer from "gpt2" (bundled), "llama3" (found automatically) or a path to a tiktoken ranks file.

    A path's family is recognised by its number of ranks: 50,256 (GPT-2 r50k_base) or 128,000 (Llama 3
    `tokenizer.model`).
    """
    if isinstance(spec, Tokenizer):
        return spec
    if spec == "gpt2":
        return _from_file(GPT2_FILE)
    if spec == "llama3":
        return _from_file(find_llama3_file())
    path = Path(os.path.expanduser(spec))
    if not path.is_file():
        raise DataError(f"tokenizer file {spec} does not exist (expected 'gpt2', 'llama3' or a file path)")
    return _from_file(path)


def find_llama3_file() -> Path:
    """Meta's Llama 3.1 `tokenizer.model`: $FP4JAX_LLAMA3_TOKENIZER, else the copy in `llama-models`."""
    if os.environ.get(LLAMA3_ENV):
        path = Path(os.environ[LLAMA3_ENV]).expanduser()
        if not path.is_file():
            raise DataError(f"tokenizer file ${LLAMA3_ENV}={path} does not exist")
        return path
    try:
        path = Path(str(importlib.resources.files("llama_models") / "llama3" / "tokenizer.model"))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise DataError(
            "Llama 3 tokenizer not found: pip install --no-deps llama-models (Llama 3.1 Community License), "
            f"set ${LLAMA3_ENV}, or set data.tokenizer to the file (python -m fp4jax.train: "
            "--config.data.tokenizer=/path/to/tokenizer.model)"
        )
    return path


def _read_ranks(path: Path) -> tuple[dict[bytes, int], bytes]:
    """The BPE ranks of a tiktoken ranks file (xz-compressed where its name ends in .xz) and the file's
    uncompressed bytes. tiktoken parses it (it reads only paths, so a compressed file goes through a
    temporary copy); the bundled GPT-2 file is checked against tiktoken's pinned hash."""
    content = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    expected = _GPT2_SHA256 if path == GPT2_FILE else None
    if path.suffix != ".xz":
        return tiktoken.load.load_tiktoken_bpe(str(path), expected), content
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / path.stem
        plain.write_bytes(content)
        return tiktoken.load.load_tiktoken_bpe(str(plain), expected), content


def _from_file(path: Path) -> Tokenizer:
    try:
        ranks, content = _read_ranks(path)
    except Exception as e:  # tiktoken raises bare ValueError/binascii.Error/IndexError on a bad file
        raise DataError(f"cannot read tokenizer file {path} as tiktoken BPE ranks ({first_line(e)})") from e
    if len(ranks) == _GPT2_RANKS:
        name, pat, specials, eod, bos = "gpt2", GPT2_PAT, {"<|endoftext|>": _GPT2_RANKS}, _GPT2_RANKS, None
    elif len(ranks) == _LLAMA3_RANKS:
        name, pat, specials = "llama3", LLAMA3_PAT, _llama3_special_tokens()
        eod, bos = specials["<|end_of_text|>"], specials["<|begin_of_text|>"]
    else:
        raise DataError(
            f"tokenizer file {path} has {len(ranks):,} ranks; expected {_GPT2_RANKS:,} (GPT-2 r50k_base) "
            f"or {_LLAMA3_RANKS:,} (Llama 3 tokenizer.model)"
        )
    encoding = tiktoken.Encoding(name, pat_str=pat, mergeable_ranks=ranks, special_tokens=specials)
    digest = hashlib.sha256(content + pat.encode() + repr(sorted(specials.items())).encode())
    return Tokenizer(name, encoding, eod, bos, str(path), digest.hexdigest()[:16])


def _llama3_special_tokens() -> dict[str, int]:
    """Llama 3.1's 256 special tokens, after its 128,000 ranks: <|begin_of_text|> = 128000, EOD = 128001."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + _LLAMA3_NUM_SPECIAL - len(named))]
    return {token: _LLAMA3_RANKS + i for i, token in enumerate(named + reserved)}
