"""study.records: runs packed one archive per stage unpack to the same files, packing is deterministic,
a metrics.jsonl the trainer wrote is archived without what unpacking rebuilds (and as it is wherever the
rebuild would differ by a byte), and an archive that is not made of run records is refused."""

import io
import json
import lzma
import math
import os
import random
import struct
import tarfile

import pytest

from fp4jax.study import records

# The trainer's constants for a 125M run on an H100 (trainer._fetch: mfu = tokens_per_s * this).
MFU_PER_TOKEN_S = 6 * 124e6 / 989e12


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _trainer_lines(steps=60, batch=32, seq_len=1024, mfu_per_token_s=MFU_PER_TOKEN_S, seed=0) -> list[dict]:
    """metrics.jsonl's lines as trainer._fetch and evaluation write them: training lines (float32 loss,
    grad_norm and lr; step_time_s and what is derived from it; probe values on some), an evaluation
    every 20 updates and the final one; no mfu where mfu_per_token_s is None (a CPU run)."""
    rng = random.Random(seed)
    tokens_per_step, lines = batch * seq_len, []
    for step in range(1, steps + 1):
        step_time = 24.0 + rng.random() if step == 1 else rng.uniform(0.18, 0.25)
        line = {
            "grad_norm": _f32(rng.uniform(0.3, 15.0)),
            "loss": _f32(rng.uniform(4.0, 11.0)),
            "lr": _f32(1.5e-3 * min(1.0, step / 10)),
            "sequences": step * batch,
            "step": step,
            "step_time_s": step_time,
            "tokens": step * tokens_per_step,
            "tokens_per_s": tokens_per_step / step_time,
        }
        if mfu_per_token_s is not None:
            line["mfu"] = line["tokens_per_s"] * mfu_per_token_s
            line["peak_memory_gb"] = 21.26697984
        if step % 25 == 0:
            line.update({"diag/fprop_rel_err": _f32(rng.uniform(0.05, 0.2)), "diag_time_s": rng.random()})
        lines.append(line)
        if step % 20 == 0:
            loss = rng.uniform(4.0, 5.0)
            lines.append(
                {"eval_loss": loss, "eval_time_s": rng.random(), "loss": loss}
                | {"sequences": step * batch, "step": step, "tokens": step * tokens_per_step}
            )
    lines.append(
        {"final_eval_loss": rng.uniform(4.0, 5.0), "final_eval_selection": "spread"}
        | {"final_eval_sequences": 752, "final_eval_time_s": rng.random()}
        | {"sequences": steps * batch, "step": steps, "tokens": steps * tokens_per_step}
    )
    return lines


def _jsonl(lines: list[dict], sort_keys=True) -> bytes:
    """The lines as MetricsWriter writes them."""
    return "".join(json.dumps(line, sort_keys=sort_keys) + "\n" for line in lines).encode()


def _members(archive) -> dict[str, bytes]:
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _slim_lines(data: bytes) -> tuple[dict, list[dict]]:
    """A metrics.slim.jsonl member's header and lines."""
    head, *lines = data.decode().splitlines()
    return json.loads(head), [json.loads(line) for line in lines]


def _runs(root) -> dict[str, bytes]:
    """Two stages of runs with record files and a checkpoint that must stay out of the archive; one run
    has the trainer's metrics, archived slim."""
    files = {
        "ladder/fp8/seed0/metrics.jsonl": b'{"loss": 10.5, "step": 1}\n',
        "ladder/full/seed1/metrics.jsonl": _jsonl(_trainer_lines()),
        "ladder/fp8/seed0/summary.json": b'{"status": "finished"}\n',
        "ladder/full/seed1/train.log": b"step 1 loss 10.6\n",
        "branching/trunk/seed0/regenerated/identity.json": b"{}\n",
    }
    for rel, data in files.items():
        os.makedirs(os.path.dirname(root / rel), exist_ok=True)
        (root / rel).write_bytes(data)
    os.makedirs(root / "ladder/fp8/seed0/checkpoints/100")
    (root / "ladder/fp8/seed0/checkpoints/100/params").write_bytes(b"\0" * 64)
    return files


def _tree(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(root)
        for n in names
    }


def test_unpack_gives_back_every_record_file_and_no_checkpoint(tmp_path):
    files = _runs(tmp_path / "runs")
    written = records.pack(str(tmp_path / "runs"), str(tmp_path / "records"))
    assert sorted(os.path.basename(p) for p in written) == ["branching.tar.xz", "ladder.tar.xz"]
    records.unpack(str(tmp_path / "records"), str(tmp_path / "again"))
    assert _tree(tmp_path / "again") == files


def test_packing_the_same_files_again_gives_the_same_bytes(tmp_path):
    """Deterministic archives (no times or owners in them): a repack of unchanged runs writes nothing,
    and runs with other mtimes pack to the same bytes."""
    _runs(tmp_path / "a")
    records.pack(str(tmp_path / "a"), str(tmp_path / "ra"))
    assert records.pack(str(tmp_path / "a"), str(tmp_path / "ra")) == []
    _runs(tmp_path / "b")
    os.utime(tmp_path / "b/ladder/fp8/seed0/metrics.jsonl", (1, 1))
    records.pack(str(tmp_path / "b"), str(tmp_path / "rb"))
    for name in ("ladder.tar.xz", "branching.tar.xz"):
        assert (tmp_path / "ra" / name).read_bytes() == (tmp_path / "rb" / name).read_bytes()


def test_pack_of_named_stages_only_and_errors_that_name_the_fix(tmp_path):
    _runs(tmp_path / "runs")
    written = records.pack(str(tmp_path / "runs"), str(tmp_path / "records"), ["ladder"])
    assert [os.path.basename(p) for p in written] == ["ladder.tar.xz"]
    with pytest.raises(ValueError, match="no stage literature under .*; it has branching, ladder"):
        records.pack(str(tmp_path / "runs"), str(tmp_path / "records"), ["literature"])
    with pytest.raises(FileNotFoundError, match="no runs at"):
        records.pack(str(tmp_path / "nothing"), str(tmp_path / "records"))
    with pytest.raises(FileNotFoundError, match=r"no \*.tar.xz in"):
        records.unpack(str(tmp_path / "runs"), str(tmp_path / "out"))


def test_an_archive_with_other_files_is_refused_before_anything_is_written(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        info = tarfile.TarInfo("ladder/fp8/seed0/checkpoints/params")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"\0\0\0\0"))
    os.makedirs(tmp_path / "records")
    (tmp_path / "records" / "ladder.tar.xz").write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match="not a run record: repack it with `records pack`"):
        records.unpack(str(tmp_path / "records"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_trainer_metrics_are_archived_slim_and_unpack_to_the_same_bytes(tmp_path):
    """GPU and CPU runs' metrics (with and without mfu) are archived as metrics.slim.jsonl without
    tokens, sequences, tokens_per_s or mfu, float32 values at their shortest; unpacking gives back each
    file byte for byte, as metrics.jsonl."""
    files = {
        "ladder/gpu/seed0/metrics.jsonl": _jsonl(_trainer_lines(steps=200)),
        "ladder/cpu/seed0/metrics.jsonl": _jsonl(_trainer_lines(mfu_per_token_s=None, seed=1)),
    }
    for rel, data in files.items():
        os.makedirs(tmp_path / "runs" / os.path.dirname(rel))
        (tmp_path / "runs" / rel).write_bytes(data)
    records.pack(str(tmp_path / "runs"), str(tmp_path / "records"))
    members = _members(tmp_path / "records" / "ladder.tar.xz")
    assert sorted(members) == ["ladder/cpu/seed0/metrics.slim.jsonl", "ladder/gpu/seed0/metrics.slim.jsonl"]
    for run, mfu in (("gpu", True), ("cpu", False)):
        data = members[f"ladder/{run}/seed0/metrics.slim.jsonl"]
        header, lines = _slim_lines(data)
        assert header["tokens_per_s"] and header["tokens_per_step"] == 32 * 1024
        assert header["sequences_per_step"] == 32 and ("mfu_per_token_s" in header) == mfu
        assert {"grad_norm", "loss", "lr", "diag/fprop_rel_err"} <= set(header["float32"])
        assert not {"tokens", "sequences", "tokens_per_s", "mfu"} & {key for line in lines for key in line}
        assert len(data) < 0.7 * len(files[f"ladder/{run}/seed0/metrics.jsonl"])
    written = records.unpack(str(tmp_path / "records"), str(tmp_path / "again"))
    assert sorted(written) == sorted(files)
    assert _tree(tmp_path / "again") == files


def test_mfu_constant_is_found_where_the_first_quotient_misses_it(tmp_path):
    """mfu / tokens_per_s of the first line need not be the trainer's constant (one division rounds, so
    it may be a neighbour): a file whose first line is such is still archived without mfu."""
    rng = random.Random(3)
    while True:
        step_time = rng.uniform(0.18, 0.25)
        tokens_per_s = 32768 / step_time
        if (tokens_per_s * MFU_PER_TOKEN_S) / tokens_per_s != MFU_PER_TOKEN_S:
            break
    lines = _trainer_lines()
    lines[0]["step_time_s"], lines[0]["tokens_per_s"] = step_time, tokens_per_s
    lines[0]["mfu"] = tokens_per_s * MFU_PER_TOKEN_S
    raw = _jsonl(lines)
    slim = records._slim(raw)
    assert "mfu_per_token_s" in _slim_lines(slim)[0]
    assert records._unslim(slim) == raw


def test_a_field_off_its_rule_by_one_ulp_is_kept_and_unpacks_the_same(tmp_path):
    """One line's tokens_per_s a float step away from tokens per update / step_time_s: the file's
    tokens_per_s is archived as it is (the other rules still apply), and unpacks to the same bytes."""
    lines = _trainer_lines()
    lines[5]["tokens_per_s"] = math.nextafter(lines[5]["tokens_per_s"], math.inf)
    raw = _jsonl(lines)
    os.makedirs(tmp_path / "runs/ladder/fp8/seed0")
    (tmp_path / "runs/ladder/fp8/seed0/metrics.jsonl").write_bytes(raw)
    records.pack(str(tmp_path / "runs"), str(tmp_path / "records"))
    header, slim = _slim_lines(
        _members(tmp_path / "records/ladder.tar.xz")["ladder/fp8/seed0/metrics.slim.jsonl"]
    )
    assert "tokens_per_s" not in header and "tokens_per_step" in header
    assert [line["tokens_per_s"] for line in slim if "step_time_s" in line] == [
        line["tokens_per_s"] for line in lines if "step_time_s" in line
    ]
    records.unpack(str(tmp_path / "records"), str(tmp_path / "again"))
    assert (tmp_path / "again/ladder/fp8/seed0/metrics.jsonl").read_bytes() == raw


def test_mfu_of_no_single_constant_is_kept():
    """A run whose mfu changes constant halfway (another device's peak) keeps its mfu values."""
    lines = _trainer_lines()
    for line in lines[len(lines) // 2 :]:
        if "mfu" in line:
            line["mfu"] = line["tokens_per_s"] * MFU_PER_TOKEN_S * 1.5
    raw = _jsonl(lines)
    header, slim = _slim_lines(records._slim(raw))
    assert "mfu_per_token_s" not in header and header["tokens_per_s"]
    assert [line["mfu"] for line in slim if "step_time_s" in line] == [
        line["mfu"] for line in lines if "step_time_s" in line
    ]
    assert records._unslim(records._slim(raw)) == raw


@pytest.mark.parametrize(
    "raw",
    [
        _jsonl(_trainer_lines(), sort_keys=False),  # every rule fits, but the keys are not in sorted order
        _jsonl(_trainer_lines()).replace(b": ", b":"),  # other separators
        _jsonl(_trainer_lines()).rstrip(b"\n") + b'\n{"step": 61, ',  # a line cut short
        b"",
    ],
    ids=["unsorted", "separators", "cut", "empty"],
)
def test_a_file_that_would_not_rebuild_exactly_is_archived_as_it_is(tmp_path, raw):
    os.makedirs(tmp_path / "runs/ladder/fp8/seed0")
    (tmp_path / "runs/ladder/fp8/seed0/metrics.jsonl").write_bytes(raw)
    records.pack(str(tmp_path / "runs"), str(tmp_path / "records"))
    assert _members(tmp_path / "records/ladder.tar.xz") == {"ladder/fp8/seed0/metrics.jsonl": raw}
    records.unpack(str(tmp_path / "records"), str(tmp_path / "again"))
    assert (tmp_path / "again/ladder/fp8/seed0/metrics.jsonl").read_bytes() == raw


def _archive(path, members: dict[str, bytes]) -> None:
    """An archive of `members` as any packer may have written it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ))


def test_archives_of_plain_metrics_still_unpack(tmp_path):
    """Archives packed before metrics.slim.jsonl existed hold the trainer's metrics.jsonl as it is."""
    members = {
        "ladder/fp8/seed0/metrics.jsonl": _jsonl(_trainer_lines()),
        "ladder/fp8/seed0/summary.json": b'{"status": "finished"}\n',
    }
    _archive(tmp_path / "records/ladder.tar.xz", members)
    written = records.unpack(str(tmp_path / "records"), str(tmp_path / "runs"))
    assert sorted(written) == sorted(members)
    assert _tree(tmp_path / "runs") == members


@pytest.mark.parametrize(
    "members, message",
    [
        (
            {"b/metrics.jsonl": b"{}\n", "b/metrics.slim.jsonl": records._slim(_jsonl(_trainer_lines()))},
            "holds both b/metrics.jsonl and b/metrics.slim.jsonl",
        ),
        (
            {"b/metrics.slim.jsonl": _jsonl(_trainer_lines())},
            "does not rebuild a metrics.jsonl: its first line",
        ),
        (
            {"b/metrics.slim.jsonl": b'{"format": "fp4jax metrics.slim 1", "loss_scale": 2}\n{"step": 1}'},
            r"rules this fp4jax does not know \(loss_scale\)",
        ),
    ],
    ids=["both", "no-header", "unknown-rule"],
)
def test_a_slim_member_that_cannot_be_unpacked_is_refused_before_anything_is_written(
    tmp_path, members, message
):
    """Nothing is written, not even the sound archive sorted before the bad one."""
    _archive(tmp_path / "records/a.tar.xz", {"a/summary.json": b"{}\n"})
    _archive(tmp_path / "records/b.tar.xz", members)
    with pytest.raises(ValueError, match=message):
        records.unpack(str(tmp_path / "records"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_slim_member_outside_the_runs_root_is_refused_before_anything_is_written(tmp_path):
    """The path checks extractall(filter="data") makes of the other members."""
    _archive(tmp_path / "records/a.tar.xz", {"a/summary.json": b"{}\n"})
    _archive(
        tmp_path / "records/b.tar.xz", {"../b/metrics.slim.jsonl": records._slim(_jsonl(_trainer_lines()))}
    )
    with pytest.raises(tarfile.OutsideDestinationError):
        records.unpack(str(tmp_path / "records"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "b").exists()
