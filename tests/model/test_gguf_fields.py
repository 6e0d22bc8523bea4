"""chatmesh.model.gguf_fields reads a GGUF's key-value fields as gguf's own GGUFReader does (the oracle): the
fetched SmolLM2 file, a file with every value type, and files it leaves to GGUFReader (big-endian)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from chatmesh.model import assets, gguf_fields, profile

EVERY_TYPE: list[tuple[str, object, GGUFValueType, GGUFValueType | None]] = [
    ("u8", 200, GGUFValueType.UINT8, None), ("i8", -100, GGUFValueType.INT8, None),
    ("u16", 60_000, GGUFValueType.UINT16, None), ("i16", -30_000, GGUFValueType.INT16, None),
    ("u32", 4_000_000_000, GGUFValueType.UINT32, None), ("i32", -2_000_000_000, GGUFValueType.INT32, None),
    ("u64", 2**63 + 5, GGUFValueType.UINT64, None), ("i64", -(2**62), GGUFValueType.INT64, None),
    ("f32", 0.1, GGUFValueType.FLOAT32, None), ("f64", 0.1, GGUFValueType.FLOAT64, None),
    ("yes", True, GGUFValueType.BOOL, None), ("no", False, GGUFValueType.BOOL, None),
    ("text", "héllo {{ x }}\n", GGUFValueType.STRING, None), ("empty", "", GGUFValueType.STRING, None),
    ("words", ["a", "", "Ġthe", "<|im_end|>"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ("ints", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("floats", [0.5, -1.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    ("flags", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
]


def gguf_reader_fields(path: Path) -> dict[str, object]:
    return dict(gguf_fields.of_reader(GGUFReader(str(path))))


def write(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    for key, value, kind, sub in EVERY_TYPE:
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def fetched(model_dir: Path) -> tuple[Path, GGUFReader]:
    """The fetched model file and GGUFReader's reading of it (~2 s: read once for the module)."""
    path = assets.gguf_path(model_dir)
    return path, GGUFReader(str(path))


def test_the_fetched_models_fields_are_gguf_readers(fetched: tuple[Path, GGUFReader]) -> None:
    path, reader = fetched
    fields = gguf_fields.read(path)
    assert len(fields["tokenizer.ggml.tokens"]) == 49_152  # type: ignore[arg-type]
    assert fields == dict(gguf_fields.of_reader(reader))


def test_every_value_type_reads_as_gguf_reader_reads_it(tmp_path: Path) -> None:
    path = write(tmp_path / "every.gguf")
    fields = gguf_fields.read(path)
    assert fields == gguf_reader_fields(path)
    assert fields["u64"] == 2**63 + 5 and fields["words"] == ["a", "", "Ġthe", "<|im_end|>"]
    assert fields["yes"] is True


def test_a_file_it_does_not_parse_is_read_by_gguf_reader(tmp_path: Path) -> None:
    path = write(tmp_path / "big.gguf", GGUFEndian.BIG)
    with pytest.raises(gguf_fields.Unsupported):
        gguf_fields._parse(path.read_bytes())
    assert gguf_fields.read(path) == gguf_reader_fields(path)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(write(tmp_path / "whole.gguf").read_bytes()[:-3])
    with pytest.raises(Exception):  # GGUFReader's own refusal of a cut file, whatever it is
        gguf_fields.read(truncated)


def test_a_profile_from_the_fields_is_the_profile_from_the_reader(fetched: tuple[Path, GGUFReader]) -> None:
    path, reader = fetched
    fast = profile.from_gguf_fields(gguf_fields.read(path), path)
    slow = profile.from_gguf_reader(reader, path)
    assert fast.identity == slow.identity
    assert fast.stop_token_ids == slow.stop_token_ids and fast.context_tokens == slow.context_tokens
    text = "Hello, world! 🙂 <|im_start|>"
    assert fast.encode(text) == slow.encode(text)
