"""The pre-tokenized cache: one memory-mapped shard of token ids per document source.

Layout: `<root>/tokens/<tokenizer name>-<tokenizer fingerprint>/<source name>.<key>.bin` plus a `.json`
sidecar, where `key` hashes the source's fingerprint (path, size, mtime), CACHE_VERSION and the document
separator (the default "eod" hashes as before it was a choice, so older caches stay valid). The `.bin` file
is the source's token stream (each document's ids with its separator) in `tokenizer.token_dtype`; the sidecar
(token, document and skipped-record counts) is written last, so a shard with a sidecar is complete. Both
are written under temporary names and renamed atomically: hosts sharing a file system may race to build a
shard, and none ever reads a partial one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fp4jax.data.errors import DataError
from fp4jax.data.packing import TokenStream
from fp4jax.data.sources import DocumentSource, ReadStats, check_bad_record_policy
from fp4jax.data.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "CACHE_ENV",
    "CACHE_VERSION",
    "DOCS_PER_TASK",
    "Shard",
    "available_cpus",
    "build_shard",
    "cache_root",
    "load_shard",
    "load_token_stream",
    "shard_paths",
]

log = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_ENV = "FP4JAX_CACHE"
DOCS_PER_TASK = 256  # documents encoded per thread task: large enough to amortise, small enough to stream


@dataclasses.dataclass(frozen=True)
class Shard:
    """A cached source: `tokens` (read-only memmap) holds `num_documents` documents and their separators."""

    tokens: np.ndarray
    num_documents: int
    skipped: int
    path: Path


def cache_root(cache_dir: str = "") -> Path:
    """`cache_dir`, else $FP4JAX_CACHE, else ~/.cache/fp4jax."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or "~/.cache/fp4jax").expanduser()


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask under SLURM or a container), at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def shard_paths(
    root: Path, tokenizer: Tokenizer, source: DocumentSource, separator: str = "eod"
) -> tuple[Path, Path]:
    """(.bin, .json) paths of the shard of `source` tokenized by `tokenizer` with `separator`."""
    tag = "" if separator == "eod" else f"|{separator}"
    key = hashlib.sha1(f"{CACHE_VERSION}|{source.fingerprint}{tag}".encode()).hexdigest()[:16]
    stem = root / "tokens" / f"{tokenizer.name}-{tokenizer.fingerprint}" / f"{source.name}.{key}"
    return stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + ".json")


def load_shard(
    root: Path, tokenizer: Tokenizer, source: DocumentSource, separator: str = "eod"
) -> Shard | None:
    """The cached shard, or None when it is missing, partial or of another size than its sidecar says."""
    bin_path, meta_path = shard_paths(root, tokenizer, source, separator)
    dtype = np.dtype(tokenizer.token_dtype)
    try:
        meta = json.loads(meta_path.read_text())
        size = bin_path.stat().st_size
        complete = meta["dtype"] == dtype.name and size == meta["num_tokens"] * dtype.itemsize
        counts = int(meta["num_documents"]), int(meta["skipped"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not complete:
        return None
    tokens = np.memmap(bin_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    return Shard(tokens, *counts, bin_path)


def build_shard(
    source: DocumentSource,
    tokenizer: Tokenizer,
    root: Path,
    num_threads: int,
    progress: bool = True,
    separator: str = "eod",
) -> Shard:
    """Tokenizes `source` on `num_threads` threads into the cache and returns the new shard."""
    tokenizer.separator_ids(separator)  # an unknown separator fails before any work
    bin_path, meta_path = shard_paths(root, tokenizer, source, separator)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    stats = ReadStats()
    bar = tqdm(
        total=source.size,
        unit=source.unit,
        unit_scale=True,
        desc=f"tokenizing {source.name}",
        disable=not progress,
        mininterval=2.0,
    )
    with bar, _temporary(bin_path) as tmp:
        with open(tmp, "wb") as f:
            documents = source.documents(stats)
            num_tokens = _tokenize_into(f, documents, tokenizer, separator, num_threads, stats, bar)
        os.replace(tmp, bin_path)
    meta = {
        "source": source.fingerprint,
        "tokenizer": f"{tokenizer.name}-{tokenizer.fingerprint}",
        "separator": separator,
        "dtype": np.dtype(tokenizer.token_dtype).name,
        "num_tokens": num_tokens,
        "num_documents": stats.documents,
        "skipped": stats.skipped,
    }
    with _temporary(meta_path) as tmp:
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, meta_path)
    shard = load_shard(root, tokenizer, source, separator)
    if shard is None:
        raise DataError(f"the cache shard {bin_path} could not be read back after writing it (disk full?)")
    return shard


@contextlib.contextmanager
def _temporary(path: Path) -> Iterator[Path]:
    """A temporary sibling of `path`, unique per host and process, removed if it still exists on exit."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def _tokenize_into(
    f, documents: Iterable[str], tokenizer: Tokenizer, separator: str, num_threads: int, stats, bar
) -> int:
    """Writes the token stream of `documents` to `f` in order; returns its length.

    Chunks of documents are encoded on a thread pool (tiktoken releases the GIL) with a bounded number in
    flight, so memory stays flat for any file size.
    """
    dtype, total = tokenizer.token_dtype, 0
    with ThreadPoolExecutor(num_threads) as pool:
        pending = collections.deque()
        for chunk in _chunks(documents, DOCS_PER_TASK):
            pending.append(pool.submit(tokenizer.encode_documents, chunk, separator))
            while len(pending) > 2 * num_threads or (pending and pending[0].done()):
                total += _write(f, pending.popleft().result(), dtype)
                bar.update(stats.progress - bar.n)
        while pending:
            total += _write(f, pending.popleft().result(), dtype)
    bar.update(stats.progress - bar.n)
    return total


def _write(f, ids: np.ndarray, dtype) -> int:
    ids.astype(dtype, copy=False).tofile(f)
    return len(ids)


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def load_token_stream(
    sources: Sequence[DocumentSource],
    tokenizer: Tokenizer,
    *,
    cache_dir: str = "",
    num_threads: int = 0,
    on_bad_record: str = "error",
    min_tokens: int | None = None,
    processes: int = 1,
    progress: bool = True,
    separator: str = "eod",
) -> TokenStream:
    """The token stream of `sources` in order, read from the cache; missing shards are tokenized first.

    `separator` marks the documents (Tokenizer.encode_documents). With `min_tokens`, only the shortest
    prefix of `sources` holding that many tokens is read (and built).
    With `processes` > 1 missing shards are built in that many spawned worker processes (the caller's
    main module must be import-safe, i.e. guarded by `if __name__ == "__main__"`).
    """
    check_bad_record_policy(on_bad_record)
    root, num_threads = cache_root(cache_dir), num_threads or available_cpus()
    if processes > 1 and min_tokens is None:
        _build_in_processes(sources, tokenizer, root, processes, num_threads, separator)
    shards = []
    for source in sources:
        shard = load_shard(root, tokenizer, source, separator) or build_shard(
            source, tokenizer, root, num_threads, progress, separator
        )
        _check_skipped(shard, on_bad_record)
        shards.append(shard)
        if min_tokens is not None and sum(len(s.tokens) for s in shards) >= min_tokens:
            break
    return TokenStream([s.tokens for s in shards], num_documents=sum(s.num_documents for s in shards))


def _check_skipped(shard: Shard, on_bad_record: str) -> None:
    if shard.skipped and on_bad_record == "error":
        raise DataError(
            f"{shard.path} was cached with {shard.skipped} bad records skipped, but on_bad_record='error'; "
            "set on_bad_record='skip' or delete the shard to see the first error"
        )
    if shard.skipped:
        log.warning("%s: %d bad records were skipped", shard.path.name, shard.skipped)


def _build_in_processes(
    sources: Sequence[DocumentSource],
    tokenizer: Tokenizer,
    root: Path,
    processes: int,
    num_threads: int,
    separator: str,
) -> None:
    missing = [s for s in sources if load_shard(root, tokenizer, s, separator) is None]
    if len(missing) < 2:
        return
    processes = min(processes, len(missing))
    threads = max(1, num_threads // processes)
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX's threads
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        jobs = [pool.submit(_build_job, s, tokenizer.file, root, threads, separator) for s in missing]
        for job in tqdm(as_completed(jobs), total=len(jobs), unit="file", desc="tokenizing"):
            job.result()


def _build_job(
    source: DocumentSource, tokenizer_file: str, root: Path, num_threads: int, separator: str
) -> int:
    tokenizer = load_tokenizer(tokenizer_file)
    shard = build_shard(source, tokenizer, root, num_threads, progress=False, separator=separator)
    return len(shard.tokens)
