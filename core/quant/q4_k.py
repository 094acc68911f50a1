"""Q4_K quantization in numpy (`gguf.quants` only dequantizes it), after llama.cpp's
`quantize_row_q4_K_ref`: a 256-weight super-block of 8 sub-blocks of 32, each with a 6-bit
scale and a 6-bit min (themselves scaled by the fp16 `d` and `dmin`), 4-bit weights.

Each sub-block's scale and min are chosen as `make_qkx2_quants` does (nmax 15, rmin -1,
rdelta 0.1, 20 steps, squared error weighted by av_x + |x|): start from min/max, then try 21
slightly different inverse scales and keep the weighted least-squares fit of the one with
the smallest error. Vectorised over every sub-block at once.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
SUB = 32
BLOCK_BYTES = 144
NMAX = 15


def _clamped(values: np.ndarray, top: int) -> np.ndarray:
    return np.clip(np.rint(values), 0, top)


def _sub_block_fits(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x, w [n, 32] -> (scale [n], min [n]) with x ~ scale * L - min, L in 0..15."""
    lo = np.minimum(x.min(axis=1), 0.0)
    hi = x.max(axis=1)
    span = hi - lo
    flat = span <= 0
    span = np.where(flat, 1.0, span)
    iscale = NMAX / span
    scale = 1.0 / iscale
    level = _clamped(iscale[:, None] * (x - lo[:, None]), NMAX)
    best = (w * (scale[:, None] * level + lo[:, None] - x) ** 2).sum(axis=1)
    best_scale, best_min = scale.copy(), lo.copy()
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)
    for step in range(21):
        iscale = (-1.0 + 0.1 * step + NMAX) / span
        level = _clamped(iscale[:, None] * (x - lo[:, None]), NMAX)
        sum_l = (w * level).sum(axis=1)
        sum_l2 = (w * level * level).sum(axis=1)
        sum_xl = (w * level * x).sum(axis=1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = np.where(positive, 0.0, this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        err = (w * (this_scale[:, None] * level + this_min[:, None] - x) ** 2).sum(axis=1)
        better = ok & (err < best)
        best = np.where(better, err, best)
        best_scale = np.where(better, this_scale, best_scale)
        best_min = np.where(better, this_min, best_min)
    best_scale = np.where(flat, 0.0, best_scale)
    return best_scale, np.where(flat, lo, best_min) * -1.0


def _pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n, 8] -> the 12-byte layout of block_q4_K."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """float [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 144]."""
    rows, cols = weights.shape
    if cols % QK_K:
        raise ValueError(f"Q4_K needs a multiple of {QK_K} columns, got {cols}")
    x = weights.astype(np.float32).reshape(-1, QK_K)
    n = x.shape[0]
    av_x = np.sqrt((x * x).mean(axis=1, keepdims=True))
    sub = x.reshape(n * 8, SUB)
    scales, mins = _sub_block_fits(sub, (av_x + np.abs(x)).reshape(n * 8, SUB))
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_scale = np.where(max_scale > 0, 63.0 / np.where(max_scale > 0, max_scale, 1), 0.0)
    inv_min = np.where(max_min > 0, 63.0 / np.where(max_min > 0, max_min, 1), 0.0)
    ls = np.minimum(np.rint(inv_scale[:, None] * scales), 63)
    lm = np.minimum(np.rint(inv_min[:, None] * mins), 63)
    d = (max_scale / 63.0).astype(np.float16)
    dmin = (max_min / 63.0).astype(np.float16)
    sub_d = d.astype(np.float32)[:, None] * ls
    sub_m = dmin.astype(np.float32)[:, None] * lm
    safe_d = np.where(sub_d > 0, sub_d, 1.0)
    level = _clamped((x.reshape(n, 8, SUB) + sub_m[:, :, None]) / safe_d[:, :, None], NMAX)
    level = np.where(sub_d[:, :, None] > 0, level, 0).astype(np.uint8).reshape(n, 4, 2, SUB)
    qs = (level[:, :, 0] | (level[:, :, 1] << 4)).reshape(n, 128)
    out = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
         _pack_scales(ls, lm), qs], axis=1)
    return out.reshape(rows, cols // QK_K * BLOCK_BYTES)
