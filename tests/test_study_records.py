"""study.records: runs packed one archive per stage unpack to the same files, packing is deterministic,
and an archive that is not made of run records is refused."""

import io
import os
import tarfile

import pytest

from fp4jax.study import records


def _runs(root) -> dict[str, bytes]:
    """Two stages of runs with record files and a checkpoint that must stay out of the archive."""
    files = {
        "ladder/fp8/seed0/metrics.jsonl": b'{"loss": 10.5, "step": 1}\n',
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
