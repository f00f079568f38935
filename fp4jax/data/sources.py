"""Document readers: allenai/c4 JSON-lines shards (.json.gz) and prepared tensorflow-datasets directories.

A reader turns a data location into `DocumentSource`s. A source is the unit of the token cache (one
json.gz file, or one TFDS split): its `fingerprint` changes whenever its documents may have changed, and
`documents()` yields the documents' `text` strings in their stored order, the same order on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from fp4jax.data.assets import BUNDLED_DATA_DIR, first_line
from fp4jax.data.errors import DataError

__all__ = [
    "BAD_RECORD_POLICIES",
    "BUNDLED",
    "DocumentSource",
    "ReadStats",
    "check_bad_record_policy",
    "eval_files",
    "expand_braces",
    "file_fingerprint",
    "json_sources",
    "location_dir",
    "read_json_file",
    "read_tfds_split",
    "resolve_files",
    "tfds_source",
    "train_files",
]

log = logging.getLogger(__name__)

BUNDLED = "bundled"
BAD_RECORD_POLICIES = ("error", "skip")
_PROGRESS_EVERY = 1024  # lines between updates of ReadStats.progress (a tell() each)
_TFDS_BATCH = 1024  # records fetched per ArrayRecord read


@dataclasses.dataclass
class ReadStats:
    """Counters a reader updates as it yields: documents yielded, bad records skipped, progress made
    (in the unit of `DocumentSource.unit`, at most `DocumentSource.size`)."""

    documents: int = 0
    skipped: int = 0
    progress: int = 0


@dataclasses.dataclass(frozen=True)
class DocumentSource:
    """One cacheable unit of documents.

    `reader` is picklable (a functools.partial of a module-level function) so that a worker process can
    read the source; `name` is filesystem-safe and used in cache file names and messages.
    """

    name: str
    fingerprint: str
    size: int
    unit: str
    reader: Callable[[ReadStats], Iterator[str]]

    def documents(self, stats: ReadStats | None = None) -> Iterator[str]:
        return self.reader(stats if stats is not None else ReadStats())


# --------------------------------------------------------------------------------------------------------
# json.gz files


def expand_braces(pattern: str) -> list[str]:
    """Shell-style brace expansion: `a{x,y}b` -> [axb, ayb]; `{00768..00895}` -> zero-padded integers.

    MLPerf's training files are `c4-train.{00768..00895}-of-01024.json.gz`, a range no glob can express.
    """
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for alt in _brace_alternatives(match.group(1)) for p in expand_braces(head + alt + tail)]


def _brace_alternatives(body: str) -> list[str]:
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric is None:
        return body.split(",")
    lo, hi = numeric.groups()
    if int(lo) > int(hi):
        raise DataError(f"empty brace range {{{body}}}: {lo} > {hi}")
    return [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]


def location_dir(path: str) -> Path:
    """The directory of a data location: the bundled sample, the directory itself, or a glob's parent."""
    if not path:
        raise DataError("data path is empty: give 'bundled', a directory or a glob")
    if path == BUNDLED:
        return BUNDLED_DATA_DIR
    if os.path.isdir(path):
        return Path(path)
    if not glob.has_magic(path) and not os.path.exists(path):
        raise DataError(f"data path {path} does not exist")
    return Path(path).parent


def train_files(path: str, train_glob: str) -> list[Path]:
    """Training files: `train_glob` in the directory `path`, or the glob/file `path` itself."""
    is_pattern = path not in ("", BUNDLED) and not os.path.isdir(path)
    return resolve_files(location_dir(path), Path(path).name if is_pattern else train_glob)


def eval_files(path: str, eval_glob: str) -> list[Path]:
    """Validation files: `eval_glob` in the directory of the data location `path`."""
    return resolve_files(location_dir(path), eval_glob)


def resolve_files(directory: Path, pattern: str) -> list[Path]:
    """The sorted, non-empty list of regular files matching `pattern` (braces expanded) under `directory`.

    An absolute `pattern` ignores `directory`.
    """
    if not glob.has_magic(str(directory)) and not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist")
    matches = {m for p in expand_braces(os.path.join(directory, pattern)) for m in glob.glob(p)}
    files = sorted(Path(m) for m in matches if os.path.isfile(m))
    if files:
        return files
    if directory.is_dir() and not any(directory.iterdir()):
        raise DataError(f"data directory {directory} is empty")
    raise DataError(f"no files match {pattern!r} in {directory}")


def file_fingerprint(path: Path) -> str:
    """Absolute path, size and modification time: a copy or an edit of the file changes it."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def json_sources(files: list[Path], on_bad_record: str = "error") -> list[DocumentSource]:
    """One source per JSON-lines file (.json.gz or plain .json/.jsonl), in the given order."""
    check_bad_record_policy(on_bad_record)
    return [
        DocumentSource(
            name=f.name,
            fingerprint=file_fingerprint(f),
            size=f.stat().st_size,
            unit="B",
            reader=functools.partial(read_json_file, str(f), on_bad_record),
        )
        for f in files
    ]


def check_bad_record_policy(on_bad_record: str) -> None:
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise DataError(f"on_bad_record must be one of {BAD_RECORD_POLICIES}, got {on_bad_record!r}")


def read_json_file(path: str, on_bad_record: str, stats: ReadStats) -> Iterator[str]:
    """The `text` of every record of one JSON-lines file, in file order; blank lines are ignored.

    A malformed line (not a JSON object with a string `text`) or a corrupted gzip stream raises DataError
    naming the file and line; with on_bad_record="skip" it is counted in `stats.skipped` instead (and a
    corrupted gzip stream ends the file).
    """
    lineno = 0
    with open(path, "rb") as raw:
        lines = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
        try:
            for lineno, line in enumerate(lines, 1):
                if lineno % _PROGRESS_EVERY == 0:
                    stats.progress = raw.tell()
                if not line.strip():
                    continue
                try:
                    text = _record_text(line)
                except ValueError as e:
                    _bad_record(
                        f"{path}:{lineno}: malformed JSON record ({first_line(e)})", on_bad_record, stats
                    )
                    continue
                stats.documents += 1
                yield text
        except (OSError, EOFError, zlib.error) as e:
            _bad_record(f"{path}: corrupted data after line {lineno} ({first_line(e)})", on_bad_record, stats)
        stats.progress = os.fstat(raw.fileno()).st_size


def _record_text(line: bytes) -> str:
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError("no string 'text' field")
    return record["text"]


def _bad_record(message: str, on_bad_record: str, stats: ReadStats) -> None:
    if on_bad_record == "error":
        raise DataError(message + "; set on_bad_record='skip' to skip and count bad records")
    stats.skipped += 1
    log.warning("skipped: %s", message)


# --------------------------------------------------------------------------------------------------------
# tensorflow-datasets


def tfds_source(name: str, data_dir: str, split: str) -> DocumentSource:
    """The documents of one split of a prepared TFDS dataset (e.g. `c4/en:3.0.1`), in TFDS's stored order.

    ArrayRecord data is read through `as_data_source` (no TensorFlow); TFRecord data needs TensorFlow.
    """
    builder = _tfds_builder(name, data_dir)
    info = _split_info(builder, split)
    files = sorted(str(f) for f in info.filepaths)
    fingerprint = "|".join([name, split, *(file_fingerprint(Path(f)) for f in files)])
    return DocumentSource(
        name=re.sub(r"[^A-Za-z0-9_.-]+", "_", f"tfds-{name}-{split}"),
        fingerprint=fingerprint,
        size=int(info.num_examples),
        unit="doc",
        reader=functools.partial(read_tfds_split, name, data_dir, split),
    )


def _tfds_builder(name: str, data_dir: str):
    import tensorflow_datasets as tfds  # slow to import, and only this path needs it

    where = data_dir or "the default TFDS data_dir"
    prepared = _prepared_dir(name, data_dir)
    try:
        if prepared is not None and prepared.is_dir():
            builder = tfds.builder_from_directory(str(prepared))  # needs no builder code, only the files
        else:
            builder = tfds.builder(name, data_dir=data_dir or None)
    except Exception as e:  # tfds raises several unrelated types for a missing or unknown dataset
        raise DataError(f"cannot open TFDS dataset {name!r} in {where}: {first_line(e)}") from e
    if not builder.data_path.exists():
        raise DataError(f"TFDS dataset {name!r} is not prepared in {where} (no {builder.data_path})")
    return builder


def _prepared_dir(name: str, data_dir: str) -> Path | None:
    """`data_dir/c4/en/3.0.1` for `c4/en:3.0.1`; None without a data_dir or a version (TFDS resolves those).

    Raises DataError when that directory is missing: tfds's own message would blame the version.
    """
    if not data_dir or ":" not in name:
        return None
    dataset, version = name.rsplit(":", 1)
    path = Path(data_dir, *dataset.split("/"), version)
    if not path.is_dir() and not glob.has_magic(data_dir) and "://" not in data_dir:
        raise DataError(f"TFDS dataset {name!r} is not prepared in {data_dir} (no {path})")
    return path


def _split_info(builder, split: str):
    base = split.split("[")[0]
    if base not in builder.info.splits:
        raise DataError(
            f"TFDS dataset {builder.info.full_name} has no split {base!r}: {list(builder.info.splits)}"
        )
    return builder.info.splits[base]


def read_tfds_split(name: str, data_dir: str, split: str, stats: ReadStats) -> Iterator[str]:
    """The `text` feature of every example of a TFDS split, shard by shard in file order."""
    import tensorflow_datasets as tfds

    builder = _tfds_builder(name, data_dir)
    if builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD:
        texts = _array_record_texts(builder, split)
    else:
        texts = _tf_dataset_texts(builder, split)
    for text in texts:
        stats.documents += 1
        stats.progress = stats.documents
        yield text


def _array_record_texts(builder, split: str) -> Iterator[str]:
    source = builder.as_data_source(split=split)
    for start in range(0, len(source), _TFDS_BATCH):
        for record in source.__getitems__(range(start, min(start + _TFDS_BATCH, len(source)))):
            yield _as_str(record["text"])


def _tf_dataset_texts(builder, split: str) -> Iterator[str]:
    try:
        import tensorflow as tf
    except ImportError as e:
        raise DataError(
            f"TFDS data in {builder.data_path} is {builder.info.file_format.value}, which needs TensorFlow: "
            "pip install 'fp4jax[tfds]' (or use ArrayRecord or json.gz data)"
        ) from e
    import tensorflow_datasets as tfds

    _hide_gpus_from(tf)
    read_config = tfds.ReadConfig(interleave_cycle_length=1)  # shard after shard: a stable order
    ds = builder.as_dataset(
        split=split,
        shuffle_files=False,
        read_config=read_config,
        decoders=tfds.decode.PartialDecoding({"text": True}),
    )
    for example in tfds.as_numpy(ds):
        yield _as_str(example["text"])


def _hide_gpus_from(tf) -> None:
    """Keep TensorFlow (a full `tensorflow` install) off the accelerators JAX owns."""
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow was initialised already: its device choice is final
        pass


def _as_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
