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

Both kernels share the walk: ``activationDeepSeekKernel`` with 16-byte vectors, two per lane and
iteration, and ``activationDeepSeekSmallBatchKernel`` with 4 elements per lane, one per iteration
(``VARIANTS``), which the launcher takes when the slots' 16-byte vectors fill at most a quarter of
the resident warps (``launcher_variant``).

The GPU harness (gpu/run.py) checks the kernels themselves: bit-identity with the pristine kernel
on every case kind.
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
SMALL_BATCH_ELTS_PER_THREAD = 4
SMALL_BATCH_WAVE_FRACTION = 4


def elts_per_thread(dtype: str, variant: str) -> int:
    return 16 // ELT_BYTES[dtype] if variant == "wide" else SMALL_BATCH_ELTS_PER_THREAD


def chunks_per_iter(variant: str) -> int:
    return NUM_CHUNKS_PER_ITER if variant == "wide" else 1


VARIANTS = ("wide", "small")


def launcher_variant(num_tokens: int, top_k: int, output_dim: int, dtype: str, num_ctas_resident: int) -> str:
    """launchActivationDeepSeek's choice: small when the slots' 16B vectors fill at most a quarter
    of the resident warps."""
    vecs = num_tokens * top_k * (output_dim // (16 // ELT_BYTES[dtype]))
    warps = -(-vecs // NUM_VECS_PER_SPAN)
    resident_warps = num_ctas_resident * (NUM_THREADS_PER_CTA // WARP_SIZE)
    return "small" if warps * SMALL_BATCH_WAVE_FRACTION <= resident_warps else "wide"


def launcher_grid(num_rows_bound: int, output_dim: int, dtype: str, num_ctas_resident: int,
                  variant: str = "wide") -> int:
    """deepSeekGrid: CTAs for one span per warp, at most those resident at once."""
    num_elts_per_thread = elts_per_thread(dtype, variant)
    num_vecs_per_cta = chunks_per_iter(variant) * NUM_THREADS_PER_CTA
    num_vecs = num_rows_bound * (output_dim // num_elts_per_thread)
    return max(1, min(num_ctas_resident, -(-num_vecs // num_vecs_per_cta)))


def walk(num_rows: int, output_dim: int, dtype: str, grid: int, variant: str = "wide"):
    """The kernel's loop: per warp and iteration, each lane's (chunk, row, hiddenIdx).

    Returns arrays (warp, iteration, chunk, lane, row, hidden) over every lane-chunk whose row is
    below numRows (the others load nothing).
    """
    num_elts_per_thread = elts_per_thread(dtype, variant)
    num_chunks = chunks_per_iter(variant)
    num_vecs_per_span = num_chunks * WARP_SIZE
    num_vecs_per_row = output_dim // num_elts_per_thread
    num_warps_per_cta = NUM_THREADS_PER_CTA // WARP_SIZE
    stride_vecs = grid * num_warps_per_cta * num_vecs_per_span
    stride_rows, stride_cols = divmod(stride_vecs, num_vecs_per_row)
    out = []
    lanes = np.arange(WARP_SIZE)
    for warp_idx in range(grid * num_warps_per_cta):
        span_row, span_col = divmod(warp_idx * num_vecs_per_span, num_vecs_per_row)
        iteration = 0
        while span_row < num_rows:
            for chunk in range(num_chunks):
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


CASES = [(rows, width, dtype, grid, variant)
         for width in (128, 256, 384, 1536, 2048)
         for dtype in ("e4m3", "bf16")
         for rows, grid in ((1, 1), (16, 3), (128, 1056), (1000, 7), (257, 132))
         for variant in VARIANTS]


@pytest.mark.parametrize("num_rows,width,dtype,grid,variant", CASES)
def test_every_vector_is_visited_once(num_rows, width, dtype, grid, variant):
    warp, iteration, chunk, lane, row, hidden = walk(num_rows, width, dtype, grid, variant)
    num_elts_per_thread = elts_per_thread(dtype, variant)
    flat = row * width + hidden
    assert len(flat) == num_rows * width // num_elts_per_thread
    assert len(np.unique(flat)) == len(flat)
    assert (hidden % num_elts_per_thread == 0).all() and (hidden < width).all() and (hidden >= 0).all()


@pytest.mark.parametrize("num_rows,width,dtype,grid,variant", CASES)
def test_scaling_block_lanes_share_one_row_and_block(num_rows, width, dtype, grid, variant):
    warp, iteration, chunk, lane, row, hidden = walk(num_rows, width, dtype, grid, variant)
    threads_per_sf = NUM_ELTS_PER_SF // elts_per_thread(dtype, variant)
    group = (warp * 1000 + iteration) * 1000 + chunk * 100 + lane // threads_per_sf
    block = row * (width // NUM_ELTS_PER_SF) + hidden // NUM_ELTS_PER_SF
    groups, members = np.unique(group, return_counts=True)
    assert (members == threads_per_sf).all(), "a lane group with vectors of no row"
    # one block per lane group: as many distinct (group, block) pairs as groups
    assert len(np.unique(np.stack([group, block]), axis=1).T) == len(groups), \
        "a butterfly max would mix two scaling blocks"
    # and each block is exactly one lane group
    assert len(np.unique(block)) == len(groups)


def max_num_ctas_in_batch_dim(num_tokens: int, top_k: int, num_experts: int, tile: int) -> int:
    """Routing::getMaxNumCtasInBatchDim: the MN-limit array's length, the rows walk's bound in tiles."""
    slots = num_tokens * top_k
    filled = min(num_experts, slots)
    return filled + (slots - filled) // tile


@pytest.mark.parametrize("num_tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("num_ctas_resident", [132 * 6, 148 * 8, 160 * 8])  # H200 (SM90 variant), B200, B300
def test_decode_takes_the_small_batch_kernel_one_span_per_warp(num_tokens, num_ctas_resident):
    """EP8 decode, width 2048, tile 8 (the tile the runner picks for so few tokens): the launcher
    takes the small-batch kernel, whose grid (sized from the rows walk's bound, the MN-limit
    array's tiles) has a warp for every span of the rows a decode batch can have, so no warp
    iterates twice and each lane activates 4 elements (the wide kernel's lanes took 32, a serial
    chain a microsecond long on an H200 at 2 to 16 tokens). The rows counted are the worst case,
    every local slot in a tile of its own; on the H200's SM90 build (6 CTAs per SM) that case at 8
    and 16 tokens needs a second iteration."""
    top_k, tile, width = 8, 8, 2048
    assert launcher_variant(num_tokens, top_k, width, "e4m3", num_ctas_resident) == "small"
    bound = max_num_ctas_in_batch_dim(num_tokens, top_k, 256, tile) * tile
    grid = launcher_grid(bound, width, "e4m3", num_ctas_resident, "small")
    real_rows = min(num_tokens * top_k, 32) * tile  # at most one padded tile per local slot
    warp, iteration, chunk, lane, row, hidden = walk(real_rows, width, "e4m3", grid, "small")
    assert iteration.max() == (1 if num_ctas_resident == 132 * 6 and num_tokens >= 8 else 0)
    assert width // SMALL_BATCH_ELTS_PER_THREAD // WARP_SIZE == 16  # a row is 16 warps, a block 1


@pytest.mark.parametrize("num_tokens,width,experts,variant", [
    (16, 2048, 32, "small"), (64, 2048, 32, "wide"), (256, 2048, 32, "wide"),
    (16, 256, 256, "small"), (256, 256, 256, "small"), (1024, 256, 256, "wide"), (32768, 2048, 32, "wide")])
def test_the_launcher_keeps_the_wide_kernel_where_bandwidth_counts(num_tokens, width, experts, variant):
    """On an H200's SM90 build (132 SMs x 6 CTAs): decode and small TP8 batches take the
    small-batch kernel; from 64 EP8 tokens (where the wide kernel was already 1.4x the pristine
    one) and prefill on, the wide one."""
    assert launcher_variant(num_tokens, 8, width, "e4m3", 132 * 6) == variant


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
