"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), written here from the published block
layout (ggml-common.h: ``block_q4_K``, ``block_q5_K``, ``block_q6_K``), because gguf-py 0.19
writes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16 and F16 but no K-quant, and the GGUF files users
have (Q4_K_M, Q5_K_M, Q6_K) are made of them.

The scales are chosen by plain min/max rounding, not llama.cpp's iterative search
(``make_qkx2_quants``): the blocks are bit-for-bit what its decoder reads (gguf-py's own
``dequantize``, an independent decoder, reads them back within half a step: tests), but a
little less accurate than ``llama-quantize``'s for the same type.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # values per K-quant super-block


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_6bit_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block into 12 bytes (get_scale_min_k4's inverse)."""
    n = sc.shape[0]
    out = np.zeros((n, 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _asymmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Blocks of 8 sub-blocks of 32 as ``d * sc * q - dmin * m`` (q in [0, levels]):
    returns d, dmin, the 6-bit sc and m, and q."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # llama.cpp keeps the offset a subtraction
    scale = (sub.max(axis=-1) - low) / levels
    d = scale.max(axis=-1) / 63
    dmin = (-low).max(axis=-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-low, dmin16[:, None], out=np.zeros_like(low), where=dmin16[:, None] > 0)), 0, 63)
    step = (d16[:, None] * sc)[..., None]
    offset = (dmin16[:, None] * m)[..., None]
    q = np.clip(np.rint(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step > 0)), 0, levels)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8).reshape(n, QK_K)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows of float values (length a multiple of 256) -> Q4_K bytes (144 per 256 values)."""
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d, dmin, sc, m, q = _asymmetric(blocks, 15)
    chunks = q.reshape(-1, 4, 2, 32)  # per 64 values: low nibbles then high nibbles
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16(d), _f16(dmin), _pack_6bit_scales(sc, m), qs], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Rows -> Q5_K bytes (176 per 256 values): Q4_K's nibbles plus a fifth bit in ``qh``."""
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d, dmin, sc, m, q = _asymmetric(blocks, 31)
    low = q & 0xF
    chunks = low.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)  # bit s of qh[l]: value l of sub-block s
    qh = np.zeros((blocks.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    out = np.concatenate([_f16(d), _f16(dmin), _pack_6bit_scales(sc, m), qh, qs], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 176)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows -> Q6_K bytes (210 per 256 values): 16 sub-blocks of 16, ``d * scale * (q - 32)``."""
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = scale.max(axis=-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), -128, 127)
    step = (d16[:, None] * sc)[..., None]
    q = np.clip(np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # per 128 values: four runs of 32 (dequantize_row_q6_K's q1..q4)
    ql = np.concatenate(
        [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2
    ).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)).reshape(
        n, 64
    )
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 210)


K_QUANTS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
