"""The page checksum a worker sends and memd checks: the same number from the same bytes, on either side."""

from __future__ import annotations

import ctypes
import struct

import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from shared.page_checksum import _weights, checksums_at, page_checksums, word_sums

PAGE = 4096


def pages(seed: int, count: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (count, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_shared_memory_pool_sums_pages_with_xxh3_whoever_computes_it():
    data = pages(1)
    expected = [xxhash.xxh3_64_intdigest(bytes(data[b].numpy())) for b in (0, 4, 2)]
    assert page_checksums(data, [0, 4, 2]) == expected                      # the worker, over its tensor
    mapping = ctypes.create_string_buffer(data.numpy().tobytes())
    assert checksums_at(ctypes.addressof(mapping), PAGE, [0, 4, 2]) == expected          # memd, its mapping


def test_the_device_sum_is_the_weighted_word_sum_modulo_2_to_the_64():
    """Computed here with torch on the host, as a CUDA pool's swap tier does: the same math as on the GPU."""
    data, weights = pages(2), _weights(torch.device("cpu"), PAGE // 8).tolist()
    for block in (0, 5):
        words = struct.unpack(f"<{PAGE // 8}q", bytes(data[block].numpy()))
        assert word_sums(data, [block]) == [sum(w * c for w, c in zip(words, weights, strict=True)) % 2**64 or 1]


@given(word=st.integers(0, PAGE // 8 - 1), delta=st.integers(1, 2**64 - 1))
def test_any_change_of_one_word_changes_the_device_sum(word: int, delta: int):
    data = pages(3, 1)
    before = word_sums(data, [0])
    words = data.view(torch.int64)
    words[0, word] = ((words[0, word].item() + delta + 2**63) % 2**64) - 2**63
    assert word_sums(data, [0]) != before


def test_no_page_sums_to_0_which_means_unknown():
    assert page_checksums(torch.zeros(2, PAGE, dtype=torch.uint8), [0]) != [0]
    assert word_sums(torch.zeros(2, PAGE, dtype=torch.uint8), [0, 1]) == [1, 1]


def test_pages_are_hashed_without_the_gil_and_the_fallback_agrees(monkeypatch):
    """The native call lets memd's event loop run while a thread hashes; without it the numbers are the same."""
    from shared import page_checksum

    assert page_checksum._XXH3 is not None
    data = pages(4)
    native = page_checksums(data, [1, 3])
    monkeypatch.setattr(page_checksum, "_XXH3", None)
    assert page_checksums(data, [1, 3]) == native
