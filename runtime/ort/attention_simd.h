/* CacheAttention's arithmetic (_q4kernel.c includes this file once, after q4_simd.h).
 *
 * One query row attends over the keys and values of its own row of the cache, slots lo..p (p its
 * position; lo = p - window + 1 with a sliding window, else 0):
 *
 *   score_j = scale * <q, k_j>   (then softcap * tanh(score_j / softcap) where softcap > 0)
 *   y = sum_j (e_j / sum_i e_i) v_j,   e_j = exp(score_j - max_i score_i)
 *
 * in float32, every sum in a fixed order that depends on p, the window and the head size only. So a query's
 * output is the same bit for bit whatever else the call holds (rows, S, other positions), and the
 * same on AVX-512 and AVX2 machines: the code is AVX2 and FMA throughout. exp is a degree-6
 * polynomial after the usual 2^n split (relative error about 2e-7). */
#include <math.h>

static INLINE AVX2 __m256 exp256(__m256 x) {
    /* x <= 0 here (scores less their maximum); below -87 the result is 0 */
    const __m256 low = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln 2, high part */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);      /* ... and the rest */
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static INLINE AVX2 float sum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* the sums of eight vectors' lanes, [sum a0, ..., sum a7] */
static INLINE AVX2 __m256 sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                                __m256 a6, __m256 a7) {
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* e_g [n rounded up to 8] = scale * <q_g, k_j> for the group's G queries (q [G, hd], e_g at
 * e + g * stride) and the n keys from k: eight keys at a time, each block read once for the whole
 * group, with eight independent sums a query (the last block repeats the last key, so every
 * key's score is summed alike); a head size past a multiple of 8 adds its tail per key in order */
static AVX2 void scores(const float *q, int64_t group, const float *k, int64_t hd, int64_t n,
                        float scale, float *e, int64_t stride) {
    int64_t wide = hd & ~(int64_t)7;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const float *r[8];
        for (int u = 0; u < 8; u++) r[u] = k + (j0 + u < n ? j0 + u : n - 1) * hd;
        for (int64_t g = 0; g < group; g++) {
            const float *x = q + g * hd;
            float *out = e + g * stride + j0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
                   a7 = a0;
            for (int64_t d = 0; d < wide; d += 8) {
                __m256 xd = _mm256_loadu_ps(x + d);
                a0 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[0] + d), a0);
                a1 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[1] + d), a1);
                a2 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[2] + d), a2);
                a3 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[3] + d), a3);
                a4 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[4] + d), a4);
                a5 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[5] + d), a5);
                a6 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[6] + d), a6);
                a7 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r[7] + d), a7);
            }
            _mm256_storeu_ps(out, sums8(a0, a1, a2, a3, a4, a5, a6, a7));
            for (int u = 0; u < 8; u++) {
                float t = out[u];
                for (int64_t d = wide; d < hd; d++) t += x[d] * r[u][d];
                out[u] = scale * t;
            }
        }
    }
}

#define VALUE_BLOCK 32 /* value rows a block, read once for the whole group */

/* y_g [hd] = sum_j e_g[j] v_j over the n value rows from v (y [G, hd], e_g at e + g * stride),
 * each output summed in row order: where hd is a multiple of 64, 64 outputs of a query at a time
 * in registers, a block of rows after another; else through y */
static AVX2 void weighted_values(const float *e, int64_t stride, int64_t group, const float *v,
                                 int64_t hd, int64_t n, float *y) {
    for (int64_t i = 0; i < group * hd; i++) y[i] = 0.f;
    if (hd % 64 == 0) {
        for (int64_t d = 0; d < hd; d += 64)
            for (int64_t j0 = 0; j0 < n; j0 += VALUE_BLOCK) {
                int64_t j1 = j0 + VALUE_BLOCK < n ? j0 + VALUE_BLOCK : n;
                for (int64_t g = 0; g < group; g++) {
                    float *out = y + g * hd + d;
                    const float *w = e + g * stride;
                    __m256 a0 = _mm256_loadu_ps(out), a1 = _mm256_loadu_ps(out + 8);
                    __m256 a2 = _mm256_loadu_ps(out + 16), a3 = _mm256_loadu_ps(out + 24);
                    __m256 a4 = _mm256_loadu_ps(out + 32), a5 = _mm256_loadu_ps(out + 40);
                    __m256 a6 = _mm256_loadu_ps(out + 48), a7 = _mm256_loadu_ps(out + 56);
                    for (int64_t j = j0; j < j1; j++) {
                        const float *r = v + j * hd + d;
                        __m256 wj = _mm256_set1_ps(w[j]);
                        a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r), a0);
                        a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 8), a1);
                        a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 16), a2);
                        a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 24), a3);
                        a4 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 32), a4);
                        a5 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 40), a5);
                        a6 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 48), a6);
                        a7 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 56), a7);
                    }
                    _mm256_storeu_ps(out, a0);
                    _mm256_storeu_ps(out + 8, a1);
                    _mm256_storeu_ps(out + 16, a2);
                    _mm256_storeu_ps(out + 24, a3);
                    _mm256_storeu_ps(out + 32, a4);
                    _mm256_storeu_ps(out + 40, a5);
                    _mm256_storeu_ps(out + 48, a6);
                    _mm256_storeu_ps(out + 56, a7);
                }
            }
        return;
    }
    int64_t wide = hd & ~(int64_t)7;
    for (int64_t g = 0; g < group; g++) {
        float *out = y + g * hd;
        const float *w = e + g * stride;
        for (int64_t j = 0; j < n; j++) {
            const float *r = v + j * hd;
            __m256 wj = _mm256_set1_ps(w[j]);
            for (int64_t d = 0; d < wide; d += 8)
                _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + d), _mm256_loadu_ps(out + d)));
            for (int64_t d = wide; d < hd; d++) out[d] += w[j] * r[d];
        }
    }
}

/* y [G, hd] = the attention of a group's queries q [G, hd] over keys k and values v [slots, hd]
 * (their KV head's rows of one cache row), slots lo..hi inclusive; e: scratch of
 * G * (hi - lo + 8) floats */
static AVX2 void attend(const float *q, int64_t group, const float *k, const float *v, int64_t hd,
                        int64_t lo, int64_t hi, float scale, float softcap, float *e, float *y) {
    int64_t n = hi - lo + 1, padded = (n + 7) & ~(int64_t)7;
    scores(q, group, k + lo * hd, hd, n, scale, e, padded);
    for (int64_t g = 0; g < group; g++) {
        float *eg = e + g * padded, top = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            if (softcap > 0) eg[j] = softcap * tanhf(eg[j] / softcap);
            top = eg[j] > top ? eg[j] : top;
        }
        __m256 mx = _mm256_set1_ps(top), total = _mm256_setzero_ps();
        for (int64_t j = n; j < padded; j++) eg[j] = -INFINITY;  /* exp -> 0 */
        for (int64_t j = 0; j < padded; j += 8) {
            __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(eg + j), mx));
            _mm256_storeu_ps(eg + j, x);
            total = _mm256_add_ps(total, x);
        }
        float inv = 1.0f / sum256(total);  /* folded into the weights: y = sum_j (e_j / sum) v_j */
        __m256 iv = _mm256_set1_ps(inv);
        for (int64_t j = 0; j < padded; j += 8)
            _mm256_storeu_ps(eg + j, _mm256_mul_ps(_mm256_loadu_ps(eg + j), iv));
    }
    weighted_values(e, padded, group, v + lo * hd, hd, n, y);
}
