"""The patched DeepSeek FP8 activation kernel's work split, modelled on CPU (FlashInfer patch 0001).

The kernel (``activationDeepSeekKernel``) deals the 16-byte vectors of all rows out in spans of
``NumChunksPerIter * WarpSize`` consecutive vectors, one span per warp and iteration, and keeps
each warp's position as (row, first vector in the row), advanced by the grid's stride without a
division per iteration; the launcher sizes the grid (``launchActivationDeepSeek``). Nothing here
runs the kernel: ``walk`` restates its index arithmetic, line for line, in Python, so that the
properties the kernel's correctness and its small-batch speed rest on are checked for every
width, dtype and grid size the harness runs, before a GPU runs the real thing:

* every vector of every row is visited exactly once (no row, part of a row or scaling block is
  left out or written twice), also when the grid is smaller than the work (the stride loop);
* the lanes of a scaling block (8 for E4m3, 16 for 16-bit types) are aligned lanes of one warp
  reading one row and one block, so the kernel's butterfly max stays inside the block;
* with the launcher's grid, a small batch (decode, up to 16 tokens) takes one span per warp:
  one index load, one data load and one store on each warp's dependent path, and every lane of a
  narrow (256-wide, TP8) row has a vector.

The GPU harness (gpu/run.py) checks the kernel itself: bit-identity with the pristine kernel on
every case kind.
"""
from __future__ import annotations

import numpy as np
import pytest

WARP_SIZE = 32
NUM_CHUNKS_PER_ITER = 2
NUM_THREADS_PER_CTA = 128
NUM_ELTS_PER_SF = 128
NUM_VECS_PER_SPAN = NUM_CHUNKS_PER_ITER * WARP_SIZE
ELT_BYTES = {"e4m3": 1, "bf16": 2, "fp16": 2}


def launcher_grid(num_rows_bound: int, output_dim: int, dtype: str, num_ctas_resident: int) -> int:
    """launchActivationDeepSeek: CTAs for one span per warp, at most those resident at once."""
    num_elts_per_thread = 16 // ELT_BYTES[dtype]
    num_vecs_per_cta = NUM_CHUNKS_PER_ITER * NUM_THREADS_PER_CTA
    num_vecs = num_rows_bound * (output_dim // num_elts_per_thread)
    return max(1, min(num_ctas_resident, -(-num_vecs // num_vecs_per_cta)))


def walk(num_rows: int, output_dim: int, dtype: str, grid: int):
    """The kernel's loop: per warp and iteration, each lane's (chunk, row, hiddenIdx).

    Returns arrays (warp, iteration, chunk, lane, row, hidden) over every lane-chunk whose row is
    below numRows (the others load nothing).
    """
    num_elts_per_thread = 16 // ELT_BYTES[dtype]
    num_vecs_per_row = output_dim // num_elts_per_thread
    num_warps_per_cta = NUM_THREADS_PER_CTA // WARP_SIZE
    stride_vecs = grid * num_warps_per_cta * NUM_VECS_PER_SPAN
    stride_rows, stride_cols = divmod(stride_vecs, num_vecs_per_row)
    out = []
    lanes = np.arange(WARP_SIZE)
    for warp_idx in range(grid * num_warps_per_cta):
        span_row, span_col = divmod(warp_idx * NUM_VECS_PER_SPAN, num_vecs_per_row)
        iteration = 0
        while span_row < num_rows:
            for chunk in range(NUM_CHUNKS_PER_ITER):
                vec = span_col + chunk * WARP_SIZE + lanes
                row = span_row + vec // num_vecs_per_row
                hidden = (vec % num_vecs_per_row) * num_elts_per_thread
                keep = row < num_rows
                n = int(keep.sum())
                out.append(np.stack([np.full(n, warp_idx), np.full(n, iteration), np.full(n, chunk),
                                     lanes[keep], row[keep], hidden[keep]]))
            span_col += stride_cols
            if span_col >= num_vecs_per_row:
                span_col -= num_vecs_per_row
                span_row += 1
            span_row += stride_rows
            iteration += 1
    if not out:
        return (np.zeros(0, dtype=np.int64),) * 6
    return tuple(np.concatenate(out, axis=1))


CASES = [(rows, width, dtype, grid)
         for width in (128, 256, 384, 1536, 2048)
         for dtype in ("e4m3", "bf16")
         for rows, grid in ((1, 1), (16, 3), (128, 1056), (1000, 7), (257, 132))]


@pytest.mark.parametrize("num_rows,width,dtype,grid", CASES)
def test_every_vector_is_visited_once(num_rows, width, dtype, grid):
    warp, iteration, chunk, lane, row, hidden = walk(num_rows, width, dtype, grid)
    num_elts_per_thread = 16 // ELT_BYTES[dtype]
    flat = row * width + hidden
    assert len(flat) == num_rows * width // num_elts_per_thread
    assert len(np.unique(flat)) == len(flat)
    assert (hidden % num_elts_per_thread == 0).all() and (hidden < width).all() and (hidden >= 0).all()


@pytest.mark.parametrize("num_rows,width,dtype,grid", CASES)
def test_scaling_block_lanes_share_one_row_and_block(num_rows, width, dtype, grid):
    warp, iteration, chunk, lane, row, hidden = walk(num_rows, width, dtype, grid)
    threads_per_sf = NUM_ELTS_PER_SF // (16 // ELT_BYTES[dtype])
    group = (warp * 1000 + iteration) * 1000 + chunk * 100 + lane // threads_per_sf
    block = row * (width // NUM_ELTS_PER_SF) + hidden // NUM_ELTS_PER_SF
    for g in np.unique(group):
        sel = group == g
        assert sel.sum() == threads_per_sf, "a lane group with vectors of no row"
        assert len(np.unique(block[sel])) == 1, "a butterfly max would mix two scaling blocks"
    # and each block is exactly one lane group
    assert len(np.unique(block)) == len(np.unique(group))


@pytest.mark.parametrize("num_tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("num_ctas_resident", [132 * 6, 148 * 8, 160 * 8])  # H200 (SM90 variant), B200, B300
def test_decode_takes_one_span_per_warp(num_tokens, num_ctas_resident):
    """EP8 decode, width 2048, tile 8 (the tile the runner picks for so few tokens): the grid the
    launcher sizes from its bound has a warp for every span of the real rows, so no warp iterates
    twice (pristine: one dependent data load per CTA as well)."""
    top_k, tile, width = 8, 8, 2048
    bound = num_tokens * top_k * tile  # the launcher's bound on the permuted rows
    grid = launcher_grid(bound, width, "e4m3", num_ctas_resident)
    real_rows = min(num_tokens * top_k, 32) * tile  # at most one padded tile per local slot
    warp, iteration, *_ = walk(real_rows, width, "e4m3", grid)
    assert iteration.max() == 0
    spans_per_row = width // 16 // NUM_VECS_PER_SPAN
    assert spans_per_row == 2  # a 2048-wide E4m3 row is shared by two warps, not one warp twice


def test_narrow_rows_keep_every_lane_busy():
    """TP8, width 256: four rows per span, so every lane of every chunk has a vector."""
    warp, iteration, chunk, lane, row, hidden = walk(64, 256, "e4m3", 4)
    per_warp_chunk = {}
    for w, i, c, r in zip(warp, iteration, chunk, row):
        per_warp_chunk.setdefault((w, i, c), set()).add(int(r))
    counts = np.bincount(np.array([len(v) for v in per_warp_chunk.values()]))
    assert len(per_warp_chunk) * WARP_SIZE == len(lane)  # 32 lanes in every chunk
    assert counts.argmax() == 2  # two 256-wide rows per 32-lane chunk


def test_prefill_grid_is_one_wave_and_loops():
    """Large batches: the grid stops at the resident CTAs and the warps loop (the prefill path)."""
    grid = launcher_grid(32768 * 8 * 128, 2048, "e4m3", 148 * 8)
    assert grid == 148 * 8
    warp, iteration, *_ = walk(600, 2048, "e4m3", 3)
    assert iteration.max() > 0
