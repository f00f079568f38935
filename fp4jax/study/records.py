"""Run records: the files of finished runs, kept as one compressed archive per stage.

A study's reports are computed from its runs' files (metrics.jsonl, summary.json, ladder_run.json,
train.log, identity.json), never from their checkpoints. The repository keeps those files under
records/<study>/<stage>.tar.xz (docs/results holds only the reports); `unpack` gives the report its
directory tree again:

    python -m fp4jax.study records unpack records/study125m --root runs/study
    python -m fp4jax.study report --plan ... --root runs/study --out docs/results/study125m

Most of a metrics.jsonl is numbers the trainer derived from others on the same line (trainer._fetch):
tokens and sequences are step times a per-run count, tokens_per_s is tokens per update over step_time_s
and mfu is tokens_per_s times a per-run constant; and grad_norm, loss and lr are float32 values written
with float64's 17 digits. Timing noise in tokens_per_s and mfu does not compress: the ladder's archive
was 1.37 MB with them, 0.58 MB as below. So a metrics.jsonl is archived as metrics.slim.jsonl beside
where it was: a header line saying how to rebuild what was left out (_SLIM_FORMAT, the per-run counts
and constant, the float32 fields), then each line without the derived fields and with the float32 values
at their shortest decimal. Unpacking rebuilds metrics.jsonl from it.

Invariants: unpacking gives back every record file byte for byte, at its path relative to the runs'
root, so it recreates the tree the report read; a metrics.jsonl is archived slim only where rebuilding
the slim form at pack time gives back its exact bytes (else, as for a file not written by the trainer,
or one the rules do not fit, it is archived as it is), so slimming never loses a bit; an archive holds
only RECORD_FILES and metrics.slim.jsonl (never both a run's metrics.jsonl and its slim form), and
unpack refuses any other before writing anything; archives packed before metrics.slim.jsonl existed
unpack as they did; packing is deterministic (sorted members, zeroed times and owners, one xz preset, the
slim form a function of the file's bytes), so packing the same files again gives the same bytes and git
sees no change; an archive is written to a temporary name and renamed, so an interrupted pack leaves the
old archive whole.
"""

from __future__ import annotations

import io
import json
import lzma
import math
import os
import posixpath
import struct
import tarfile

__all__ = ["ARCHIVE_SUFFIX", "RECORD_FILES", "SLIM_METRICS", "pack", "unpack"]

ARCHIVE_SUFFIX = ".tar.xz"
# What a report reads of a run (study.runs, study.analysis) and what says how it ran (train.log,
# identity.json); checkpoints and TensorBoard events stay out.
RECORD_FILES = ("metrics.jsonl", "summary.json", "ladder_run.json", "train.log", "identity.json")
METRICS = "metrics.jsonl"
# The archive member a metrics.jsonl is kept as when its derived fields are left out; unpack writes
# metrics.jsonl from it.
SLIM_METRICS = "metrics.slim.jsonl"
_SLIM_FORMAT = "fp4jax metrics.slim 1"
# What a slim header may hold besides "format"; an unpacker that knows fewer refuses the member.
_SLIM_RULES = ("tokens_per_step", "sequences_per_step", "tokens_per_s", "mfu_per_token_s", "float32")
_XZ_PRESET = 9 | lzma.PRESET_EXTREME
# How far from mfu / tokens_per_s of a run's first line its constant is looked for, in ulps each way
# (one rounded division away from the trainer's constant: within one ulp in every committed run).
_MFU_ULPS = 4


def _float32(value: float) -> float:
    """`value` rounded to float32 (OverflowError beyond float32's range)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _shortest_float32(value) -> float | None:
    """The float of fewest significant digits that _float32 takes to `value`, a float32 value (itself
    where not finite: NaN and infinities pass through _float32 as they are); None if `value` is not a
    float32 value."""
    if type(value) is not float:
        return None
    if not math.isfinite(value):
        return value
    try:
        if _float32(value) != value:
            return None
        for digits in range(1, 10):  # 9 significant digits tell any two float32 values apart
            short = float(f"{value:.{digits}g}")
            if _float32(short) == value:
                return short
    except OverflowError:
        pass
    return None


def _per_step(lines: list[dict], key: str) -> int | None:
    """The one int n with line[key] == line["step"] * n on every line that has a step (and no line
    without `key`); None where there is none."""
    stepped = [line for line in lines if "step" in line]
    ints = all(type(line["step"]) is int and type(line.get(key)) is int for line in stepped)
    if not stepped or not ints:
        return None
    n = next((line[key] // line["step"] for line in stepped if line["step"] > 0), None)
    if n is None or any(line[key] != line["step"] * n for line in stepped):
        return None
    return n


def _tokens_per_s(line: dict) -> float:
    """The trainer's tokens_per_s of a training line: tokens per update over the update's time."""
    return (line["tokens"] // line["step"]) / line["step_time_s"]


def _rebuilds_tokens_per_s(train: list[dict]) -> bool:
    try:
        return bool(train) and all(line.get("tokens_per_s") == _tokens_per_s(line) for line in train)
    except (KeyError, TypeError, ArithmeticError):
        return False


def _mfu_per_token_s(train: list[dict]) -> float | None:
    """The one float c with line["mfu"] == line["tokens_per_s"] * c on every training line, looked for
    within _MFU_ULPS of the first line's quotient; None where there is none."""
    if not train or any(type(line.get("mfu")) is not float for line in train):
        return None
    try:
        first = train[0]["mfu"] / train[0]["tokens_per_s"]
        candidates, up, down = [first], first, first
        for _ in range(_MFU_ULPS):
            up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
            candidates += [up, down]
        return next(
            (c for c in candidates if all(line["mfu"] == line["tokens_per_s"] * c for line in train)), None
        )
    except (KeyError, TypeError, ArithmeticError):
        return None


def _float32_fields(train: list[dict], left_out: set[str]) -> list[str]:
    """The fields of the training lines (but those left out) that are float32 values on every line that
    has them."""
    fields = sorted({key for line in train for key in line} - left_out)
    return [key for key in fields if all(_shortest_float32(ln[key]) is not None for ln in train if key in ln)]


def _is_train(line: dict) -> bool:
    """A training line (trainer._fetch): it alone has step_time_s."""
    return "step_time_s" in line


def _slim(raw: bytes) -> bytes | None:
    """metrics.jsonl's bytes as metrics.slim.jsonl: a header of what _unslim rebuilds, then each line
    without it; None where that is not smaller, or rebuilding it would not give back `raw` exactly."""
    try:
        pieces = raw.decode("utf-8").split("\n")
        lines = [json.loads(piece) if piece else None for piece in pieces]
    except ValueError:
        return None
    if not all(line is None or isinstance(line, dict) for line in lines):
        return None
    records = [line for line in lines if line is not None]
    train = [line for line in records if _is_train(line)]
    header = {
        "tokens_per_step": _per_step(records, "tokens"),
        "sequences_per_step": _per_step(records, "sequences"),
        "tokens_per_s": _rebuilds_tokens_per_s(train) or None,
        "mfu_per_token_s": _mfu_per_token_s(train),
    }
    rebuilds = {"tokens_per_step": "tokens", "sequences_per_step": "sequences", "mfu_per_token_s": "mfu"}
    left_out = {rebuilds.get(rule, rule) for rule, value in header.items() if value is not None}
    header["float32"] = _float32_fields(train, left_out) or None
    header = {"format": _SLIM_FORMAT} | {rule: value for rule, value in header.items() if value is not None}
    if len(header) == 1:
        return None
    body = []
    for line in lines:
        if line is None:
            body.append("")
            continue
        slim = {key: value for key, value in line.items() if key not in left_out}
        if _is_train(line):
            for key in header.get("float32", ()):
                if key in slim:
                    slim[key] = _shortest_float32(slim[key])
        body.append(json.dumps(slim, sort_keys=True))
    data = (json.dumps(header, sort_keys=True) + "\n" + "\n".join(body)).encode("utf-8")
    try:
        rebuilt = _unslim(data)
    except (ValueError, KeyError, TypeError, ArithmeticError):
        return None
    return data if rebuilt == raw and len(data) < len(raw) else None


def _unslim(data: bytes) -> bytes:
    """The metrics.jsonl a metrics.slim.jsonl was made from: each line with the fields its header says
    how to rebuild, written as the trainer writes a line (json.dumps, keys sorted)."""
    head, _, body = data.decode("utf-8").partition("\n")
    header = json.loads(head)
    if not isinstance(header, dict) or header.get("format") != _SLIM_FORMAT:
        raise ValueError(f"its first line is not a {_SLIM_FORMAT!r} header")
    unknown = sorted(set(header) - {"format", *_SLIM_RULES})
    if unknown:
        raise ValueError(f"its header has rules this fp4jax does not know ({', '.join(unknown)})")
    tokens, sequences = header.get("tokens_per_step"), header.get("sequences_per_step")
    mfu_per_token_s, float32 = header.get("mfu_per_token_s"), header.get("float32", ())
    lines = []
    for piece in body.split("\n"):
        if not piece:
            lines.append(piece)
            continue
        line = json.loads(piece)
        if "step" in line and tokens is not None:
            line["tokens"] = line["step"] * tokens
        if "step" in line and sequences is not None:
            line["sequences"] = line["step"] * sequences
        if _is_train(line):
            for key in float32:  # first: step_time_s or a kept tokens_per_s may be one
                if key in line:
                    line[key] = _float32(line[key])
            if header.get("tokens_per_s"):
                line["tokens_per_s"] = _tokens_per_s(line)
            if mfu_per_token_s is not None:
                line["mfu"] = line["tokens_per_s"] * mfu_per_token_s
        lines.append(json.dumps(line, sort_keys=True))
    return "\n".join(lines).encode("utf-8")


def _record_files(stage_dir: str, runs_root: str) -> list[str]:
    """Every record file under stage_dir, as sorted paths relative to runs_root."""
    found = []
    for directory, _, names in os.walk(stage_dir):
        found += [os.path.join(directory, n) for n in names if n in RECORD_FILES]
    return sorted(os.path.relpath(path, runs_root) for path in found)


def _archive_bytes(runs_root: str, members: list[str]) -> bytes:
    """An xz-compressed tar of `members` (paths relative to runs_root; each metrics.jsonl slim where
    _slim can) with nothing machine-dependent in its headers."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            with open(os.path.join(runs_root, member), "rb") as f:
                data = f.read()
            name = member.replace(os.sep, "/")
            slim = _slim(data) if posixpath.basename(name) == METRICS else None
            if slim is not None:
                name, data = posixpath.join(posixpath.dirname(name), SLIM_METRICS), slim
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ, preset=_XZ_PRESET)


def _write_whole(path: str, data: bytes) -> None:
    """`data` at `path`, through a temporary file renamed into place."""
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def pack(runs_root: str, records_dir: str, stages: list[str] | None = None) -> list[str]:
    """Writes records_dir/<stage>.tar.xz for each stage directory of runs_root (those named in `stages`,
    else every one holding a record file); returns the archives written. An archive whose bytes would
    not change is left untouched."""
    if not os.path.isdir(runs_root):
        raise FileNotFoundError(f"no runs at {runs_root}: pass the --root the study ran under")
    available = sorted(d for d in os.listdir(runs_root) if os.path.isdir(os.path.join(runs_root, d)))
    missing = sorted(set(stages or ()) - set(available))
    if missing:
        raise ValueError(f"no stage {', '.join(missing)} under {runs_root}; it has {', '.join(available)}")
    os.makedirs(records_dir, exist_ok=True)
    written = []
    for stage in stages or available:
        members = _record_files(os.path.join(runs_root, stage), runs_root)
        if not members:
            continue
        path = os.path.join(records_dir, stage + ARCHIVE_SUFFIX)
        data = _archive_bytes(runs_root, members)
        if os.path.exists(path):
            with open(path, "rb") as f:
                if f.read() == data:
                    continue
        _write_whole(path, data)
        written.append(path)
    return written


def _rebuilt_metrics(name: str, tar: tarfile.TarFile, runs_root: str) -> dict[str, bytes]:
    """Archive `name`'s metrics.jsonl files rebuilt from its slim members, by their paths relative to
    runs_root; ValueError (nothing written) for a member that is not a run record, a run archived both
    ways, a slim member that does not rebuild or one whose path leaves runs_root."""
    members = tar.getmembers()
    strays = [m.name for m in members if posixpath.basename(m.name) not in (*RECORD_FILES, SLIM_METRICS)]
    if strays:
        raise ValueError(f"{name} holds {strays[0]}, not a run record: repack it with `records pack`")
    names = {m.name for m in members}
    rebuilt = {}
    for member in members:
        if posixpath.basename(member.name) != SLIM_METRICS:
            continue
        target = posixpath.join(posixpath.dirname(member.name), METRICS)
        if target in names:
            raise ValueError(f"{name} holds both {target} and {member.name}: repack it with `records pack`")
        tarfile.data_filter(member, runs_root)  # the checks extractall(filter="data") makes of a path
        try:
            rebuilt[target] = _unslim(tar.extractfile(member).read())
        except ValueError as err:
            raise ValueError(f"{name}: {member.name} does not rebuild a metrics.jsonl: {err}") from err
    return rebuilt


def unpack(records_dir: str, runs_root: str) -> list[str]:
    """Extracts every records_dir/*.tar.xz under runs_root (replacing files of the same names), each
    metrics.slim.jsonl as the metrics.jsonl it was packed from; returns the files written, as paths
    relative to runs_root. Every archive is checked, and its metrics rebuilt, before any is extracted."""
    names = sorted(n for n in os.listdir(records_dir) if n.endswith(ARCHIVE_SUFFIX))
    if not names:
        raise FileNotFoundError(f"no *{ARCHIVE_SUFFIX} in {records_dir}: is it a records directory?")
    archives = [tarfile.open(os.path.join(records_dir, n), "r:xz") for n in names]
    try:
        rebuilt = [_rebuilt_metrics(name, tar, runs_root) for name, tar in zip(names, archives, strict=True)]
        written = []
        for tar, metrics in zip(archives, rebuilt, strict=True):
            for member in tar.getmembers():
                if posixpath.basename(member.name) != SLIM_METRICS:
                    tar.extract(member, runs_root, filter="data")
                    written.append(member.name)
                    continue
                target = posixpath.join(posixpath.dirname(member.name), METRICS)
                path = os.path.join(runs_root, *target.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(metrics[target])
                os.utime(path, (member.mtime, member.mtime))
                written.append(target)
        return written
    finally:
        for tar in archives:
            tar.close()
