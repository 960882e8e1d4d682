"""The streaming safetensors writers: what they write, the library reads back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from common.weights.format import (
    safetensors_bytes,
    safetensors_chunks,
    serialize_state_dict,
    writable,
)
from learner.checkpoint import save_file


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "q.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(8, generator=g).to(torch.float16),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "positions": torch.arange(5, dtype=torch.int64),
        "step": torch.tensor(3, dtype=torch.int32),  # 0-dim
        "mask": torch.rand(5, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
    }


def check(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t), name


def test_bytes_round_trip_through_the_library() -> None:
    data = safetensors_bytes(state(), metadata={"format": "pt"})
    check(safetensors.torch.load(bytes(data)), state())
    header_len = int.from_bytes(data[:8], "little")
    assert (8 + header_len) % 8 == 0
    header = json.loads(bytes(data[8 : 8 + header_len]))
    assert header["__metadata__"] == {"format": "pt"}
    sizes = {n: t.element_size() for n, t in state().items()}
    for name, spec in header.items():
        if name != "__metadata__":
            assert spec["data_offsets"][0] % sizes[name] == 0, name


def test_file_round_trips_and_matches_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file(state(), path, metadata={"format": "pt"})
    check(safetensors.torch.load_file(str(path)), state())
    assert path.read_bytes() == bytes(safetensors_bytes(state(), metadata={"format": "pt"}))


def test_unknown_dtypes_are_left_to_the_library() -> None:
    assert writable(state())
    assert not writable({"c": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single_states(n: int, tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.ones(3) for i in range(n)}
    save_file(tensors, tmp_path / "x.safetensors")
    check(safetensors.torch.load_file(str(tmp_path / "x.safetensors")), tensors)


@pytest.mark.parametrize("size", [1, 7, 64, 333, 10**6])
def test_chunks_are_the_serialised_bytes_cut_at_the_chunk_size(size: int) -> None:
    tied = state() | {"head.weight": state()["embed.weight"]}  # shared storage, as tied heads
    for tensors in (tied, {"c": torch.ones(3, dtype=torch.complex64), "x": torch.zeros(2)}):
        whole = bytes(serialize_state_dict(tensors))
        total, pieces = safetensors_chunks(tensors, size)
        chunks = [bytes(p) for p in pieces]
        assert total == len(whole) and b"".join(chunks) == whole
        assert all(len(c) == size for c in chunks[:-1]) and 0 < len(chunks[-1]) <= size
