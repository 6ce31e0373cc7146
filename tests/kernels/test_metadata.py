"""AttentionMetadata.build: offsets, padded block tables, slot mapping, positions, validation."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.metadata import AttentionMetadata


def test_build_lays_out_tokens_and_slots():
    # seq 0: 3 cached + 2 new in blocks [7, 2]; seq 1: a decode at position 6 (block 9, offset 2)
    meta = AttentionMetadata.build([2, 1], [5, 7], [[7, 2], [4, 9]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 7] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == [[7, 2], [4, 9]]
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 2]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.positions.tolist() == [3, 4, 6] and meta.positions.dtype == torch.int64
    assert meta.query_start_loc_cpu == [0, 2, 3]


def test_build_pads_ragged_tables_and_reports_host_copies():
    meta = AttentionMetadata.build([4, 1, 1], [4, 9, 33], [[3], [5, 0, 8], [1, 2, 6, 4, 7, 10, 11, 12, 13]], 4)
    assert meta.block_tables.shape == (3, 9)
    assert meta.block_tables[0].tolist() == [3] + [0] * 8
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 8 * 4 + 0, 13 * 4 + 0]
    assert (meta.num_seqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (3, 6, 4, 33)
    assert meta.context_lens_cpu == [0, 8, 32] and meta.query_starts_cpu == [0, 4, 5]


@pytest.mark.parametrize(
    "args,field",
    [
        (([0], [3], [[1]], 4), "query_lens"),
        (([4], [3], [[1]], 4), "seq_lens"),
        (([1], [9], [[1, 2]], 4), "block_tables"),
        (([1, 1], [1], [[1]], 4), "disagree"),
        (([1], [1], [[1]], 0), "block_size"),
    ],
)
def test_build_rejects_inconsistent_input(args, field):
    with pytest.raises(ValueError, match=field):
        AttentionMetadata.build(*args)


def test_empty_step():
    meta = AttentionMetadata.build([], [], [], 16)
    assert meta.num_tokens == 0 and meta.max_query_len == 0 and meta.slot_mapping.numel() == 0
    assert meta.positions.numel() == 0 and meta.block_tables.shape == (0, 1)
