"""Tests of the CPU reference of FlashInfer's DeepSeek FP8 activation (activation_reference.py).

The reference is what the GPU harness (gpu/run.py) holds both kernels against, so it is
tested here on its own: the number formats against torch's (an independent
implementation), the math against a float64 evaluation of the same formula, the
kernel's contract on edge inputs (zeros, all-remote, all-local, tail blocks, NaN-free
extremes), and the routing layout the patched kernel's row walk relies on.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.flashinfer import activation_reference as ref

try:
    import torch  # the project's test venv has torch 2.13 (CPU): an independent FP8/bf16 codec
except ImportError:  # pragma: no cover
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise
    pytest.skip("torch is not installed (the format cross-checks need it)", allow_module_level=True)

RNG = np.random.default_rng(1234)


def random_rows(rng, num_rows, d, dtype="e4m3", scale_exp=(-12, -4), spread=3.0):
    """Stored inputs [R, 2D] and row scales [R, 2D/128] like a FC1 output."""
    nb = d // ref.NUM_ELTS_PER_SF
    values = (rng.standard_normal((num_rows, 2 * d)) * spread).astype(np.float32)
    enc = ref.DTYPES[dtype][2]
    inp = enc(values)
    sf = np.exp2(rng.uniform(*scale_exp, size=(num_rows, 2 * nb))).astype(np.float32)
    return inp, sf


def float64_model(inp, sf, dtype="e4m3"):
    """The same formula evaluated in float64 (no per-operation rounding, no FTZ)."""
    decode = ref.DTYPES[dtype][1]
    r, inner = inp.shape
    d = inner // 2
    nb = d // 128
    x = decode(inp).astype(np.float64).reshape(r, 2, nb, 128)
    s = sf.astype(np.float64).reshape(r, 2, nb, 1)
    x1, x2 = x[:, 0] * s[:, 0], x[:, 1] * s[:, 1]
    with np.errstate(over="ignore"):
        out = x2 / (1.0 + np.exp(-x2)) * x1
    amax = np.abs(out).max(axis=-1)
    scale = np.maximum(amax / 448.0, float(ref.FLT_MIN))
    return out / scale[..., None], scale


# ---------------------------------------------------------------------------------------------
# Number formats


def test_e4m3_decode_known_values():
    assert ref.e4m3_to_float(np.array([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x80])).tolist() == [
        0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0, -0.0]
    assert np.isnan(ref.e4m3_to_float(np.array([0x7F, 0xFF]))).all()


def test_e4m3_decode_matches_torch():
    codes = np.arange(256, dtype=np.uint8)
    ours = ref.e4m3_to_float(codes)
    theirs = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaNs compare equal here


def test_e4m3_encode_roundtrips_every_finite_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(ref.float_to_e4m3(ref.e4m3_to_float(codes)), codes)


def test_e4m3_encode_matches_torch_in_range():
    # Random values, exact midpoints between neighbours (ties to even) and their neighbours.
    finite = np.sort(ref.e4m3_to_float(np.arange(0, 0x7F, dtype=np.uint8)))
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    x = np.concatenate([RNG.uniform(-448, 448, 20000), RNG.standard_normal(20000) * 2.0**-7,
                        mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9)]).astype(np.float32)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ref.float_to_e4m3(x), theirs)


def test_e4m3_encode_saturates_like_satfinite():
    x = np.array([448.0, 449.0, 463.99, 464.0, 480.0, 1e9, np.inf, -500.0, -np.inf, np.nan], np.float32)
    assert ref.float_to_e4m3(x).tolist() == [0x7E] * 7 + [0xFE, 0xFE, 0x7F]


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16bit_formats_match_torch(dtype, torch_dtype):
    x = np.concatenate([RNG.standard_normal(20000) * 100, RNG.standard_normal(2000) * 1e-6]).astype(np.float32)
    _, decode, encode = ref.DTYPES[dtype]
    theirs = torch.from_numpy(x).to(torch_dtype).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(encode(x), theirs)
    np.testing.assert_array_equal(decode(theirs),
                                  torch.from_numpy(theirs.view(np.int16)).view(torch_dtype).float().numpy())


def test_ftz_flushes_subnormals_keeping_sign():
    tiny = np.float32(1e-40)
    assert ref.ftz(np.array([tiny, -tiny, ref.FLT_MIN], np.float32)).tolist() == [0.0, -0.0, float(ref.FLT_MIN)]
    assert np.signbit(ref.ftz(np.array([-tiny], np.float32)))[0]


def test_silu_close_to_exact():
    x = np.linspace(-80, 80, 100001, dtype=np.float32)
    exact = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    got = ref.silu(x).astype(np.float64)
    mask = np.abs(exact) > 1e-30
    assert np.max(np.abs(got[mask] - exact[mask]) / np.abs(exact[mask])) < 2e-5  # |x| * ulp of x * log2e


# ---------------------------------------------------------------------------------------------
# The math


@pytest.mark.parametrize("seed", range(5))
def test_random_rows_match_float64_model(seed):
    rng = np.random.default_rng(seed)
    inp, sf = random_rows(rng, 64, 2048)
    q, scale = ref.activate_rows(inp, sf)
    q64, scale64 = float64_model(inp, sf)
    np.testing.assert_allclose(scale, scale64, rtol=2e-5)
    steps = np.abs(ref.ordinal(q) - ref.ordinal(ref.float_to_e4m3(q64.reshape(q.shape))))
    assert steps.max() <= 1
    assert (steps == 0).mean() > 0.99


def test_block_amax_quantizes_to_448():
    inp, sf = random_rows(RNG, 32, 1024)
    q, scale = ref.activate_rows(inp, sf)
    blocks = np.abs(ref.e4m3_to_float(q)).reshape(32, -1, 128).max(axis=-1)
    np.testing.assert_array_equal(blocks, 448.0)
    assert (scale > ref.FLT_MIN).all()


def test_output_scale_is_amax_over_448_of_each_block():
    inp, sf = random_rows(RNG, 8, 512)
    q, scale = ref.activate_rows(inp, sf)
    nb = 4
    x = ref.e4m3_to_float(inp).reshape(8, 2, nb, 128)
    out = ref._mul(ref.silu(ref._mul(sf[:, nb:, None], x[:, 1])), ref._mul(sf[:, :nb, None], x[:, 0]))
    np.testing.assert_array_equal(scale, np.maximum(np.abs(out).max(-1) / np.float32(448), ref.FLT_MIN))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_instantiations(dtype):
    inp, sf = random_rows(RNG, 16, 1024, dtype=dtype)
    q, scale = ref.activate_rows(inp, sf, dtype)
    q64, scale64 = float64_model(inp, sf, dtype)
    np.testing.assert_allclose(scale, scale64, rtol=2e-5)
    steps = np.abs(ref.ordinal(q, dtype) - ref.ordinal(ref.DTYPES[dtype][2](q64.reshape(q.shape)), dtype))
    assert steps.max() <= 1


def test_zeros():
    inp = np.zeros((4, 1024), np.uint8)
    sf = np.ones((4, 8), np.float32)
    q, scale = ref.activate_rows(inp, sf)
    assert (q == 0).all()  # silu(0) * 0 = +0
    assert (scale == ref.FLT_MIN).all()  # the minimum-scale guard


def test_zero_linear_half_with_negative_gate_gives_negative_zero():
    inp = np.zeros((1, 256), np.uint8)
    inp[0, 128:] = ref.float_to_e4m3(np.full(128, -2.0, np.float32))
    q, scale = ref.activate_rows(inp, np.ones((1, 2), np.float32))
    assert (q == 0x80).all() and scale[0, 0] == ref.FLT_MIN


def test_nan_free_extremes():
    d = 256
    big = np.full((1, 2 * d), 0x7E, np.uint8)  # +448 everywhere
    q, scale = ref.activate_rows(big, np.full((1, 4), 2.0**40, np.float32))
    assert np.isfinite(scale).all() and (q == 0x7E).all()  # out = 448*2^40 squared, finite
    # Small scales: out ~ 2^-123.4 is normal but amax / 448 is subnormal, flushes to zero,
    # and the guard takes over: scale = FLT_MIN, q = out / FLT_MIN ~ 6.7 -> 6.
    q, scale = ref.activate_rows(big, np.full((1, 4), 2.0**-70, np.float32))
    assert (scale == ref.FLT_MIN).all() and (ref.e4m3_to_float(q) == 6.0).all()
    # Tiny scales: the products themselves are subnormal and flush to zero.
    q, scale = ref.activate_rows(big, np.full((1, 4), 2.0**-80, np.float32))
    assert (scale == ref.FLT_MIN).all() and (q == 0).all()
    # A very negative gate: exp overflows to inf, silu -> -0, no NaN.
    neg = big.copy()
    neg[0, d:] = 0xFE  # -448
    q, scale = ref.activate_rows(neg, np.full((1, 4), 2.0**10, np.float32))
    assert (np.abs(ref.e4m3_to_float(q)) == 0).all() and (scale == ref.FLT_MIN).all()
    # Mixed magnitudes in one block: the small ones round to zero or subnormal E4M3, no NaN.
    mixed = np.zeros((1, 2 * d), np.uint8)
    mixed[0, :] = ref.float_to_e4m3(np.float32(1.0))
    mixed[0, 0] = 0x7E
    q, scale = ref.activate_rows(mixed, np.ones((1, 4), np.float32))
    assert not np.isnan(ref.e4m3_to_float(q)).any() and q[0, 0] == 0x7E


@pytest.mark.parametrize("d", [128, 256, 384, 640, 1152, 1536, 2048])
def test_tail_blocks_are_independent(d):
    """Rows of 1, 3, 5, 9 blocks (not multiples of a warp's 4 or an iteration's 8): each
    block's result depends on that block alone."""
    inp, sf = random_rows(RNG, 6, d)
    q, scale = ref.activate_rows(inp, sf)
    nb = d // 128
    for b in range(nb):
        cols = np.r_[b * 128:(b + 1) * 128, d + b * 128:d + (b + 1) * 128]
        qb, sb = ref.activate_rows(inp[:, cols], sf[:, [b, nb + b]])
        np.testing.assert_array_equal(qb, q[:, b * 128:(b + 1) * 128])
        np.testing.assert_array_equal(sb[:, 0], scale[:, b])


def test_rejects_partial_blocks():
    with pytest.raises(ValueError):
        ref.activate_rows(np.zeros((1, 2 * 200), np.uint8), np.ones((1, 4), np.float32))


def test_gated_neutral_controls_match_plain_up_to_sign_of_zero():
    inp, sf = random_rows(RNG, 8, 512)
    plain_q, plain_s = ref.activate_rows(inp, sf)
    ones, zeros = np.ones(8, np.float32), np.zeros(8, np.float32)
    gq, gs = ref.activate_rows(inp, sf, gated=ref.GatedAct(alpha=ones, beta=zeros))
    np.testing.assert_array_equal(gs, plain_s)
    np.testing.assert_array_equal(ref.ordinal(gq), ref.ordinal(plain_q))


def test_gated_clamp_and_alpha_beta():
    d = 128
    x_lin = np.linspace(-8, 8, d, dtype=np.float32)
    x_glu = np.linspace(-8, 8, d, dtype=np.float32)[::-1].copy()
    inp = ref.float_to_e4m3(np.concatenate([x_lin, x_glu]))[None]
    limit, alpha, beta = np.float32(2.0), np.float32(1.5), np.float32(0.25)
    q, scale = ref.activate_rows(inp, np.ones((1, 2), np.float32),
                                 gated=ref.GatedAct(np.array([alpha]), np.array([beta]), np.array([limit])))
    xl = np.clip(ref.e4m3_to_float(inp[0, :d]).astype(np.float64), -2, 2)
    xg = np.minimum(ref.e4m3_to_float(inp[0, d:]).astype(np.float64), 2)
    want = xg / (1 + np.exp(-1.5 * xg)) * (xl + 0.25)
    np.testing.assert_allclose(scale[0, 0], np.abs(want).max() / 448, rtol=1e-5)
    got = ref.e4m3_to_float(q[0]) * scale[0, 0]
    np.testing.assert_allclose(got, want, rtol=0.07, atol=scale[0, 0] * 2.0**-9)


@pytest.mark.parametrize("only", ["alpha", "beta"])
def test_gated_with_one_control_matches_float64(only):
    """alpha only (beta 0, no clamp) and beta only (alpha 1, no clamp), the cases where the kernel
    reads one control pointer and keeps the other's neutral value: per row, against float64."""
    rows, d = 16, 384
    inp, sf = random_rows(RNG, rows, d)
    value = (RNG.uniform(0.5, 2, rows) if only == "alpha" else RNG.uniform(-0.5, 0.5, rows)).astype(np.float32)
    gated = ref.GatedAct(alpha=value) if only == "alpha" else ref.GatedAct(beta=value)
    q, scale = ref.activate_rows(inp, sf, gated=gated)
    nb = d // 128
    x = ref.e4m3_to_float(inp).astype(np.float64).reshape(rows, 2, nb, 128)
    s = sf.astype(np.float64).reshape(rows, 2, nb, 1)
    x1, x2 = x[:, 0] * s[:, 0], x[:, 1] * s[:, 1]
    alpha = value[:, None, None] if only == "alpha" else 1.0
    beta = value[:, None, None] if only == "beta" else 0.0
    with np.errstate(over="ignore"):
        want = x2 / (1.0 + np.exp(-alpha * x2)) * (x1 + beta)
    want_scale = np.maximum(np.abs(want).max(axis=-1) / 448.0, float(ref.FLT_MIN))
    np.testing.assert_allclose(scale, want_scale, rtol=1e-5)
    got = ref.e4m3_to_float(q).reshape(rows, nb, 128) * scale[..., None]
    np.testing.assert_allclose(got, want, rtol=0.07, atol=float(scale.max()) * 2.0**-9)
    plain_q, _ = ref.activate_rows(inp, sf)
    assert not np.array_equal(plain_q, q)  # the control is applied, not dropped


# ---------------------------------------------------------------------------------------------
# Routing and the kernel's buffers


def random_topk(rng, num_tokens, num_experts=256, top_k=8):
    return np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)


@pytest.mark.parametrize("tile", [8, 16, 32, 64, 128, 48])
def test_mn_limit_walk_finds_exactly_the_local_rows(tile):
    """The patched kernel walks [0, totalNumPaddedTokens) and keeps rows below their tile's
    MN limit: that must be exactly the set of permuted rows of local slots."""
    routing = ref.build_routing(random_topk(RNG, 1000), 32, 32, tile)
    np.testing.assert_array_equal(routing.rows_from_mn_limit(), routing.local_rows())
    assert routing.total_num_padded_tokens % tile == 0
    assert len(routing.cta_idx_xy_to_mn_limit) == routing.total_num_padded_tokens // tile
    local = routing.expanded_idx_to_permuted_idx >= 0
    assert len(np.unique(routing.expanded_idx_to_permuted_idx[local])) == local.sum()


def kernel_buffers(rng, routing, d=512, dtype="e4m3"):
    t = max(routing.total_num_padded_tokens, 1)
    nb = d // 128
    inp, sf_rows = random_rows(rng, t, d, dtype)
    in_sf = np.ascontiguousarray(sf_rows.T).reshape(-1)  # [2nb, T] column major per row
    storage = ref.DTYPES[dtype][0]
    out = np.full((t, d), 0xA5, storage)
    out_sf = np.full((nb, t), -1234.5, np.float32)
    return inp, in_sf, out, out_sf


def test_all_remote_touches_nothing():
    topk = random_topk(RNG, 256) % 224 + 32  # experts 32..255: none local to rank 0
    routing = ref.build_routing(topk, 0, 32, 64)
    assert routing.total_num_padded_tokens == 0 and len(routing.local_rows()) == 0
    inp, in_sf, out, out_sf = kernel_buffers(RNG, routing)
    before = out.copy(), out_sf.copy()
    ref.activation_deepseek(inp, in_sf, routing, out, out_sf)
    np.testing.assert_array_equal(out, before[0])
    np.testing.assert_array_equal(out_sf, before[1])


def test_all_local_writes_every_row_but_padding():
    topk = random_topk(RNG, 300, num_experts=32)  # every expert local
    routing = ref.build_routing(topk, 0, 32, 64)
    rows = routing.local_rows()
    assert len(rows) == 300 * 8
    inp, in_sf, out, out_sf = kernel_buffers(RNG, routing)
    ref.activation_deepseek(inp, in_sf, routing, out, out_sf)
    padding = np.setdiff1d(np.arange(routing.total_num_padded_tokens), rows)
    assert len(padding) > 0
    assert (out[padding] == 0xA5).all() and (out_sf[:, padding] == -1234.5).all()
    assert (out_sf[:, rows] >= ref.FLT_MIN).all()
    # Each written row is the row-wise reference of its own inputs and scales.
    t = routing.total_num_padded_tokens
    q, s = ref.activate_rows(inp[rows], in_sf.reshape(-1, t)[:, rows].T)
    np.testing.assert_array_equal(out[rows], q)
    np.testing.assert_array_equal(out_sf[:, rows], s.T)


def test_ep8_mixed_routing_writes_only_local_rows():
    topk = random_topk(RNG, 512)
    routing = ref.build_routing(topk, 64, 32, 32)  # rank 2 of EP8
    local_slots = ((topk >= 64) & (topk < 96)).sum()
    assert len(routing.local_rows()) == local_slots
    inp, in_sf, out, out_sf = kernel_buffers(RNG, routing)
    ref.activation_deepseek(inp, in_sf, routing, out, out_sf)
    untouched = np.setdiff1d(np.arange(routing.total_num_padded_tokens), routing.local_rows())
    assert (out[untouched] == 0xA5).all() and (out_sf[:, untouched] == -1234.5).all()


@pytest.mark.parametrize("offset", [96, 224])
def test_nonzero_expert_offset_maps_global_to_local_experts(offset):
    """EP8 ranks 3 and 7: the local experts are [offset, offset + 32), numbered from 0 in the tiles."""
    topk = random_topk(RNG, 400)
    routing = ref.build_routing(topk, offset, 32, 16)
    flat = topk.reshape(-1)
    local = (flat >= offset) & (flat < offset + 32)
    assert ((routing.expanded_idx_to_permuted_idx >= 0) == local).all()
    rows = routing.expanded_idx_to_permuted_idx[local]
    np.testing.assert_array_equal(routing.cta_idx_xy_to_batch_idx[rows // 16], flat[local] - offset)
    np.testing.assert_array_equal(routing.rows_from_mn_limit(), routing.local_rows())


def test_gated_per_expert_lookup_through_the_tile():
    topk = random_topk(RNG, 200, num_experts=64)
    routing = ref.build_routing(topk, 0, 32, 16)
    inp, in_sf, out, out_sf = kernel_buffers(RNG, routing)
    alpha = RNG.uniform(0.5, 2, 32).astype(np.float32)
    ref.activation_deepseek(inp, in_sf, routing, out, out_sf, gated_per_expert=ref.GatedAct(alpha=alpha))
    rows = routing.local_rows()
    expert = routing.cta_idx_xy_to_batch_idx[rows // 16]
    t = routing.total_num_padded_tokens
    q, _ = ref.activate_rows(inp[rows], in_sf.reshape(-1, t)[:, rows].T, gated=ref.GatedAct(alpha=alpha[expert]))
    np.testing.assert_array_equal(out[rows], q)


# ---------------------------------------------------------------------------------------------
# The comparison the GPU harness uses


def test_compare_with_kernel_bounds():
    inp, sf = random_rows(RNG, 4, 256)
    q, s = ref.activate_rows(inp, sf)
    assert ref.compare_with_kernel(q, s, q, s)["ok"]
    one = q.copy()
    one[0, 0] = q[0, 0] + 1 if q[0, 0] & 0x7F < 0x7E else q[0, 0] - 1
    assert ref.compare_with_kernel(one, s, q, s)["ok"]
    two = q.copy()
    two[0, 0] = q[0, 0] ^ 0x80 if q[0, 0] & 0x7F else q[0, 0] + 2
    assert not ref.compare_with_kernel(two, s, q, s)["ok"]
    assert not ref.compare_with_kernel(q, s * np.float32(1.001), q, s)["ok"]
