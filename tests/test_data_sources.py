"""Readers: json.gz files, file resolution, bad input, and TFDS == json.gz on the bundled C4 sample."""

import gzip
import json
import shutil
from pathlib import Path

import pytest

from fp4jax.data import DataError
from fp4jax.data.assets import BUNDLED_DATA_DIR
from fp4jax.data.sources import (
    ReadStats,
    eval_files,
    expand_braces,
    json_sources,
    read_json_file,
    tfds_source,
    train_files,
)


def _write_jsonl_gz(path, lines):
    with gzip.open(path, "wb") as f:
        f.write("".join(line + "\n" for line in lines).encode())
    return path


def _read(path, on_bad_record="error", stats=None):
    return list(read_json_file(str(path), on_bad_record, stats or ReadStats()))


def test_reads_text_in_file_order(tmp_path):
    path = _write_jsonl_gz(tmp_path / "a.json.gz", ['{"text":"one","url":"u"}', "", '{"text":"two"}'])
    stats = ReadStats()
    assert _read(path, stats=stats) == ["one", "two"]
    assert (stats.documents, stats.skipped) == (2, 0)


def test_plain_jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text":"x"}\n{"text":"y"}\n')
    assert _read(path) == ["x", "y"]


def test_expand_braces():
    assert expand_braces("c4-train.{00768..00770}-of-01024.json.gz") == [
        "c4-train.00768-of-01024.json.gz",
        "c4-train.00769-of-01024.json.gz",
        "c4-train.00770-of-01024.json.gz",
    ]
    assert expand_braces("{a,b}{1..2}") == ["a1", "a2", "b1", "b2"]
    assert expand_braces("plain*.gz") == ["plain*.gz"]


def test_bundled_files():
    assert [f.name for f in train_files("bundled", "c4-train.*.json.gz")] == [
        "c4-train.00000-of-00002.json.gz",
        "c4-train.00001-of-00002.json.gz",
    ]
    assert [f.name for f in eval_files("bundled", "c4-validation.*.json.gz")] == [
        "c4-validation.00000-of-00001.json.gz"
    ]


def test_glob_path_and_mlperf_range(tmp_path):
    for i in (767, 768, 769, 896):
        _write_jsonl_gz(tmp_path / f"c4-train.{i:05d}-of-01024.json.gz", ['{"text":"t"}'])
    _write_jsonl_gz(tmp_path / "c4-validation.00000-of-00008.json.gz", ['{"text":"v"}'])
    ranged = train_files(str(tmp_path), "c4-train.{00768..00895}-of-01024.json.gz")
    assert [f.name[9:14] for f in ranged] == ["00768", "00769"]
    globbed = train_files(str(tmp_path / "c4-train.0076*.json.gz"), "ignored")
    assert [f.name[9:14] for f in globbed] == ["00767", "00768", "00769"]
    assert len(eval_files(str(tmp_path / "c4-train.0076*.json.gz"), "c4-validation.*.json.gz")) == 1


def test_missing_directory(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        train_files(str(tmp_path / "nope"), "*.json.gz")


def test_empty_directory(tmp_path):
    with pytest.raises(DataError, match="is empty"):
        train_files(str(tmp_path), "c4-train.*.json.gz")


def test_no_matching_files(tmp_path):
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(DataError, match="no files match 'c4-train"):
        train_files(str(tmp_path), "c4-train.*.json.gz")


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = _write_jsonl_gz(tmp_path / "bad.json.gz", ['{"text":"a"}', '{"text": broken', '{"url":"no text"}'])
    with pytest.raises(DataError, match=r"bad\.json\.gz:2: malformed JSON") as err:
        _read(path)
    assert "\n" not in str(err.value)
    stats = ReadStats()
    assert _read(path, "skip", stats) == ["a"]
    assert (stats.documents, stats.skipped) == (1, 2)


def test_corrupted_gzip_names_file_and_line(tmp_path):
    good = _write_jsonl_gz(
        tmp_path / "good.json.gz", [json.dumps({"text": f"doc {i} " * 50}) for i in range(200)]
    )
    data = good.read_bytes()
    truncated = tmp_path / "truncated.json.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"truncated\.json\.gz: corrupted data after line \d+") as err:
        _read(truncated)
    assert "\n" not in str(err.value)
    stats = ReadStats()
    docs = _read(truncated, "skip", stats)
    assert 0 < len(docs) < 200 and stats.skipped == 1


def test_not_gzip_at_all(tmp_path):
    path = tmp_path / "fake.json.gz"
    path.write_text('{"text":"not compressed"}\n')
    with pytest.raises(DataError, match=r"fake\.json\.gz: corrupted data after line 0"):
        _read(path)


def test_source_fingerprint_tracks_file(tmp_path):
    path = shutil.copy(BUNDLED_DATA_DIR / "c4-train.00001-of-00002.json.gz", tmp_path / "c.json.gz")
    before = json_sources([Path(path)])[0].fingerprint
    with open(path, "ab") as f:
        f.write(gzip.compress(b'{"text":"appended"}\n'))
    assert json_sources([Path(path)])[0].fingerprint != before


def test_bad_record_policy_is_checked():
    with pytest.raises(DataError, match="on_bad_record"):
        json_sources([], on_bad_record="ignore")


# --------------------------------------------------------------------------------------------------------
# TFDS: the bundled sample, converted at test time into a prepared c4/en:3.0.1 dataset, reads back as the
# same documents as the json.gz files. The layout is the one MaxText's TFDS test copy of C4 has: the train
# split is c4-train.00000-of-00002.json.gz written round-robin into 8 shards (document k in shard k % 8 at
# position k // 8), the validation split the first 200 documents of c4-validation round-robin into 2
# shards. The reader goes shard after shard, so it yields that interleaving.

TFDS_SPLITS = {  # split: (bundled file, documents, shards)
    "train": ("c4-train.00000-of-00002.json.gz", None, 8),
    "validation": ("c4-validation.00000-of-00001.json.gz", 200, 2),
}


def _round_robin(docs, num_shards):
    per_shard = len(docs) // num_shards
    return [docs[j * num_shards + s] for s in range(num_shards) for j in range(per_shard)]


@pytest.fixture(scope="module")
def bundled_json():
    return {split: _read(BUNDLED_DATA_DIR / f)[:n] for split, (f, n, _) in TFDS_SPLITS.items()}


def _write_tfds_c4(data_dir: Path, docs: dict, file_format: str) -> Path:
    """`docs` ({split: texts}) as a prepared TFDS c4/en:3.0.1 dataset under data_dir, in TFDS's own
    formats: tf.train.Example records of a {"text": Text} feature dict, dataset_info.json from TFDS's
    DatasetInfo proto, features.json from the feature dict. Returns the dataset directory."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from google.protobuf import json_format
    from tensorflow_datasets.core.proto import dataset_info_pb2

    if file_format == "tfrecord":
        open_writer = pytest.importorskip("tensorflow").io.TFRecordWriter
    else:
        open_writer = pytest.importorskip("array_record.python.array_record_module").ArrayRecordWriter
    features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
    dataset_dir = data_dir / "c4" / "en" / "3.0.1"
    dataset_dir.mkdir(parents=True)
    template = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
    splits = []
    for split, texts in docs.items():
        num_shards = TFDS_SPLITS[split][2]
        for shard in range(num_shards):
            name = f"c4-{split}.{file_format}-{shard:05d}-of-{num_shards:05d}"
            writer = open_writer(str(dataset_dir / name))
            for text in texts[shard::num_shards]:
                writer.write(features.serialize_example({"text": text}))
            writer.close()
        lengths = [len(texts[s::num_shards]) for s in range(num_shards)]
        split_info = dataset_info_pb2.SplitInfo(name=split, shard_lengths=lengths, filepath_template=template)
        splits.append(split_info)
    info = dataset_info_pb2.DatasetInfo(
        name="c4", config_name="en", version="3.0.1", file_format=file_format, splits=splits
    )
    (dataset_dir / "dataset_info.json").write_text(json_format.MessageToJson(info, sort_keys=True))
    features.save_config(str(dataset_dir))
    return dataset_dir


def test_tfds_tfrecord_matches_json(bundled_json, tmp_path):
    pytest.importorskip("tensorflow")  # reading TFRecord data needs TensorFlow
    _write_tfds_c4(tmp_path, bundled_json, "tfrecord")
    for split, (_, _, num_shards) in TFDS_SPLITS.items():
        texts = list(tfds_source("c4/en:3.0.1", str(tmp_path), split).documents())
        assert sorted(texts) == sorted(bundled_json[split])
        assert texts == _round_robin(bundled_json[split], num_shards)


def test_tfds_array_record_matches_json(bundled_json, tmp_path):
    """The TensorFlow-free reading path: ArrayRecord data, read through as_data_source."""
    _write_tfds_c4(tmp_path, {"validation": bundled_json["validation"]}, "array_record")
    texts = list(tfds_source("c4/en:3.0.1", str(tmp_path), "validation").documents())
    assert texts == _round_robin(bundled_json["validation"], 2)


def test_tfds_missing_dataset(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(DataError, match="c4/en:3.0.1") as err:
        tfds_source("c4/en:3.0.1", str(tmp_path), "train")
    assert "\n" not in str(err.value)
