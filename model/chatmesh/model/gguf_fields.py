"""A GGUF file's key-value metadata (the tokenizer, the chat template, the context length) read straight from the
file's header, without its tensors.

`gguf.GGUFReader` maps every field element to a numpy view (a SmolLM2 file's 49,152 tokens and 48,900 merges
are ~1 M views): ~3 s of CPU in every process that loads a model profile (chat, the gateway and the `sim`
engine at each start). Reading the same bytes with `struct` takes ~0.1 s. The values are what
`ReaderField.contents()` returns (int, float, bool, str, or a list of them); a file this reader does not take
(another byte order, another version, nested arrays) is read by GGUFReader instead, so nothing is refused here
that gguf reads. The local engine, which needs the tensors, keeps its GGUFReader and reads the fields through
`of_reader`."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# GGUFValueType -> struct format of one little-endian value
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class Unsupported(ValueError):
    """A GGUF this reader does not parse (GGUFReader does, or says why not)."""


def read(path: str | Path) -> dict[str, object]:
    """Every key-value field of the GGUF at `path`, by key."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data)
    except Unsupported:
        from gguf import GGUFReader

        return dict(of_reader(GGUFReader(str(path))))


def of_reader(reader: Any) -> Mapping[str, object]:
    """The key-value fields of an open `gguf.GGUFReader`, each converted when read."""
    return _ReaderFields(reader)


class _ReaderFields(Mapping[str, object]):
    def __init__(self, reader: Any) -> None:
        # GGUFReader also lists the header as pseudo-fields (GGUF.version, ...); they are no key-value metadata
        self._fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}

    def __getitem__(self, key: str) -> object:
        value: object = self._fields[key].contents()
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


def _parse(data: mmap.mmap | bytes) -> dict[str, object]:
    if data[:4] != MAGIC:
        raise Unsupported("not a GGUF file")
    version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
    if version not in VERSIONS:
        raise Unsupported(f"GGUF version {version}")
    at = 24
    fields: dict[str, object] = {}
    for _ in range(count):
        key, at = _string(data, at)
        (kind,), at = struct.unpack_from("<I", data, at), at + 4
        fields[key], at = _value(data, at, kind)
    return fields


def _string(data: mmap.mmap | bytes, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    end = at + 8 + n
    if end > len(data):
        raise Unsupported("a string runs past the end of the file")
    return str(data[at + 8:end], "utf-8"), end


def _value(data: mmap.mmap | bytes, at: int, kind: int) -> tuple[object, int]:
    if kind == STRING:
        return _string(data, at)
    if kind in SCALARS:
        fmt = "<" + SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
    if kind != ARRAY:
        raise Unsupported(f"value type {kind}")
    item, n = struct.unpack_from("<IQ", data, at)
    at += 12
    if item == STRING:
        out: list[object] = []
        for _ in range(n):
            text, at = _string(data, at)
            out.append(text)
        return out, at
    if item not in SCALARS:
        raise Unsupported(f"an array of value type {item}")
    fmt = f"<{n}{SCALARS[item]}"
    size = struct.calcsize(fmt)
    if at + size > len(data):
        raise Unsupported("an array runs past the end of the file")
    return list(struct.unpack_from(fmt, data, at)), at + size
