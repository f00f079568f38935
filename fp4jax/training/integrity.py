"""Checkpoint integrity: a manifest of every file's size and CRC-32, written once orbax has finalised a
step, and checked before that step is restored.

Orbax restores an array file overwritten in place with random bytes of the same size without complaint
(seen with orbax 0.12), and JSON items are read as they are; the manifest catches a file that is missing,
truncated, extended or changed. CRC-32 (zlib) rather than SHA-256: it detects any burst of up to 32
flipped bits and random damage with probability 1 - 2^-32, which is what a checkpoint needs against disks
and copies (not against an adversary), at 2 to 3 times SHA-256's speed (about 4 GB/s per thread here).

Layout: <checkpoints>/<step>/fp4jax_manifest.json = {"algorithm": "crc32", "files": {path: [size, crc]}},
paths relative to the step directory. Bad checkpoints are moved (never deleted) to
<checkpoints>/quarantine/<step>-<reason>.
"""

import concurrent.futures
import json
import os
import re
import shutil
import threading
import zlib

__all__ = [
    "MANIFEST",
    "ORBAX_TMP",
    "QUARANTINE",
    "has_manifest",
    "quarantine",
    "remove_orbax_tmp_dirs",
    "step_dirs",
    "verify",
    "write_manifest",
    "write_missing_manifests",
]

MANIFEST = "fp4jax_manifest.json"
QUARANTINE = "quarantine"
ORBAX_TMP = ".orbax-checkpoint-tmp"
_CHUNK = 16 << 20


def step_dirs(directory: str) -> dict[int, str]:
    """{step: path} of the finalised step directories under a checkpoints directory."""
    if not os.path.isdir(directory):
        return {}
    names = (n for n in os.listdir(directory) if n.isdigit())
    return {int(n): os.path.join(directory, n) for n in names if os.path.isdir(os.path.join(directory, n))}


def _crc32(path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names if MANIFEST not in n]
    return sorted(out)


def _checksums(step_dir: str, files: list[str]) -> dict[str, list[int]]:
    # zlib releases the GIL on large buffers: threads hash several files at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = pool.map(lambda f: list(_crc32(os.path.join(step_dir, f))), files)
        return dict(zip(files, sums, strict=True))


def write_manifest(step_dir: str):
    """Records the size and CRC-32 of every file of a finalised step (atomically: tmp file, rename)."""
    manifest = {"algorithm": "crc32", "files": _checksums(step_dir, _files(step_dir))}
    tmp = os.path.join(step_dir, f"{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def write_missing_manifests(directory: str):
    """A manifest for each finalised step that has none (called after orbax finalises a save)."""
    for step_dir in step_dirs(directory).values():
        if not os.path.exists(os.path.join(step_dir, MANIFEST)):
            try:
                write_manifest(step_dir)
            except FileNotFoundError:  # removed by max_to_keep while being hashed
                pass


def has_manifest(step_dir: str) -> bool:
    return os.path.exists(os.path.join(step_dir, MANIFEST))


def verify(step_dir: str, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when every file of the manifest is present with its size and checksum, else what is wrong
    (the first bad file); call only when `has_manifest`. With `share` (index, count): only the manifest's
    files k (in sorted order) with k % count == index, so that `count` processes verify a step together,
    each reading about 1/count of it (every file is checked by exactly one of them)."""
    index, count = share
    try:
        with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its manifest {MANIFEST} is unreadable ({type(exc).__name__})"
    for rel, (size, crc) in sorted(files.items())[index::count]:
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} has {os.path.getsize(path):,} bytes, {size:,} were written"
        if _crc32(path)[1] != crc:
            return f"{rel} does not match the checksum written with it"
    return None


def quarantine(step_dir: str, reason: str) -> str:
    """Moves a bad step directory to <checkpoints>/quarantine/<step>-<reason slug>; returns the new path."""
    directory, step = os.path.split(step_dir.rstrip(os.sep))
    slug = re.sub(r"[^A-Za-z0-9]+", "-", reason).strip("-")[:60] or "bad"
    target = os.path.join(directory, QUARANTINE, f"{step}-{slug}")
    n = 1
    while os.path.exists(target):
        target, n = os.path.join(directory, QUARANTINE, f"{step}-{slug}-{n}"), n + 1
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(step_dir, target)
    return target


def remove_orbax_tmp_dirs(directory: str) -> list[str]:
    """Removes the temporary directories of saves that did not finish (orbax renames a save into place
    only once it is complete, so these never hold a usable checkpoint); returns their names."""
    if not os.path.isdir(directory):
        return []
    tmp = sorted(n for n in os.listdir(directory) if ORBAX_TMP in n)
    for name in tmp:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return tmp
