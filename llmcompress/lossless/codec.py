"""ZipCCL: lossless exponent coding of floating-point tensors.

Every value is split into a *symbol* byte (the exponent, plus a little more for fp16) and the
remaining *raw* bytes (sign and mantissa, nearly random, stored as they are in byte planes):

=========  =====================================  ======================================
dtype      symbol (Huffman-coded)                 raw planes (stored verbatim)
=========  =====================================  ======================================
bfloat16   8-bit exponent                         sign + 7 mantissa bits (1 byte)
float16    sign + 5-bit exponent + 2 top mantissa low 8 mantissa bits (1 byte)
float32    8-bit exponent                         mantissa bytes 0, 1 and sign + 7 bits
=========  =====================================  ======================================

The symbols are coded with a canonical, length-limited (15 bits) Huffman code.  The default code
comes from a Gaussian model of the tensor: sigma is the RMS of a strided subsample, and
P(symbol) is the probability of the interval of |x| that the symbol stands for under N(0, sigma).
Every one of the 256 symbols gets a code (a probability floor), so the model code is escape-free.
Each chunk (default 512 KiB of input) then takes the smallest of: the model code, a Huffman code
built from the chunk's histogram (computed while splitting, no extra pass), or the raw symbol
bytes, so a chunk never grows by more than its 8-byte header plus 3 bytes of padding.

Decoding is table-driven: a 4096-entry table on the next 12 bits yields up to four symbols at
once (four lookups per 64-bit refill, four streams in lockstep); codes longer than 12 bits take a
canonical slow path.  The kernels are numba `nogil` functions, so chunk groups run in parallel
Python threads.  See README.md for the byte format.

Performance notes: hot loops index with unsigned ints (`_U`), which removes numba's
negative-index wraparound code (2x on the bit coders, and lets LLVM merge `_ld64` into one load);
split/merge loop over slices with narrow types so LLVM vectorizes them; the encoder writes whole
32-bit words branch-free into a scratch buffer; with threads == 1 a tensor is one group written in
place, with more threads each group's output is moved left in place (no concatenation copy).
"""

from __future__ import annotations

import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numba import njit
from numba import uint64 as _U  # cast indices: no negative-index wraparound code

MAXLEN = 15  # longest Huffman code, bits
LUTBITS = 12  # decode table index width, bits
LUTSIZE = 1 << LUTBITS
MASK = LUTSIZE - 1
HDR = 8  # chunk header: u8 mode, 3 zero bytes, u32 symbol-stream length
TABLE_BYTES = 128  # 256 code lengths, one nibble each
DEFAULT_CHUNK_BYTES = 512 * 1024
GROUP_BYTES = 4 << 20  # input bytes per thread work item

MODE_RAW, MODE_MODEL, MODE_HIST = 0, 1, 2
KIND_BF16, KIND_F16, KIND_F32, KIND_RAW = 0, 1, 2, 3
_KIND_OF = {"bfloat16": KIND_BF16, "float16": KIND_F16, "float32": KIND_F32}
_WIDTH = {KIND_BF16: 2, KIND_F16: 2, KIND_F32: 4}

# dtype names that can cross the wire (index = code in the serialized header)
DTYPE_NAMES = [
    "bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2", "complex64", "complex128", "uint16", "uint32", "uint64",
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Huffman code construction (numba)
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _huff_lengths(freq, maxlen):
    """Optimal length-limited (package-merge) code lengths for int64 freq[256]; 0 if freq == 0."""
    lens = np.zeros(256, np.int64)
    idx = np.empty(256, np.int64)
    m = 0
    for s in range(256):
        if freq[s] > 0:
            idx[m] = s
            m += 1
    if m == 0:
        return lens
    if m == 1:
        lens[idx[0]] = 1
        return lens
    syms = idx[:m].copy()
    f = np.empty(m, np.int64)
    for i in range(m):
        f[i] = freq[syms[i]]
    # stable insertion sort by frequency (m <= 256; cheaper to compile than np.argsort)
    ss = syms.copy()
    w = f.copy()
    for i in range(1, m):
        kw = w[i]
        ks = ss[i]
        j = i - 1
        while j >= 0 and w[j] > kw:
            w[j + 1] = w[j]
            ss[j + 1] = ss[j]
            j -= 1
        w[j + 1] = kw
        ss[j + 1] = ks
    cap = 2 * m
    W = np.zeros((maxlen + 1, cap), np.int64)
    LF = np.zeros((maxlen + 1, cap), np.bool_)
    sz = np.zeros(maxlen + 1, np.int64)
    for i in range(m):
        W[maxlen, i] = w[i]
        LF[maxlen, i] = True
    sz[maxlen] = m
    for lv in range(maxlen - 1, 0, -1):
        npk = sz[lv + 1] // 2
        a = 0
        b = 0
        k = 0
        while (a < m or b < npk) and k < cap:
            if b < npk:
                pk = W[lv + 1, 2 * b] + W[lv + 1, 2 * b + 1]
            if b >= npk or (a < m and w[a] <= pk):
                W[lv, k] = w[a]
                LF[lv, k] = True
                a += 1
            else:
                W[lv, k] = pk
                LF[lv, k] = False
                b += 1
            k += 1
        sz[lv] = k
    ls = np.zeros(m, np.int64)
    k = 2 * m - 2
    for lv in range(1, maxlen + 1):
        a = 0
        for j in range(k):
            if LF[lv, j]:
                a += 1
        for j in range(a):
            ls[j] += 1
        k = 2 * (k - a)
        if k == 0:
            break
    for i in range(m):
        lens[ss[i]] = ls[i]
    return lens


@njit(cache=True, nogil=True)
def _canonical(lens):
    """Canonical codes, bit-reversed for LSB-first writing; plus the slow-path decode tables."""
    bl = np.zeros(MAXLEN + 2, np.int64)
    for s in range(256):
        if 0 < lens[s] <= MAXLEN:
            bl[lens[s]] += 1
    nxt = np.zeros(MAXLEN + 2, np.int64)
    code = 0
    for b in range(1, MAXLEN + 1):
        code = (code + bl[b - 1]) << 1
        nxt[b] = code
    # slow tables: [0:16] first code, [16:32] count, [32:48] base index, [48:304] sorted symbols
    slow = np.zeros(48 + 256, np.int64)
    base = 0
    for b in range(1, MAXLEN + 1):
        slow[b] = nxt[b]
        slow[16 + b] = bl[b]
        slow[32 + b] = base
        base += bl[b]
    fill = np.zeros(MAXLEN + 2, np.int64)
    codes = np.zeros(256, np.int64)
    for s in range(256):
        ln = lens[s]
        if 0 < ln <= MAXLEN:
            c = nxt[ln]
            nxt[ln] += 1
            slow[48 + slow[32 + ln] + fill[ln]] = s
            fill[ln] += 1
            r = 0
            for k in range(ln):
                r = (r << 1) | ((c >> k) & 1)
            codes[s] = r | (ln << 16)
    return codes, slow


@njit(cache=True, nogil=True)
def _build_lut(codes):
    """Multi-symbol decode table on 12 bits.

    entry = 4 symbols (bits 0-31) | count << 32 | bits used << 36 | first code length << 40.
    """
    single = np.zeros(LUTSIZE, np.int64)
    for s in range(256):
        ln = codes[s] >> 16
        if 0 < ln <= LUTBITS:
            for k in range(codes[s] & 0xFFFF & (LUTSIZE - 1), LUTSIZE, 1 << ln):
                single[k] = s | (ln << 8)
    lut = np.zeros(LUTSIZE, np.int64)
    for w in range(LUTSIZE):
        pos = 0
        cnt = 0
        syms = 0
        first = 0
        while cnt < 4:
            e = single[(w >> pos) & (LUTSIZE - 1)]
            ln = e >> 8
            if ln == 0 or ln > LUTBITS - pos:
                break
            if cnt == 0:
                first = ln
            syms |= (e & 255) << (8 * cnt)
            cnt += 1
            pos += ln
        lut[w] = syms | (cnt << 32) | (pos << 36) | (first << 40)
    return lut


# --------------------------------------------------------------------------------------------
# bit streams (numba)
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _ld64(src, q):
    u = _U(q)  # unsigned: no wraparound code, so LLVM merges this into one 64-bit load
    return (
        np.int64(src[u])
        | (np.int64(src[u + 1]) << 8)
        | (np.int64(src[u + 2]) << 16)
        | (np.int64(src[u + 3]) << 24)
        | (np.int64(src[u + 4]) << 32)
        | (np.int64(src[u + 5]) << 40)
        | (np.int64(src[u + 6]) << 48)
        | (np.int64(src[u + 7]) << 56)
    )


@njit(cache=True, nogil=True)
def _slow_sym(w, slow):
    """Canonical decode of one (long) code from the low bits of w: (symbol, length) or (0, 0)."""
    code = 0
    for ln in range(1, MAXLEN + 1):
        code = (code << 1) | ((w >> (ln - 1)) & 1)
        c = code - slow[ln]
        if c >= 0 and c < slow[16 + ln]:
            return slow[48 + slow[32 + ln] + c], ln
    return 0, 0


@njit(cache=True, nogil=True, inline="always")
def _look(w, lut, slow, dst, i):
    """One table lookup: writes up to 4 symbols at dst[i]; returns (count, bits) (bits 0 = error)."""
    e = lut[w & (LUTSIZE - 1)]
    c = (e >> 32) & 7
    if c != 0:
        dst[_U(i)] = e & 255
        dst[_U(i + 1)] = (e >> 8) & 255
        dst[_U(i + 2)] = (e >> 16) & 255
        dst[_U(i + 3)] = (e >> 24) & 255
        return c, (e >> 36) & 15
    s, ln = _slow_sym(w, slow)
    dst[_U(i)] = s
    return 1, ln


@njit(cache=True, nogil=True)
def _decode_tail(src, p, lim, i, iend, lut, slow, dst):
    """Exact one-symbol-at-a-time decode of dst[i:iend]; returns (p, errors)."""
    while i < iend:
        q = p >> 3
        if q + 8 > lim:
            return p, 1
        w = _ld64(src, q) >> (p & 7)
        e = lut[w & (LUTSIZE - 1)]
        if ((e >> 32) & 7) != 0:
            dst[_U(i)] = e & 255
            b = (e >> 40) & 15
        else:
            s, b = _slow_sym(w, slow)
            dst[_U(i)] = s
            if b == 0:
                return p, 1
        p += b
        i += 1
    return p, 0


@njit(cache=True, nogil=True)
def _decode4(src, pos, slen, n, lut, slow, dst):
    """Decode n symbols coded as 4 interleaved-in-time streams (quarters of the chunk). Returns #errors."""
    if slen < 20:
        return 1
    lim = pos + slen  # the last 8 bytes are zero padding
    l0 = np.int64(src[pos]) | (np.int64(src[pos + 1]) << 8) | (np.int64(src[pos + 2]) << 16) | (np.int64(src[pos + 3]) << 24)
    l1 = np.int64(src[pos + 4]) | (np.int64(src[pos + 5]) << 8) | (np.int64(src[pos + 6]) << 16) | (np.int64(src[pos + 7]) << 24)
    l2 = np.int64(src[pos + 8]) | (np.int64(src[pos + 9]) << 8) | (np.int64(src[pos + 10]) << 16) | (np.int64(src[pos + 11]) << 24)
    if pos + 12 + l0 + l1 + l2 + 8 > lim:
        return 1
    q = (n + 3) // 4
    e0 = min(q, n)
    e1 = min(2 * q, n)
    e2 = min(3 * q, n)
    i0, i1, i2, i3 = 0, e0, e1, e2
    p0 = (pos + 12) * 8
    p1 = p0 + l0 * 8
    p2 = p1 + l1 * 8
    p3 = p2 + l2 * 8
    lim8 = (lim - 8) * 8
    err = 0
    while i0 + 16 <= e0 and i1 + 16 <= e1 and i2 + 16 <= e2 and i3 + 16 <= n:
        if p0 > lim8 or p1 > lim8 or p2 > lim8 or p3 > lim8:
            return 1
        w0 = _ld64(src, p0 >> 3) >> (p0 & 7)
        w1 = _ld64(src, p1 >> 3) >> (p1 & 7)
        w2 = _ld64(src, p2 >> 3) >> (p2 & 7)
        w3 = _ld64(src, p3 >> 3) >> (p3 & 7)
        # a refill holds >= 57 valid bits: 3 lookups of at most MAXLEN (15) bits each fit, 4 long codes (60) do not
        for _ in range(3):
            f0 = lut[w0 & MASK]
            f1 = lut[w1 & MASK]
            f2 = lut[w2 & MASK]
            f3 = lut[w3 & MASK]
            c0 = (f0 >> 32) & 7
            c1 = (f1 >> 32) & 7
            c2 = (f2 >> 32) & 7
            c3 = (f3 >> 32) & 7
            b0 = (f0 >> 36) & 15
            b1 = (f1 >> 36) & 15
            b2 = (f2 >> 36) & 15
            b3 = (f3 >> 36) & 15
            dst[_U(i0)] = f0 & 255
            dst[_U(i0 + 1)] = (f0 >> 8) & 255
            dst[_U(i0 + 2)] = (f0 >> 16) & 255
            dst[_U(i0 + 3)] = (f0 >> 24) & 255
            dst[_U(i1)] = f1 & 255
            dst[_U(i1 + 1)] = (f1 >> 8) & 255
            dst[_U(i1 + 2)] = (f1 >> 16) & 255
            dst[_U(i1 + 3)] = (f1 >> 24) & 255
            dst[_U(i2)] = f2 & 255
            dst[_U(i2 + 1)] = (f2 >> 8) & 255
            dst[_U(i2 + 2)] = (f2 >> 16) & 255
            dst[_U(i2 + 3)] = (f2 >> 24) & 255
            dst[_U(i3)] = f3 & 255
            dst[_U(i3 + 1)] = (f3 >> 8) & 255
            dst[_U(i3 + 2)] = (f3 >> 16) & 255
            dst[_U(i3 + 3)] = (f3 >> 24) & 255
            if (c0 == 0) | (c1 == 0) | (c2 == 0) | (c3 == 0):  # rare: a code longer than LUTBITS
                if c0 == 0:
                    s, b0 = _slow_sym(w0, slow)
                    dst[_U(i0)] = s
                    c0 = 1
                if c1 == 0:
                    s, b1 = _slow_sym(w1, slow)
                    dst[_U(i1)] = s
                    c1 = 1
                if c2 == 0:
                    s, b2 = _slow_sym(w2, slow)
                    dst[_U(i2)] = s
                    c2 = 1
                if c3 == 0:
                    s, b3 = _slow_sym(w3, slow)
                    dst[_U(i3)] = s
                    c3 = 1
                if b0 == 0 or b1 == 0 or b2 == 0 or b3 == 0:  # table hits always have b >= 1
                    return 1
            i0 += c0
            i1 += c1
            i2 += c2
            i3 += c3
            w0 >>= b0
            w1 >>= b1
            w2 >>= b2
            w3 >>= b3
            p0 += b0
            p1 += b1
            p2 += b2
            p3 += b3
    p0, e = _decode_tail(src, p0, lim, i0, e0, lut, slow, dst)
    err += e
    p1, e = _decode_tail(src, p1, lim, i1, e1, lut, slow, dst)
    err += e
    p2, e = _decode_tail(src, p2, lim, i2, e2, lut, slow, dst)
    err += e
    p3, e = _decode_tail(src, p3, lim, i3, n, lut, slow, dst)
    err += e
    return err


@njit(cache=True, nogil=True)
def _enc_stream(syms, a, b, ct, w, k):
    """Code syms[a:b] as an LSB-first bit stream of 32-bit words at w[k:]; returns the end word.

    Branch-free: two codes (<= 30 bits) join the < 32 pending bits, a word is always stored and
    the write index advances only when it is full.  Indices are cast to unsigned so numba emits
    no negative-index wraparound code (about 2x faster).
    """
    acc = 0
    nb = 0
    i = a
    while i + 1 < b:
        e = ct[syms[_U(i)]]
        f = ct[syms[_U(i + 1)]]
        acc |= ((e & 0xFFFF) | ((f & 0xFFFF) << (e >> 16))) << nb
        nb += (e >> 16) + (f >> 16)
        w[_U(k)] = acc & 0xFFFFFFFF
        full = nb >> 5
        acc >>= full << 5
        nb &= 31
        k += full
        i += 2
    if i < b:
        e = ct[syms[_U(i)]]
        acc |= (e & 0xFFFF) << nb
        nb += e >> 16
    while nb > 0:
        w[_U(k)] = acc & 0xFFFFFFFF
        k += 1
        acc >>= 32
        nb -= 32
    return k


@njit(cache=True, nogil=True)
def _encode4(syms, n, ct, out, pos, scr, lim):
    """4 streams over the quarters of syms[:n]: [u32 len0][u32 len1][u32 len2][s0][s1][s2][s3][8 zero bytes].

    The streams are coded into 32-bit words in `scr` (>= 4 * ((ceil(n/4) * MAXLEN) // 32 + 4)
    entries), then copied to out[pos:].  Returns the end position, or `pos` (nothing written)
    when the coded area would take >= lim bytes.
    """
    q = (n + 3) // 4
    cap = scr.shape[0] // 4
    ks = np.empty(4, np.int64)
    tot = 0
    for s in range(4):
        a = min(s * q, n)
        b = min((s + 1) * q, n)
        ks[s] = _enc_stream(syms, a, b, ct, scr, s * cap) - s * cap
        tot += ks[s]
    if 20 + 4 * tot >= lim:
        return pos
    for s in range(3):
        _put32(out, pos + 4 * s, 4 * ks[s])
    p = pos + 12
    for s in range(4):
        k = ks[s]
        out[p : p + 4 * k] = scr[s * cap : s * cap + k].view(np.uint8)
        p += 4 * k
    out[p : p + 8] = 0
    return p + 8


# --------------------------------------------------------------------------------------------
# split / merge of values into symbol + raw planes (numba)
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _split(kind, x, s0, n, syms, out, ro):
    """Symbols to syms[:n], raw planes to out[ro:].  (Slices + narrow types: LLVM vectorizes.)"""
    sv = syms[:n]
    if kind == 0:  # bf16: exponent = bits 7..14
        xv = x[s0 : s0 + n]
        ov = out[ro : ro + n]
        for i in range(n):
            v = xv[i]
            sv[i] = np.uint8((v >> np.uint16(7)) & np.uint16(255))
            ov[i] = np.uint8(((v >> np.uint16(8)) & np.uint16(0x80)) | (v & np.uint16(0x7F)))
    elif kind == 1:  # fp16: high byte = sign, exponent, 2 mantissa bits
        xv = x[s0 : s0 + n]
        ov = out[ro : ro + n]
        for i in range(n):
            v = xv[i]
            sv[i] = np.uint8(v >> np.uint16(8))
            ov[i] = np.uint8(v & np.uint16(255))
    else:  # fp32 (x holds two uint16 per value): exponent = bits 23..30
        xv = x[2 * s0 : 2 * (s0 + n)]
        o0 = out[ro : ro + n]
        o1 = out[ro + n : ro + 2 * n]
        o2 = out[ro + 2 * n : ro + 3 * n]
        for i in range(n):
            lo = xv[2 * i]
            hi = xv[2 * i + 1]
            sv[i] = np.uint8((hi >> np.uint16(7)) & np.uint16(255))
            o0[i] = np.uint8(lo & np.uint16(255))
            o1[i] = np.uint8(lo >> np.uint16(8))
            o2[i] = np.uint8((hi & np.uint16(0x7F)) | ((hi >> np.uint16(8)) & np.uint16(0x80)))


@njit(cache=True, nogil=True)
def _merge(kind, syms, src, ro, n, y, s0):
    sv = syms[:n]
    if kind == 0:
        rv = src[ro : ro + n]
        yv = y[s0 : s0 + n]
        for i in range(n):
            r = np.uint16(rv[i])
            yv[i] = ((r & np.uint16(0x80)) << np.uint16(8)) | (np.uint16(sv[i]) << np.uint16(7)) | (r & np.uint16(0x7F))
    elif kind == 1:
        rv = src[ro : ro + n]
        yv = y[s0 : s0 + n]
        for i in range(n):
            yv[i] = (np.uint16(sv[i]) << np.uint16(8)) | np.uint16(rv[i])
    else:
        r0 = src[ro : ro + n]
        r1 = src[ro + n : ro + 2 * n]
        r2 = src[ro + 2 * n : ro + 3 * n]
        yv = y[2 * s0 : 2 * (s0 + n)]
        for i in range(n):
            b2 = np.uint16(r2[i])
            s = np.uint16(sv[i])
            yv[2 * i] = np.uint16(r0[i]) | (np.uint16(r1[i]) << np.uint16(8))
            yv[2 * i + 1] = (b2 & np.uint16(0x7F)) | ((s & np.uint16(1)) << np.uint16(7)) | (((b2 & np.uint16(0x80)) | (s >> np.uint16(1))) << np.uint16(8))


# --------------------------------------------------------------------------------------------
# chunk groups (numba)
# --------------------------------------------------------------------------------------------

SAMPLE_STRIDE = 4  # the per-chunk histogram looks at every 4th symbol


@njit(cache=True, nogil=True)
def _pack_lengths(lens, out, p):
    for k in range(128):
        out[p + k] = (lens[2 * k] & 15) | ((lens[2 * k + 1] & 15) << 4)


@njit(cache=True, nogil=True)
def _unpack_lengths(src, p):
    lens = np.zeros(256, np.int64)
    for k in range(128):
        b = np.int64(src[p + k])
        lens[2 * k] = b & 15
        lens[2 * k + 1] = b >> 4
    return lens


@njit(cache=True, nogil=True)
def _put32(out, p, v):
    out[p] = v & 255
    out[p + 1] = (v >> 8) & 255
    out[p + 2] = (v >> 16) & 255
    out[p + 3] = (v >> 24) & 255


@njit(cache=True, nogil=True)
def _sample_hist(syms, n, h):
    """h = histogram of syms[0:n:SAMPLE_STRIDE], in 4 interleaved tables (a skewed histogram
    otherwise stalls on store-to-load forwarding of the same counter)."""
    h4 = np.zeros((4, 256), np.int64)
    S = SAMPLE_STRIDE
    i = 0
    while i + 3 * S < n:
        h4[0, syms[_U(i)]] += 1
        h4[1, syms[_U(i + S)]] += 1
        h4[2, syms[_U(i + 2 * S)]] += 1
        h4[3, syms[_U(i + 3 * S)]] += 1
        i += 4 * S
    while i < n:
        h4[0, syms[_U(i)]] += 1
        i += S
    for s in range(256):
        h[s] = h4[0, s] + h4[1, s] + h4[2, s] + h4[3, s]


@njit(cache=True, nogil=True)
def _encode_group(kind, x, N, chunk_vals, c0, c1, cm, has_model, out, o, offs):
    """Encode chunks c0..c1-1 of x into out starting at o; offs[c] = start of chunk c. Returns end."""
    W = 4 if kind == 2 else 2
    syms = np.empty(chunk_vals + 8, np.uint8)
    h = np.zeros(256, np.int64)
    scr = np.empty(4 * ((((chunk_vals + 3) // 4) * MAXLEN) // 32 + 4), np.uint32)
    for c in range(c0, c1):
        s0 = c * chunk_vals
        n = min(chunk_vals, N - s0)
        offs[c] = o
        ro = o + HDR
        _split(kind, x, s0, n, syms, out, ro)
        # sampled histogram -> estimated cost of the model code and of a histogram code
        _sample_hist(syms, n, h)
        ns = 0
        mb = 0
        for s in range(256):
            ns += h[s]
            mb += h[s] * (cm[s] >> 16)
        if not has_model:
            mb = 1 << 62
        mode = 1
        best = mb
        ent = 0.0
        for s in range(256):
            if h[s] > 0:
                ent += h[s] * math.log2(ns / h[s])
        tbits = 8 * TABLE_BYTES * ns / n
        ct = cm
        lh = np.zeros(256, np.int64)
        if ent + tbits < best:
            f = np.empty(256, np.int64)
            for s in range(256):
                f[s] = h[s] * 256 + 1  # floor: every symbol keeps a code
            lh = _huff_lengths(f, MAXLEN)
            hb = tbits
            for s in range(256):
                hb += h[s] * lh[s]
            if hb < best:
                mode = 2
                best = hb
                ct, _slow = _canonical(lh)
        p = ro + (W - 1) * n
        end = p
        if best < 8 * ns:
            end = _encode4(syms, n, ct, out, p, scr, n - (TABLE_BYTES if mode == 2 else 0))
        if end == p or end - p + (TABLE_BYTES if mode == 2 else 0) >= n:
            mode = 0
            out[p : p + n] = syms[:n]
            end = p + n
        slen = end - p
        if mode == 2:
            _pack_lengths(lh, out, end)
            end += TABLE_BYTES
        out[o] = mode
        out[o + 1] = 0
        out[o + 2] = 0
        out[o + 3] = 0
        _put32(out, o + 4, slen)
        o = end
    return o


@njit(cache=True, nogil=True)
def _decode_group(kind, src, offs, N, chunk_vals, c0, c1, lut_m, slow_m, y):
    """Decode chunks c0..c1-1 (chunk c = src[offs[c]:offs[c+1]]) into y. Returns #errors."""
    W = 4 if kind == 2 else 2
    syms = np.zeros(chunk_vals + 8, np.uint8)
    err = 0
    for c in range(c0, c1):
        s0 = c * chunk_vals
        n = min(chunk_vals, N - s0)
        o = offs[c]
        end = offs[c + 1]
        if end - o < HDR + (W - 1) * n:
            err += 1
            continue
        mode = src[o]
        slen = (
            np.int64(src[o + 4])
            | (np.int64(src[o + 5]) << 8)
            | (np.int64(src[o + 6]) << 16)
            | (np.int64(src[o + 7]) << 24)
        )
        ro = o + HDR
        p = ro + (W - 1) * n
        tab = TABLE_BYTES if mode == 2 else 0
        if p + slen + tab != end:
            err += 1
            continue
        if mode == 0:
            if slen != n:
                err += 1
                continue
            syms[:n] = src[p : p + n]
        elif mode == 1:
            if lut_m.shape[0] != LUTSIZE:
                err += 1
                continue
            err += _decode4(src, p, slen, n, lut_m, slow_m, syms)
        elif mode == 2:
            lens = _unpack_lengths(src, p + slen)
            codes, slow = _canonical(lens)
            lut = _build_lut(codes)
            err += _decode4(src, p, slen, n, lut, slow, syms)
        else:
            err += 1
            continue
        _merge(kind, syms, src, ro, n, y, s0)
    return err


# --------------------------------------------------------------------------------------------
# Gaussian model
# --------------------------------------------------------------------------------------------


def _half_normal_mass(a: float, b: float, sigma: float) -> float:
    """P(a <= |x| < b) for x ~ N(0, sigma)."""
    s = sigma * math.sqrt(2.0)
    a, b = a / s, b / s
    if b < 1.0:
        return max(math.erf(b) - math.erf(a), 0.0)
    return max(math.erfc(a) - math.erfc(b), 0.0)


def _symbol_interval(kind: int, sym: int) -> tuple[float, float, float] | None:
    """(lo, hi, weight) of |x| that `sym` stands for; None for Inf/NaN symbols."""
    if kind in (KIND_BF16, KIND_F32):
        if sym == 255:
            return None
        if sym == 0:
            return 0.0, 2.0**-126, 1.0
        return 2.0 ** (sym - 127), 2.0 ** (sym - 126), 1.0
    e, m2 = (sym >> 2) & 31, sym & 3  # fp16 high byte: sign, 5 exponent bits, 2 mantissa bits
    if e == 31:
        return None
    if e == 0:
        return m2 / 4 * 2.0**-14, (m2 + 1) / 4 * 2.0**-14, 0.5
    return 2.0 ** (e - 15) * (1 + m2 / 4), 2.0 ** (e - 15) * (1 + (m2 + 1) / 4), 0.5


_MODEL_CACHE: dict[tuple[int, int], np.ndarray] = {}


def model_lengths(kind: int, sigma: float) -> np.ndarray:
    """Code lengths (int64[256], all in 1..15) of the Gaussian-model code for N(0, sigma)."""
    q = int(round(math.log2(sigma) * 64))  # sigma quantized to 1/64 octave
    key = (kind, q)
    lens = _MODEL_CACHE.get(key)
    if lens is None:
        sq = 2.0 ** (q / 64)
        freq = np.ones(256, np.int64)
        for s in range(256):
            iv = _symbol_interval(kind, s)
            if iv is not None:
                freq[s] = max(int(_half_normal_mass(iv[0], iv[1], sq) * iv[2] * 2.0**40), 1)
        lens = _huff_lengths(freq, MAXLEN)
        _MODEL_CACHE[key] = lens
    return lens


def estimate_sigma(x: np.ndarray, kind: int, samples: int = 16384) -> float:
    """RMS of a strided subsample of the finite values (0.0 if none)."""
    if kind == KIND_F32:
        x = x.view(np.uint32)
    n = x.shape[0]
    if n == 0:
        return 0.0
    r = _rms(x, kind, max(1, n // samples))
    return r if math.isfinite(r) and r > 0 else 0.0


@njit(cache=True, nogil=True)
def _rms(x, kind, step):
    """RMS of the finite values among x[::step] (bit patterns of `kind`), decoded exactly in float64."""
    acc = 0.0
    cnt = 0
    for i in range(0, x.shape[0], step):
        b = np.int64(x[_U(i)])
        if kind == 1:  # fp16
            e = (b >> 10) & 31
            m = b & 1023
            if e == 31:
                continue
            v = math.ldexp(float(m), -24) if e == 0 else math.ldexp(float(m | 1024), e - 25)
        else:  # bf16 (the high half of an fp32) or fp32
            if kind == 0:
                b <<= 16
            e = (b >> 23) & 255
            m = b & 0x7FFFFF
            if e == 255:
                continue
            v = math.ldexp(float(m), -149) if e == 0 else math.ldexp(float(m | 0x800000), e - 150)
        acc += v * v
        cnt += 1
    if cnt == 0:
        return 0.0
    return math.sqrt(acc / cnt)


# --------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------


@dataclass
class Encoded:
    """One coded tensor: `payload[offsets[c]:offsets[c+1]]` is chunk c."""

    dtype: str
    shape: tuple[int, ...]
    chunk_values: int
    payload: np.ndarray  # uint8
    offsets: np.ndarray  # int64, nchunks + 1
    model_lengths: np.ndarray | None = None  # int64[256] or None
    sigma: float = 0.0
    modes: np.ndarray | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nchunks(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        """Coded size: payload plus the model table (what a container stores besides its index)."""
        return int(self.offsets[-1]) + (TABLE_BYTES if self.model_lengths is not None else 0)

    def chunk(self, c: int) -> np.ndarray:
        return self.payload[self.offsets[c] : self.offsets[c + 1]]

    def chunk_modes(self) -> list[int]:
        if self.dtype not in _KIND_OF:
            return []
        return [int(self.payload[self.offsets[c]]) for c in range(self.nchunks)]

    # ---- serialization (self-describing blob, used by compress()/decompress() and comm) ----
    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts())

    def to_parts(self) -> list:
        shape = self.shape
        flags = 1 if self.model_lengths is not None else 0
        head = struct.pack(
            "<4sBBBBIfI",
            b"ZCL1",
            1,
            DTYPE_NAMES.index(self.dtype),
            len(shape),
            flags,
            self.chunk_values,
            self.sigma,
            self.nchunks,
        )
        parts = [head, struct.pack(f"<{len(shape)}q", *shape)]
        if flags:
            t = np.zeros(TABLE_BYTES, np.uint8)
            _pack_lengths(self.model_lengths, t, 0)
            parts.append(t.tobytes())
        parts.append(np.diff(self.offsets).astype("<u4").tobytes())
        parts.append(memoryview(self.payload[: int(self.offsets[-1])]))
        return parts

    @classmethod
    def from_bytes(cls, blob) -> Encoded:
        buf = np.frombuffer(blob, np.uint8)
        try:
            magic, ver, dt, ndim, flags, cv, sigma, nch = struct.unpack_from("<4sBBBBIfI", buf, 0)
            if magic != b"ZCL1" or ver != 1 or dt >= len(DTYPE_NAMES):
                raise ValueError("not a ZipCCL blob")
            p = 20
            shape = struct.unpack_from(f"<{ndim}q", buf, p)
            p += 8 * ndim
            ml = None
            if flags & 1:
                ml = _unpack_lengths(buf, p)
                p += TABLE_BYTES
            sizes = np.frombuffer(buf[p : p + 4 * nch].tobytes(), "<u4").astype(np.int64)
            if sizes.shape[0] != nch:
                raise ValueError("truncated chunk table")
            p += 4 * nch
        except struct.error as exc:
            raise ValueError(f"truncated ZipCCL blob: {exc}") from None
        offsets = np.zeros(nch + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        payload = buf[p:]
        if payload.shape[0] < offsets[-1]:
            raise ValueError("truncated ZipCCL payload")
        return cls(DTYPE_NAMES[dt], tuple(shape), cv, payload, offsets, ml, sigma)


_POOL: ThreadPoolExecutor | None = None
_POOL_N = 0
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_N
    with _POOL_LOCK:
        if _POOL is None or _POOL_N != threads:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="zipccl")
            _POOL_N = threads
        return _POOL


def default_threads() -> int:
    """The codec's pool: one thread per core, at most 8 (more do not help the chunked coder)."""
    from llmcompress.runtime import default_threads as cpu_threads

    return cpu_threads(cap=8)


def run_tasks(tasks, threads: int) -> list:
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    return list(_pool(threads).map(lambda t: t(), tasks))


def _flat_view(t) -> tuple[np.ndarray, str]:
    """A flat numpy view (uint16/uint32/uint8) of a contiguous CPU tensor's bits, and its dtype name."""
    import torch

    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    name = str(t.dtype).replace("torch.", "")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    kind = _KIND_OF.get(name, KIND_RAW)
    if t.numel() == 0:
        return np.zeros(0, np.uint16 if kind != KIND_RAW else np.uint8), name
    if kind in (KIND_BF16, KIND_F16):
        return t.view(torch.int16).numpy().view(np.uint16), name
    if kind == KIND_F32:
        return t.view(torch.int16).numpy().view(np.uint16), name  # two uint16 per value
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.numel() == 0:
        return np.zeros(0, np.uint8), name
    return t.view(torch.uint8).numpy(), name


def _groups(nchunks: int, chunk_bytes: int, threads: int) -> list[tuple[int, int]]:
    per = max(1, GROUP_BYTES // max(chunk_bytes, 1))
    if threads > 1:
        per = max(1, min(per, -(-nchunks // threads)))
    return [(c, min(c + per, nchunks)) for c in range(0, nchunks, per)]


def _chunk_values_for(name: str, chunk_bytes: int) -> int:
    w = _WIDTH.get(_KIND_OF.get(name, KIND_RAW), 1)
    return max(64, chunk_bytes // w)


def encode_many(tensors, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = 1) -> list[Encoded]:
    """Encode tensors (bf16/fp16/fp32 coded, other dtypes stored raw), chunks spread over threads."""
    jobs = []
    results: list[Encoded] = []
    for t in tensors:
        x, name = _flat_view(t)
        shape = tuple(t.shape)
        kind = _KIND_OF.get(name, KIND_RAW)
        N = x.shape[0] // 2 if kind == KIND_F32 else x.shape[0]
        if kind == KIND_RAW or N == 0:
            cv = max(1, chunk_bytes)
            nch = -(-x.nbytes // cv) if kind == KIND_RAW else 0
            payload = x.view(np.uint8).reshape(-1) if kind == KIND_RAW else np.zeros(0, np.uint8)
            offs = np.minimum(np.arange(nch + 1, dtype=np.int64) * cv, payload.shape[0])
            results.append(Encoded(name, shape, cv if kind == KIND_RAW else _chunk_values_for(name, chunk_bytes), payload, offs))
            continue
        W = _WIDTH[kind]
        cv = _chunk_values_for(name, chunk_bytes)
        nch = -(-N // cv)
        sigma = estimate_sigma(x, kind)
        lm = model_lengths(kind, sigma) if sigma > 0 else None
        cm = _canonical(lm)[0] if lm is not None else np.zeros(256, np.int64)
        maxc = HDR + W * cv + 64  # a chunk never exceeds HDR + W * n bytes (raw fallback)
        out = np.empty(nch * maxc, np.uint8)
        offs = np.zeros(nch + 1, np.int64)
        enc = Encoded(name, shape, cv, out, offs, lm, sigma)
        results.append(enc)
        # one group per thread (a single group, written in place, when threads == 1)
        per = -(-nch // max(1, threads))
        groups = [(c, min(c + per, nch)) for c in range(0, nch, per)]
        ends = [0] * len(groups)
        for gi, (c0, c1) in enumerate(groups):

            def job(kind=kind, x=x, N=N, cv=cv, c0=c0, c1=c1, lm=lm, cm=cm, out=out, offs=offs, gi=gi, ends=ends, maxc=maxc):
                ends[gi] = _encode_group(kind, x, N, cv, c0, c1, cm, lm is not None, out, c0 * maxc, offs)

            jobs.append(job)
        enc._groups = (groups, ends, maxc)  # type: ignore[attr-defined]
    run_tasks(jobs, threads)
    for enc in results:
        g = getattr(enc, "_groups", None)
        if g is None:
            continue
        groups, ends, maxc = g
        del enc._groups  # type: ignore[attr-defined]
        if len(groups) == 1:
            enc.offsets[-1] = ends[0]
            enc.payload = enc.payload[: ends[0]]
            continue
        # compact in place: move each group's output left, right after the previous one
        buf, shift, offs = enc.payload, 0, enc.offsets
        for (c0, c1), e in zip(groups, ends):
            start = c0 * maxc
            ln = e - start
            if start != shift:
                gap = start - shift  # > 0: copy in non-overlapping blocks of `gap` bytes
                for k in range(0, ln, gap):
                    m = min(gap, ln - k)
                    buf[shift + k : shift + k + m] = buf[start + k : start + k + m]
            offs[c0:c1] += shift - start
            shift += ln
        offs[-1] = shift
        enc.payload = buf[:shift]
    return results


def encode(t, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = 1) -> Encoded:
    """Encode one tensor (see `encode_many`)."""
    return encode_many([t], chunk_bytes, threads)[0]


class CorruptData(ValueError):
    pass


def _decode_tables(enc: Encoded):
    if enc.model_lengths is None:
        return np.zeros(1, np.int64), np.zeros(304, np.int64)
    codes, slow = _canonical(enc.model_lengths)
    return _build_lut(codes), slow


_NP_OF = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}


def _empty(shape, dt):
    """torch.empty via numpy, whose large allocations use transparent huge pages (fewer page faults)."""
    import torch

    name = str(dt).replace("torch.", "")
    if name in _NP_OF:
        return torch.from_numpy(np.empty(shape, _NP_OF[name])).view(dt)
    return torch.empty(shape, dtype=dt)


def decode_many(encs: list[Encoded], threads: int = 1, out: list | None = None) -> list:
    """Decode to CPU tensors (bit-exact). `out` may give preallocated contiguous tensors."""
    import torch

    tensors, jobs, errs = [], [], []
    for i, enc in enumerate(encs):
        dt = getattr(torch, enc.dtype)
        y = out[i] if out is not None else _empty(enc.shape, dt)
        tensors.append(y)
        kind = _KIND_OF.get(enc.dtype, KIND_RAW)
        if enc.numel == 0:
            continue
        if kind == KIND_RAW:
            yb = y.reshape(-1).view(torch.uint8).numpy() if dt != torch.bool else y.reshape(-1).view(torch.uint8).numpy()
            if enc.payload.shape[0] < yb.shape[0]:
                raise CorruptData(f"raw payload too short ({enc.payload.shape[0]} < {yb.shape[0]})")
            yb[:] = enc.payload[: yb.shape[0]]
            continue
        yv = y.view(torch.int16).reshape(-1).numpy().view(np.uint16)
        if enc.nchunks != -(-enc.numel // enc.chunk_values) or enc.offsets[-1] > enc.payload.shape[0]:
            raise CorruptData("chunk table does not match the tensor size")
        lut, slow = _decode_tables(enc)
        W = _WIDTH[kind]
        for c0, c1 in _groups(enc.nchunks, enc.chunk_values * W, threads):

            def job(kind=kind, enc=enc, c0=c0, c1=c1, lut=lut, slow=slow, yv=yv):
                errs.append(
                    _decode_group(kind, enc.payload, enc.offsets, enc.numel, enc.chunk_values, c0, c1, lut, slow, yv)
                )

            jobs.append(job)
    run_tasks(jobs, threads)
    if any(errs):
        raise CorruptData(f"{sum(errs)} malformed chunk(s) in coded tensor")
    return tensors


def decode(enc: Encoded, threads: int = 1):
    return decode_many([enc], threads)[0]


def compress(t, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = 1) -> bytes:
    """Tensor -> self-describing bytes."""
    return encode(t, chunk_bytes, threads).to_bytes()


def decompress(blob, threads: int = 1):
    """Bytes from `compress` -> tensor, bit-exact."""
    return decode(Encoded.from_bytes(blob), threads)


def order0_bound(t) -> float:
    """Order-0 bound on the ratio: (exponent-symbol entropy + raw bits) / original bits."""
    x, name = _flat_view(t)
    kind = _KIND_OF.get(name, KIND_RAW)
    if kind == KIND_RAW or x.shape[0] == 0:
        return 1.0
    if kind == KIND_F32:
        x = x.view(np.uint32)
    syms = ((x >> 7) & 255) if kind == KIND_BF16 else ((x >> 8) & 255) if kind == KIND_F16 else ((x >> 23) & 255)
    h = np.bincount(syms.astype(np.uint8), minlength=256).astype(np.float64)
    p = h[h > 0] / x.shape[0]
    ent = float(-(p * np.log2(p)).sum())
    W = _WIDTH[kind]
    return (ent + 8 * (W - 1)) / (8 * W)


def warmup() -> None:
    """Compile (or load from cache) every kernel, on a tiny input."""
    import torch

    for dt in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(300, dtype=torch.float32).to(dt)
        decode(encode(t, chunk_bytes=256))
