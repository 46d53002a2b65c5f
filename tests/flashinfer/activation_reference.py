"""CPU reference of FlashInfer's DeepSeek FP8 activation (trtllm-gen fused MoE).

The kernel (``activationDeepSeekKernel`` in
``csrc/fused_moe/trtllm_backend/trtllm_fused_moe_dev_kernel.cu``) sits between the
two expert GEMMs. For every permuted row that holds a local (token, top-k) slot it
computes, in float32, with the module's ``-use_fast_math`` (so flush-to-zero):

    x1  = inSf[b, row] * in[row, c]                    (the linear half, c < D)
    x2  = inSf[b + D/128, row] * in[row, c + D]        (the gate half)
    out = silu(x2) * x1 = (x2 / (1 + exp(-x2))) * x1   (or the OAI-gated variant)
    amax  = max |out| over the 128 columns of the block b = c // 128
    scale = max(amax / 448, FLT_MIN)
    q     = E4m3(out / scale)                          (cvt.rn.satfinite)

and writes ``q`` to ``out[row, c]`` and ``scale`` to ``outSf[b, row]``. Scale
tensors are "column major": element (b, row) lives at ``b * T + row`` where T is
``totalNumPaddedTokens``. Rows that hold no local slot (padding, or slots routed
to another rank's experts) are not written at all.

This module mirrors that order of operations and rounds to float32 after every
operation, flushing subnormal results to zero as ``-ftz=true`` does. Where the GPU
uses approximate instructions, the reference uses the correctly rounded value:

* ``expf`` is ``ex2.approx.ftz(x * log2(e))`` on the GPU: the reference rounds
  ``x * log2(e)`` to float32 as the GPU does, then takes an exact ``exp2``;
* ``a / b`` is ``div.approx.ftz`` (``a * rcp.approx(b)``) on the GPU: the
  reference divides exactly.

Both GPU instructions are within 2 ulp, so the reference agrees with the kernel to
a few ulp on scales and to one E4M3 step on quantized values (a value can land on
the other side of a rounding boundary); ``compare_with_kernel`` checks exactly
that. Bit-identity is checked between two kernels, not against this reference.

Needs only numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

E4M3_MAX = np.float32(448.0)
FLT_MIN = np.float32(np.finfo(np.float32).tiny)  # std::numeric_limits<float>::min()
LOG2E = np.float32(1.4426950408889634)  # the float constant __expf multiplies by
NUM_ELTS_PER_SF = 128


# ---------------------------------------------------------------------------------------------
# Float formats


def ftz(x: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to a zero of the same sign (``-ftz=true``)."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < FLT_MIN, np.copysign(np.float32(0.0), x), x).astype(np.float32)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    values = sign * mag
    values[(codes & 0x7F) == 0x7F] = np.nan  # E4M3FN: S.1111.111 is NaN, no infinities
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()


def e4m3_to_float(codes: np.ndarray) -> np.ndarray:
    """Decode E4M3FN bytes (exact in float32)."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def float_to_e4m3(x: np.ndarray) -> np.ndarray:
    """Encode float32 to E4M3FN bytes: round to nearest even, saturate to +-448.

    This is ``cvt.rn.satfinite.e4m3x2.f32``: finite values beyond the range
    (infinities included) saturate; NaN encodes as 0x7F.
    """
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    nan = np.isnan(x)
    sign = np.signbit(x)
    mag = np.abs(np.where(nan, 0.0, x))
    mag = np.minimum(mag, 480.0)  # keeps inf finite; anything >= 464 saturates below
    # Spacing of E4M3 values around mag: 2^-9 below the smallest normal 2^-6, else 2^(e-3)
    # where 2^e <= mag < 2^(e+1) (frexp gives e exactly).
    e = np.frexp(np.where(mag > 0, mag, 1.0))[1].astype(np.float64) - 1
    step = np.where(mag < 2.0**-6, 2.0**-9, 2.0 ** (e - 3))
    q = np.round(mag / step) * step  # numpy rounds half to even; mag / step is exact
    q = np.minimum(q, 448.0)
    # Encode q (an exact E4M3 magnitude).
    qe = np.frexp(np.where(q > 0, q, 1.0))[1].astype(np.float64) - 1
    is_sub = q < 2.0**-6
    exp_field = np.where(is_sub, 0, qe + 7).astype(np.int64)
    man_field = np.where(is_sub, q / 2.0**-9, (q / 2.0**qe - 1.0) * 8.0)
    man_field = np.rint(man_field).astype(np.int64)
    code = (exp_field << 3) | man_field
    code = np.where(sign, code | 0x80, code)
    code = np.where(nan, 0x7F, code)
    return code.astype(np.uint8)


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (``cvt.rn.bf16.f32``)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def fp16_to_float(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def float_to_fp16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 bits, round to nearest even (``cvt.rn.f16.f32``)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


DTYPES = {
    # name: (storage dtype, decode, encode)
    "e4m3": (np.uint8, e4m3_to_float, float_to_e4m3),
    "bf16": (np.uint16, bf16_to_float, float_to_bf16),
    "fp16": (np.uint16, fp16_to_float, float_to_fp16),
}


# ---------------------------------------------------------------------------------------------
# The math, one float32 rounding per operation


# Under -ftz=true an operation flushes subnormal operands as well as a subnormal result.


def _mul(a, b):
    with np.errstate(over="ignore", invalid="ignore"):
        return ftz(np.multiply(ftz(a), ftz(b), dtype=np.float32))


def _add(a, b):
    with np.errstate(over="ignore", invalid="ignore"):
        return ftz(np.add(ftz(a), ftz(b), dtype=np.float32))


def _div(a, b):
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return ftz(np.divide(ftz(a), ftz(b), dtype=np.float32))


def fast_expf(x: np.ndarray) -> np.ndarray:
    """``__expf``: exp2(x * log2e), the product rounded to float32 first."""
    t = _mul(x, LOG2E)
    with np.errstate(over="ignore"):
        return ftz(np.exp2(t.astype(np.float64)).astype(np.float32))


def silu(x: np.ndarray) -> np.ndarray:
    """The kernel's ``silu``: x / (1 + expf(-x))."""
    return _div(x, _add(np.float32(1.0), fast_expf(-x)))


@dataclass(frozen=True)
class GatedAct:
    """The optional per-row OAI controls (None means the pointer is null)."""

    alpha: np.ndarray | None = None
    beta: np.ndarray | None = None
    clamp_limit: np.ndarray | None = None

    @property
    def is_plain(self) -> bool:
        return self.alpha is None and self.beta is None and self.clamp_limit is None


def gated_silu(x_linear: np.ndarray, x_glu: np.ndarray, gated: GatedAct | None = None) -> np.ndarray:
    """``gatedSilu``: row-wise scalars broadcast over the last axis."""
    if gated is None or gated.is_plain:
        return _mul(silu(x_glu), x_linear)
    if gated.clamp_limit is not None:
        limit = np.asarray(gated.clamp_limit, dtype=np.float32)[:, None]
        x_glu = ftz(np.fmin(x_glu, limit))
        x_linear = ftz(np.fmax(np.fmin(x_linear, limit), -limit))
    alpha = np.float32(1.0) if gated.alpha is None else np.asarray(gated.alpha, np.float32)[:, None]
    beta = np.float32(0.0) if gated.beta is None else np.asarray(gated.beta, np.float32)[:, None]
    act = _div(x_glu, _add(np.float32(1.0), fast_expf(_mul(-alpha, x_glu))))
    return _mul(act, _add(x_linear, beta))


def activate_rows(
    inp: np.ndarray,
    in_sf_rows: np.ndarray,
    dtype: str = "e4m3",
    gated: GatedAct | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Activate and quantize whole rows.

    inp:        [R, 2*D] stored values (uint8 E4M3 codes, or uint16 bf16/fp16 bits)
    in_sf_rows: [R, 2*D/128] float32 dequantization scales of those rows
    returns     ([R, D] stored values, [R, D/128] float32 output scales)
    """
    storage, decode, encode = DTYPES[dtype]
    inp = np.asarray(inp, dtype=storage)
    num_rows, inner_dim = inp.shape
    if inner_dim % (2 * NUM_ELTS_PER_SF):
        raise ValueError(f"innerDim / 2 must be a multiple of {NUM_ELTS_PER_SF}, got {inner_dim // 2}")
    d = inner_dim // 2
    nb = d // NUM_ELTS_PER_SF
    in_sf_rows = np.asarray(in_sf_rows, dtype=np.float32).reshape(num_rows, 2 * nb)
    data = decode(inp).reshape(num_rows, 2, nb, NUM_ELTS_PER_SF)
    sf1 = in_sf_rows[:, :nb, None]
    sf2 = in_sf_rows[:, nb:, None]
    x1 = _mul(sf1, data[:, 0])  # scale * data, as the kernel writes it
    x2 = _mul(sf2, data[:, 1])
    if gated is None or gated.is_plain:
        out = gated_silu(x1, x2)
    else:
        out = gated_silu(x1.reshape(num_rows, d), x2.reshape(num_rows, d), gated)
        out = out.reshape(num_rows, nb, NUM_ELTS_PER_SF)
    amax = np.max(np.abs(out), axis=-1)  # exact: a max does not round
    scale = np.maximum(_div(amax, E4M3_MAX), FLT_MIN).astype(np.float32)
    q = _div(out, scale[..., None])
    return encode(q.reshape(num_rows, d)), scale


# ---------------------------------------------------------------------------------------------
# The kernel's buffers


@dataclass
class Routing:
    """The routing metadata the kernel reads (int32 arrays)."""

    expanded_idx_to_permuted_idx: np.ndarray  # [numTokens * topK], -1 for a remote slot
    total_num_padded_tokens: int
    tile_tokens_dim: int
    cta_idx_xy_to_mn_limit: np.ndarray  # [numTiles], exclusive end of each tile's valid rows
    cta_idx_xy_to_batch_idx: np.ndarray  # [numTiles], local expert of each tile

    def local_rows(self) -> np.ndarray:
        """The permuted rows the kernel writes: those of the local slots."""
        p = np.asarray(self.expanded_idx_to_permuted_idx)
        return np.sort(p[p >= 0])

    def rows_from_mn_limit(self) -> np.ndarray:
        """The same rows, read off the tiles' MN limits (the patched kernel's walk)."""
        rows = np.arange(self.total_num_padded_tokens)
        tiles = rows // self.tile_tokens_dim
        return rows[rows < np.asarray(self.cta_idx_xy_to_mn_limit)[tiles]]


def build_routing(
    topk_experts: np.ndarray,
    local_expert_offset: int,
    num_local_experts: int,
    tile_tokens_dim: int,
) -> Routing:
    """Permute the local slots the way the trtllm-gen routing kernels lay them out.

    Slots are grouped by local expert in expert order; each expert's block of rows
    starts on a tile boundary, so a tile holds one expert's rows and its MN limit is
    where that expert's rows end. Within an expert, slots are ordered by expanded
    index (the routing kernels' order may differ; the activation does not care).
    """
    topk_experts = np.asarray(topk_experts)
    num_tokens, top_k = topk_experts.shape
    flat = topk_experts.reshape(-1)
    local = flat - local_expert_offset
    is_local = (local >= 0) & (local < num_local_experts)
    permuted = np.full(flat.shape, -1, dtype=np.int32)
    mn_limits: list[int] = []
    batch_idx: list[int] = []
    offset = 0
    for e in range(num_local_experts):
        slots = np.nonzero(is_local & (local == e))[0]
        count = len(slots)
        if count == 0:
            continue
        permuted[slots] = offset + np.arange(count, dtype=np.int32)
        num_tiles = -(-count // tile_tokens_dim)
        for t in range(num_tiles):
            mn_limits.append(min(offset + (t + 1) * tile_tokens_dim, offset + count))
            batch_idx.append(e)
        offset += num_tiles * tile_tokens_dim
    return Routing(
        expanded_idx_to_permuted_idx=permuted,
        total_num_padded_tokens=offset,
        tile_tokens_dim=tile_tokens_dim,
        cta_idx_xy_to_mn_limit=np.asarray(mn_limits, dtype=np.int32),
        cta_idx_xy_to_batch_idx=np.asarray(batch_idx, dtype=np.int32),
    )


def activation_deepseek(
    inp: np.ndarray,
    in_sf: np.ndarray,
    routing: Routing,
    out: np.ndarray,
    out_sf: np.ndarray,
    dtype: str = "e4m3",
    gated_per_expert: GatedAct | None = None,
    rows: np.ndarray | None = None,
) -> None:
    """Apply the kernel to whole buffers, in place, like ``activation::run``.

    inp:    [>= T, 2*D] stored values; in_sf: float32, flat or [2*D/128, T]
    out:    [>= T, D] stored values;   out_sf: float32 [D/128, T]
    Only the local rows (or the given subset of them) are written.
    gated_per_expert holds per-local-expert arrays, looked up per row through
    the tile's batch index like the kernel does.
    """
    t = routing.total_num_padded_tokens
    d = out.shape[1]
    nb = d // NUM_ELTS_PER_SF
    in_sf = np.asarray(in_sf, dtype=np.float32).reshape(-1)[: 2 * nb * t].reshape(2 * nb, t)
    local_rows = routing.local_rows() if rows is None else np.asarray(rows)
    if len(local_rows) == 0:
        return
    gated = None
    if gated_per_expert is not None and not gated_per_expert.is_plain:
        expert = np.asarray(routing.cta_idx_xy_to_batch_idx)[local_rows // routing.tile_tokens_dim]

        def pick(a):
            return None if a is None else np.asarray(a, dtype=np.float32)[expert]

        gated = GatedAct(pick(gated_per_expert.alpha), pick(gated_per_expert.beta),
                         pick(gated_per_expert.clamp_limit))
    q, scale = activate_rows(inp[local_rows], in_sf[:, local_rows].T, dtype, gated)
    out[local_rows] = q
    out_sf[:, local_rows] = scale.T


# ---------------------------------------------------------------------------------------------
# Agreement with a kernel (approximate instructions, see the module docstring)


def ordinal(codes: np.ndarray, dtype: str = "e4m3") -> np.ndarray:
    """Signed position of a stored value on the number line (adjacent values differ by 1).

    All three formats are sign-magnitude, so the magnitude bits order the values.
    """
    storage = DTYPES[dtype][0]
    bits = np.asarray(codes, dtype=storage).astype(np.int64)
    sign_bit = 0x80 if storage == np.uint8 else 0x8000
    mag = bits & (sign_bit - 1)
    return np.where(bits & sign_bit, -mag, mag)


def compare_with_kernel(
    q_kernel: np.ndarray,
    sf_kernel: np.ndarray,
    q_ref: np.ndarray,
    sf_ref: np.ndarray,
    max_sf_rel: float = 2.0**-20,
    dtype: str = "e4m3",
) -> dict:
    """Kernel vs reference: scales within a few ulp, values within one step of the format.

    Returns counts; ``ok`` is False if any element is outside those bounds.
    """
    sf_kernel = np.asarray(sf_kernel, dtype=np.float32)
    sf_ref = np.asarray(sf_ref, dtype=np.float32)
    sf_rel = np.abs(sf_kernel.astype(np.float64) - sf_ref) / np.maximum(sf_ref, FLT_MIN)
    steps = np.abs(ordinal(q_kernel, dtype) - ordinal(q_ref, dtype))  # +0 and -0 are both 0
    return {
        "elements": int(steps.size),
        "exact": int(np.count_nonzero(steps == 0)),
        "one_step": int(np.count_nonzero(steps == 1)),
        "worse": int(np.count_nonzero(steps > 1)),
        "scales": int(sf_rel.size),
        "scale_max_rel": float(sf_rel.max()) if sf_rel.size else 0.0,
        "ok": bool(np.all(steps <= 1) and np.all(sf_rel <= max_sf_rel)),
    }
