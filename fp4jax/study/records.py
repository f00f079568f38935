"""Run records: the files of finished runs, kept as one compressed archive per stage.

A study's reports are computed from its runs' files (metrics.jsonl, summary.json, ladder_run.json,
train.log, identity.json), never from their checkpoints. The repository keeps those files under
records/<study>/<stage>.tar.xz (docs/results holds only the reports); `unpack` gives the report its
directory tree again:

    python -m fp4jax.study records unpack records/study125m --into runs/study
    python -m fp4jax.study report --plan ... --root runs/study --out docs/results/study125m

Invariants: an archive holds only RECORD_FILES, at their paths relative to the runs' root, so unpacking
recreates the tree the report read; packing is deterministic (sorted members, zeroed times and owners,
one xz preset), so packing the same files again gives the same bytes and git sees no change; an archive
is written to a temporary name and renamed, so an interrupted pack leaves the old archive whole.
"""

from __future__ import annotations

import io
import lzma
import os
import tarfile

__all__ = ["ARCHIVE_SUFFIX", "RECORD_FILES", "pack", "unpack"]

ARCHIVE_SUFFIX = ".tar.xz"
# What a report reads of a run (study.runs, study.analysis) and what says how it ran (train.log,
# identity.json); checkpoints and TensorBoard events stay out.
RECORD_FILES = ("metrics.jsonl", "summary.json", "ladder_run.json", "train.log", "identity.json")
_XZ_PRESET = 9 | lzma.PRESET_EXTREME


def _record_files(stage_dir: str, runs_root: str) -> list[str]:
    """Every record file under stage_dir, as sorted paths relative to runs_root."""
    found = []
    for directory, _, names in os.walk(stage_dir):
        found += [os.path.join(directory, n) for n in names if n in RECORD_FILES]
    return sorted(os.path.relpath(path, runs_root) for path in found)


def _archive_bytes(runs_root: str, members: list[str]) -> bytes:
    """An xz-compressed tar of `members` (paths relative to runs_root) with nothing machine-dependent in
    its headers."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            with open(os.path.join(runs_root, member), "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(member.replace(os.sep, "/"))
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


def unpack(records_dir: str, runs_root: str) -> list[str]:
    """Extracts every records_dir/*.tar.xz under runs_root (replacing files of the same names); returns
    the files written, as paths relative to runs_root. Every archive is checked before any is extracted."""
    names = sorted(n for n in os.listdir(records_dir) if n.endswith(ARCHIVE_SUFFIX))
    if not names:
        raise FileNotFoundError(f"no *{ARCHIVE_SUFFIX} in {records_dir}: is it a records directory?")
    archives = [tarfile.open(os.path.join(records_dir, n), "r:xz") for n in names]
    try:
        for name, tar in zip(names, archives, strict=True):
            strays = [m.name for m in tar.getmembers() if os.path.basename(m.name) not in RECORD_FILES]
            if strays:
                raise ValueError(f"{name} holds {strays[0]}, not a run record: repack it with `records pack`")
        written = []
        for tar in archives:
            tar.extractall(runs_root, filter="data")
            written += tar.getnames()
        return written
    finally:
        for tar in archives:
            tar.close()
