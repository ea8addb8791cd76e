/* The SIMD kernels of ortspec's custom ops (_q4kernel.c includes this file once).
 *
 * Activations: x [rows, k] float32 -> int8 per row and block of 32 (scale max|x| / 127,
 * rounding to nearest even), with each block's scale sx, the integer sum ix of its int8 values,
 * bx, the float sum of x over the block, and qs = sx * ix.
 *
 * Q4 computes as onnxruntime's block-min graph did: w = d * (q - z) + o per block, z the integer
 * nearest -m / d in 0..15 and o = m + z * d, so the int8 activations meet the centred (q - z) and
 * the small offset o multiplies the exact block sum bx.
 *
 * Weights, in tiles of 16 outputs (TILE) by blocks of 32 inputs (QK):
 * - Q4 (Q4_1, w = d * q + m, q in 0..15): 256 bytes a tile-block, 64-byte row j holding, at byte
 *   4 * c + u, input 4 * j + u of output c in the low nibble and input 16 + 4 * j + u in the
 *   high nibble; d and m float16 [tiles, blocks, 16].
 * - Q8 (Q8_0 as MatMulNBits stores it, w = d * (u - 128), u in 0..255): 512 bytes a tile-block,
 *   64-byte row g holding input 4 * g + u of output c at byte 4 * c + u; d float32.
 *
 * Each output element is accumulated block after block in the same order whatever the number of
 * rows, so a row of a call of any size is the lone row bit for bit. */
#include <immintrin.h>

#define QK 32
#define TILE 16
#define ROWS512 16 /* rows a pass over a tile's weights serves: AVX-512 VNNI, 8-bit weights */
#define ROWS512_Q4 12 /* ... 4-bit weights, whose unpacking and zero points hold 3 more registers */
#define ROWS256 4 /* ... AVX2 */
/* the rows of the int8 activations lie k + QX_PAD bytes apart: with k a multiple of 4096 (the
 * 1B shape's 8192) rows k apart all fall in one set of the L1 cache, and a pass over 16 rows
 * evicted its own activations */
#define QX_PAD 64

/* bytes ahead of the block being read that the kernels ask the cache for: a step reads every
 * weight once from memory, faster than the hardware prefetcher alone fetches it (measured on
 * Q4 weights past the cache: a one-row product 0.72x the time, eight rows 0.86x) */
#define PREFETCH_AHEAD 4096

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define INLINE __attribute__((always_inline)) inline

/* `lines` cache lines from `ahead` bytes past p, the block about to be read (an address past the
 * weight's end is only a hint: nothing is read there) */
static INLINE void prefetch(const void *p, int64_t ahead, int lines) {
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)p + ahead + 64 * i, _MM_HINT_T0);
}

static AVX2 void quantize_rows(const float *x, int64_t rows, int64_t k, int64_t stride,
                               int8_t *qx, float *sx, float *bx, int32_t *ix, float *qs) {
    int64_t nb = k / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QK;
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
            __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h);
            __m256 fs = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
            __m128 f4 = _mm_add_ps(_mm256_castps256_ps128(fs), _mm256_extractf128_ps(fs, 1));
            f4 = _mm_add_ps(f4, _mm_movehl_ps(f4, f4));
            f4 = _mm_add_ss(f4, _mm_movehdup_ps(f4));
            __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
            __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qx + r * stride + b * QK), p8);
            int32_t total = _mm_cvtsi128_si32(s4);
            sx[r * nb + b] = amax / 127.f;
            bx[r * nb + b] = _mm_cvtss_f32(f4);
            ix[r * nb + b] = total;
            qs[r * nb + b] = amax / 127.f * (float)total;
        }
}

typedef struct {
    int64_t rows, k, n;
    int64_t stride;  /* bytes from one row of qx to the next: k and a cache line (see QX_PAD) */
    const int8_t *qx;
    const float *sx, *bx;
    const int32_t *ix;
    const float *qs;
    /* AVX2 only: each row's int8 groups of 4 repeated across 32 bytes, [rows, k / 4, 32], so
     * that a multiply reads its operand whole instead of broadcasting it first */
    const int8_t *xb;
    const int8_t *xa;  /* ... and their absolute values (8-bit weights) */
} Activations;

/* the AVX2 kernels' broadcast activations (Activations.xb) from qx */
static AVX2 void broadcast_rows(const int8_t *qx, int64_t rows, int64_t k, int64_t stride,
                                int8_t *xb, int8_t *xa) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < k / 4; g++) {
            __m256i v = _mm256_set1_epi32(*(const int32_t *)(qx + r * stride + 4 * g));
            _mm256_store_si256((__m256i *)(xb + (r * (k / 4) + g) * 32), v);
            if (xa) _mm256_store_si256((__m256i *)(xa + (r * (k / 4) + g) * 32), _mm256_abs_epi8(v));
        }
}

/* ---- Q4: a tile-block's weights and terms (the AVX-512 and AMX kernels) ------------------- */

/* block b of a Q4 tile as 8 vectors of its 4-bit values, w[g] holding inputs 4g..4g+3 of each
 * output: the low nibbles are inputs 0..15, the high ones 16..31 */
static AVX512 INLINE void q4_split512(const uint8_t *q, int64_t b, __m512i *w) {
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512i packed = _mm512_loadu_si512((const void *)(q + b * 256 + j * 64));
        w[j] = _mm512_and_si512(packed, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
}

/* what block b of a Q4 tile adds to a row besides its int8 sums: d, and (see the top) the
 * centring's -z * d and the offset o = m + z * d, 16 outputs each */
typedef struct { __m512 dv, nzd, off; } Q4Terms;

static AVX512 INLINE Q4Terms q4_terms512(const uint16_t *d, const uint16_t *m, int64_t b) {
    const __m512 zero = _mm512_setzero_ps(), fifteen = _mm512_set1_ps(15.f);
    __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * TILE)));
    __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * TILE)));
    __mmask16 nonzero = _mm512_cmp_ps_mask(dv, zero, _CMP_NEQ_OQ);
    __m512 z = _mm512_maskz_div_ps(nonzero, _mm512_sub_ps(zero, mv), dv);
    z = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT |
                                                              _MM_FROUND_NO_EXC), zero), fifteen);
    Q4Terms t = {dv, _mm512_sub_ps(zero, _mm512_mul_ps(z, dv)), _mm512_fmadd_ps(z, dv, mv)};
    return t;
}

/* acc plus a row's block: its int32 sums s scaled by d * sx, then -z * d * qs and o * bx, in
 * this order (every kernel adds a block so, whatever computed s) */
static AVX512 INLINE __m512 q4_add512(__m512 acc, __m512i s, const Q4Terms *t, float sx, float qs,
                                      float bx) {
    __m512 scale = _mm512_mul_ps(t->dv, _mm512_set1_ps(sx));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc);
    acc = _mm512_fmadd_ps(t->nzd, _mm512_set1_ps(qs), acc);
    return _mm512_fmadd_ps(t->off, _mm512_set1_ps(bx), acc);
}

/* ---- Q4: R rows x one tile, all blocks ---------------------------------------------------- */

static AVX512 INLINE void q4_tile512(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                     const uint16_t *d, const uint16_t *m, float *y) {
    const int64_t nb = a->k / QK, stride = a->stride;
    const int8_t *qx = a->qx + r0 * stride;
    const float *sx = a->sx + r0 * nb, *bx = a->bx + r0 * nb, *qs = a->qs + r0 * nb;
    __m512 acc[ROWS512_Q4];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
        prefetch(q + b * 256, PREFETCH_AHEAD, 4);
        if ((b & 1) == 0) {  /* d and m: 32 bytes a block each, an eighth of q's 256 */
            prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
            prefetch(m + b * TILE, PREFETCH_AHEAD / 8, 1);
        }
        q4_split512(q, b, w);
        Q4Terms t = q4_terms512(d, m, b);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int32_t *xr = (const int32_t *)(qx + r * stride + b * QK);
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(xr[g]));
            acc[r] = q4_add512(acc[r], s, &t, sx[r * nb + b], qs[r * nb + b], bx[r * nb + b]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * a->n, acc[r]);
}

/* a half-tile's R accumulators: zeroed, and stored into y's rows r0.. at outputs h * 8.. */
static AVX2 INLINE void zero256(int R, __m256 *acc) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
}

static AVX2 INLINE void store256(int R, const __m256 *acc, float *y, int64_t n, int64_t r0, int h) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * n + h * 8, acc[r]);
}

/* block b's half h (8 outputs) of a Q4 tile: its 8 weight vectors unpacked, its scales d and
 * the float parts of its centring, off = m + z·d and nzd = -z·d */
static AVX2 INLINE void q4_half256(const uint8_t *q, const uint16_t *d, const uint16_t *m,
                                   int64_t b, int h, __m256i *w, __m256 *dv, __m256 *off,
                                   __m256 *nzd) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256 zero = _mm256_setzero_ps(), fifteen = _mm256_set1_ps(15.f);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(q + b * 256 + j * 64 + h * 32));
        w[j] = _mm256_and_si256(packed, low);
        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    *dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * TILE + h * 8)));
    __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b * TILE + h * 8)));
    __m256 nonzero = _mm256_cmp_ps(*dv, zero, _CMP_NEQ_OQ);
    __m256 z = _mm256_and_ps(_mm256_div_ps(_mm256_sub_ps(zero, mv), *dv), nonzero);
    z = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(z, _MM_FROUND_TO_NEAREST_INT |
                                                       _MM_FROUND_NO_EXC), zero), fifteen);
    *off = _mm256_fmadd_ps(z, *dv, mv);
    *nzd = _mm256_sub_ps(zero, _mm256_mul_ps(z, *dv));
}

/* a row's block of a Q4 half-tile into its accumulator: the int16 pair sums s16 (over the
 * block's 8 groups: at most 8 * 2 * 15 * 127 = 30480, nothing saturates) widened once, scaled
 * by d times the row's block scale sx, and the centring's terms with the row's integer and float
 * block sums (qs, bx) */
static AVX2 INLINE __m256 q4_add256(__m256 acc, __m256i s16, __m256 dv, __m256 off, __m256 nzd,
                                    float sx, float qs, float bx) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    acc = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, _mm256_set1_ps(sx)), acc);
    acc = _mm256_fmadd_ps(nzd, _mm256_set1_ps(qs), acc);
    return _mm256_fmadd_ps(off, _mm256_set1_ps(bx), acc);
}

/* AVX2, R rows of a pass (R > 1): the tile as two halves of 8 outputs, one after the other, so
 * that a half's R accumulators, its 8 unpacked weight vectors and a row's sums fit AVX2's 16
 * registers (with both halves at once they did not, and every row spilled); the rows' groups
 * read whole from the call's broadcast buffer (Activations.xb) */
static AVX2 INLINE void q4_tile256(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                   const uint16_t *d, const uint16_t *m, float *y) {
    const int64_t nb = a->k / QK;
    const int8_t *xb = a->xb + r0 * a->k * 8;
    const float *sx = a->sx + r0 * nb, *bx = a->bx + r0 * nb, *qs = a->qs + r0 * nb;
#pragma GCC unroll 1
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS256];
        zero256(R, acc);
        for (int64_t b = 0; b < nb; b++) {
            if (h == 0) {  /* the second half finds the tile's blocks in the cache */
                prefetch(q + b * 256, PREFETCH_AHEAD, 4);
                if ((b & 1) == 0) {
                    prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
                    prefetch(m + b * TILE, PREFETCH_AHEAD / 8, 1);
                }
            }
            __m256i w[8];
            __m256 dv, off, nzd;
            q4_half256(q, d, m, b, h, w, &dv, &off, &nzd);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i *xr = (const __m256i *)(xb + (r * nb + b) * 256);
                __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_load_si256(xr));
#pragma GCC unroll 7
                for (int g = 1; g < 8; g++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], _mm256_load_si256(xr + g)));
                acc[r] = q4_add256(acc[r], s16, dv, off, nzd, sx[r * nb + b], qs[r * nb + b],
                                   bx[r * nb + b]);
            }
        }
        store256(R, acc, y, a->n, r0, h);
    }
}

/* AVX2, a lone row (a step, streaming the weights): both halves block by block, the row's
 * groups broadcast from qx; in the broadcast buffer and a half at a time a step took
 * 1.1-1.2x the time */
static AVX2 INLINE void q4_row256(const Activations *a, int64_t r0, const uint8_t *q,
                                  const uint16_t *d, const uint16_t *m, float *y) {
    const int64_t nb = a->k / QK;
    const int32_t *x4 = (const int32_t *)(a->qx + r0 * a->stride);
    const float *sx = a->sx + r0 * nb, *bx = a->bx + r0 * nb, *qs = a->qs + r0 * nb;
    y += r0 * a->n;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        prefetch(q + b * 256, PREFETCH_AHEAD, 4);
        if ((b & 1) == 0) {
            prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
            prefetch(m + b * TILE, PREFETCH_AHEAD / 8, 1);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            __m256 dv, off, nzd;
            q4_half256(q, d, m, b, h, w, &dv, &off, &nzd);
            __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x4[b * 8]));
#pragma GCC unroll 7
            for (int g = 1; g < 8; g++)
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(x4[b * 8 + g])));
            acc[h] = q4_add256(acc[h], s16, dv, off, nzd, sx[b], qs[b], bx[b]);
        }
    }
    _mm256_storeu_ps(y, acc[0]);
    _mm256_storeu_ps(y + 8, acc[1]);
}

/* ---- Q8: R rows x one tile, all blocks ---------------------------------------------------- */

/* acc plus a row's block: its int32 sums s (the activations' sum times -128 included) scaled by
 * d * sx (every kernel adds a block so, whatever computed s) */
static AVX512 INLINE __m512 q8_add512(__m512 acc, __m512i s, __m512 dv, float sx) {
    __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc);
}

/* u8 weights times s8 activations, minus 128 times the activations' sum: exact integers */
static AVX512 INLINE void q8_tile512(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                     const float *d, float *y) {
    const int64_t nb = a->k / QK, stride = a->stride;
    const int8_t *qx = a->qx + r0 * stride;
    const float *sx = a->sx + r0 * nb;
    const int32_t *ix = a->ix + r0 * nb;
    __m512 acc[ROWS512];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
        prefetch(q + b * 512, PREFETCH_AHEAD, 8);
        prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);  /* 64 bytes a block, an eighth of q's */
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void *)(q + b * 512 + g * 64));
        __m512 dv = _mm512_loadu_ps(d + b * TILE);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int32_t *xr = (const int32_t *)(qx + r * stride + b * QK);
            __m512i s = _mm512_set1_epi32(-128 * ix[r * nb + b]);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(xr[g]));
            acc[r] = q8_add512(acc[r], s, dv, sx[r * nb + b]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * a->n, acc[r]);
}

/* block b's half h of a Q8 tile: its 8 weight vectors as s8 (u - 128), and its scales */
static AVX2 INLINE void q8_half256(const uint8_t *q, const float *d, int64_t b, int h,
                                   __m256i *w, __m256 *dv) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++)
        w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + b * 512 + g * 64 + h * 32)), flip);
    *dv = _mm256_loadu_ps(d + b * TILE + h * 8);
}

/* a group's products with the s8 weights: |x| times the weights with x's sign (vpsignb), so
 * the u8 x s8 pair sums stay within 2 * 127 * 128, widened to int32 */
static AVX2 INLINE __m256i q8_group256(__m256i w, __m256i x, __m256i ax) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x)), _mm256_set1_epi16(1));
}

/* AVX2, R rows of a pass (R > 1): the tile's halves one after the other, as in q4_tile256 */
static AVX2 INLINE void q8_tile256(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                   const float *d, float *y) {
    const int64_t nb = a->k / QK;
    const int8_t *xb = a->xb + r0 * a->k * 8, *xa = a->xa + r0 * a->k * 8;
    const float *sx = a->sx + r0 * nb;
#pragma GCC unroll 1
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS256];
        zero256(R, acc);
        for (int64_t b = 0; b < nb; b++) {
            if (h == 0) {
                prefetch(q + b * 512, PREFETCH_AHEAD, 8);
                prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
            }
            __m256i w[8];
            __m256 dv;
            q8_half256(q, d, b, h, w, &dv);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i *xr = (const __m256i *)(xb + (r * nb + b) * 256);
                const __m256i *ar = (const __m256i *)(xa + (r * nb + b) * 256);
                __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++)
                    s = _mm256_add_epi32(s, q8_group256(w[g], _mm256_load_si256(xr + g),
                                                        _mm256_load_si256(ar + g)));
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[r * nb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
            }
        }
        store256(R, acc, y, a->n, r0, h);
    }
}

/* AVX2, a lone row: both halves block by block, as q4_row256 */
static AVX2 INLINE void q8_row256(const Activations *a, int64_t r0, const uint8_t *q,
                                  const float *d, float *y) {
    const int64_t nb = a->k / QK;
    const int32_t *x4 = (const int32_t *)(a->qx + r0 * a->stride);
    const float *sx = a->sx + r0 * nb;
    y += r0 * a->n;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        prefetch(q + b * 512, PREFETCH_AHEAD, 8);
        prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            __m256 dv;
            q8_half256(q, d, b, h, w, &dv);
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m256i xg = _mm256_set1_epi32(x4[b * 8 + g]);
                s = _mm256_add_epi32(s, q8_group256(w[g], xg, _mm256_abs_epi8(xg)));
            }
            __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[b]));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[h]);
        }
    }
    _mm256_storeu_ps(y, acc[0]);
    _mm256_storeu_ps(y + 8, acc[1]);
}

/* a pass of R rows of AVX2: a lone row's loop for R = 1 (a call of one row: the even passes
 * make no group of one otherwise), the half-tiles' for more */
static AVX2 INLINE void q4_pass256(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                   const uint16_t *d, const uint16_t *m, float *y) {
    if (R == 1) q4_row256(a, r0, q, d, m, y);
    else q4_tile256(R, a, r0, q, d, m, y);
}

static AVX2 INLINE void q8_pass256(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                   const float *d, float *y) {
    if (R == 1) q8_row256(a, r0, q, d, y);
    else q8_tile256(R, a, r0, q, d, y);
}

/* ---- every row of output tiles [t0, t1) --------------------------------------------------- */

/* each kernel call takes a group of rows: ROWS512_Q4 or ROWS512 (AVX-512, its 32 registers
 * holding the accumulators and the unpacked weights) or ROWS256 (AVX2: a half-tile's 4
 * accumulators of its 16), the last group what is left */
#define ROW_GROUPS(STEP, CASES)                                                     \
    for (int64_t r = 0; r < a->rows; r += STEP) {                                  \
        int64_t left = a->rows - r;                                                \
        switch (left >= STEP ? STEP : left) { CASES }                              \
    }
/* the same in groups as even as the passes allow (9 rows: 3 + 3 + 3, not 4 + 4 + 1), for AVX2,
 * where a pass of one row waits on its accumulators' chain of multiply-adds */
#define ROW_GROUPS_EVEN(STEP, CASES)                                                \
    for (int64_t r = 0, passes = (a->rows + STEP - 1) / STEP, size; passes > 0;      \
         r += size, passes--) {                                                    \
        size = (a->rows - r + passes - 1) / passes;                                \
        switch (size) { CASES }                                                    \
    }
#define ROW_CASE(T, R, ...) case R: T(R, a, r, __VA_ARGS__); break;
#define ROW_CASES_UP_TO_4(T, ...)                                                  \
    ROW_CASE(T, 4, __VA_ARGS__) ROW_CASE(T, 3, __VA_ARGS__) ROW_CASE(T, 2, __VA_ARGS__) \
    default: T(1, a, r, __VA_ARGS__); break;
#define ROW_CASES_UP_TO_12(T, ...)                                                 \
    ROW_CASE(T, 12, __VA_ARGS__) ROW_CASE(T, 11, __VA_ARGS__) ROW_CASE(T, 10, __VA_ARGS__) \
    ROW_CASE(T, 9, __VA_ARGS__) ROW_CASE(T, 8, __VA_ARGS__) ROW_CASE(T, 7, __VA_ARGS__)    \
    ROW_CASE(T, 6, __VA_ARGS__) ROW_CASE(T, 5, __VA_ARGS__) ROW_CASES_UP_TO_4(T, __VA_ARGS__)
#define ROW_CASES_4(T, ...) ROW_GROUPS_EVEN(ROWS256, ROW_CASES_UP_TO_4(T, __VA_ARGS__))
#define ROW_CASES_12(T, ...) ROW_GROUPS(ROWS512_Q4, ROW_CASES_UP_TO_12(T, __VA_ARGS__))
#define ROW_CASES_UP_TO_16(T, ...)                                                 \
    ROW_CASE(T, 16, __VA_ARGS__) ROW_CASE(T, 15, __VA_ARGS__) ROW_CASE(T, 14, __VA_ARGS__) \
    ROW_CASE(T, 13, __VA_ARGS__) ROW_CASES_UP_TO_12(T, __VA_ARGS__)
#define ROW_CASES_16(T, ...) ROW_GROUPS(ROWS512, ROW_CASES_UP_TO_16(T, __VA_ARGS__))

static AVX512 void q4_tiles512(const Activations *a, const uint8_t *q, const uint16_t *d,
                               const uint16_t *m, float *y, int64_t t0, int64_t t1) {
    int64_t nb = a->k / QK;
    for (int64_t t = t0; t < t1; t++)
        ROW_CASES_12(q4_tile512, q + t * nb * 256, d + t * nb * TILE, m + t * nb * TILE, y + t * TILE)
}

static AVX2 void q4_tiles256(const Activations *a, const uint8_t *q, const uint16_t *d,
                             const uint16_t *m, float *y, int64_t t0, int64_t t1) {
    int64_t nb = a->k / QK;
    for (int64_t t = t0; t < t1; t++)
        ROW_CASES_4(q4_pass256, q + t * nb * 256, d + t * nb * TILE, m + t * nb * TILE, y + t * TILE)
}

static AVX512 void q8_tiles512(const Activations *a, const uint8_t *q, const float *d, float *y,
                               int64_t t0, int64_t t1) {
    int64_t nb = a->k / QK;
    for (int64_t t = t0; t < t1; t++)
        ROW_CASES_16(q8_tile512, q + t * nb * 512, d + t * nb * TILE, y + t * TILE)
}

static AVX2 void q8_tiles256(const Activations *a, const uint8_t *q, const float *d, float *y,
                             int64_t t0, int64_t t1) {
    int64_t nb = a->k / QK;
    for (int64_t t = t0; t < t1; t++)
        ROW_CASES_4(q8_pass256, q + t * nb * 512, d + t * nb * TILE, y + t * TILE)
}

/* MatMulNBits' 8-bit B [n, k / 32, 32] and scales [n * k / 32] -> the Q8 tiles */
static void q8_repack(const uint8_t *b, const float *scales, int64_t n, int64_t k, uint8_t *q,
                      float *d) {
    int64_t nb = k / QK;
    for (int64_t t = 0; t < n / TILE; t++)
        for (int64_t blk = 0; blk < nb; blk++) {
            uint8_t *dst = q + (t * nb + blk) * 512;
            for (int g = 0; g < 8; g++)
                for (int c = 0; c < TILE; c++)
                    memcpy(dst + g * 64 + c * 4, b + ((t * TILE + c) * nb + blk) * QK + g * 4, 4);
            for (int c = 0; c < TILE; c++)
                d[(t * nb + blk) * TILE + c] = scales[(t * TILE + c) * nb + blk];
        }
}

static int detect_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512f"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}
