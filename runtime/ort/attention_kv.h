/* The loops of CacheAttention over one cache row, for one type of cache element (attention_simd.h
 * includes this file once a type, with KV_T the element, KV_NAME(f) the name of f for it,
 * KV_LOAD8(p) the 8 floats at p and KV_SCALAR(p) the float at p). */

/* row j of rows [n, hd] into the cache, where j < n (the keys or values a loop reads soon) */
static INLINE AVX2 void KV_NAME(prefetch_row)(const KV_T *rows, int64_t j, int64_t n, int64_t hd) {
    if (j >= n) return;
    const char *p = (const char *)(rows + j * hd);
    for (int64_t b = 0; b < hd * (int64_t)sizeof(KV_T); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* e_g [j0 .. j0 + 3] for G (1 to 3) queries from q (q_g at q + g * hd) and four keys r[0..3]:
 * every key loaded once for the G queries, one sum of eight lanes a query and key; a head size
 * past a multiple of 8 adds its tail per key in order before the scale */
static INLINE AVX2 void KV_NAME(scores_block)(int G, const float *q, const KV_T *const *r, int64_t hd,
                                     float scale, float *e, int64_t stride) {
    int64_t wide = hd & ~(int64_t)7;
    __m256 a[3][4];
    for (int g = 0; g < G; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < wide; d += 8) {
        __m256 x[3];
        for (int g = 0; g < G; g++) x[g] = _mm256_loadu_ps(q + g * hd + d);
        for (int u = 0; u < 4; u++) {
            __m256 kd = KV_LOAD8(r[u] + d);
            for (int g = 0; g < G; g++) a[g][u] = _mm256_fmadd_ps(x[g], kd, a[g][u]);
        }
    }
    for (int g = 0; g < G; g++) {
        __m128 s = sums4(a[g][0], a[g][1], a[g][2], a[g][3]);
        float *out = e + g * stride;
        if (wide == hd) {
            _mm_storeu_ps(out, _mm_mul_ps(_mm_set1_ps(scale), s));
            continue;
        }
        _mm_storeu_ps(out, s);
        for (int u = 0; u < 4; u++) {
            float t = out[u];
            for (int64_t d = wide; d < hd; d++) t += q[g * hd + d] * KV_SCALAR(r[u] + d);
            out[u] = scale * t;
        }
    }
}

/* e_g [n rounded up to 8] = scale * <q_g, k_j> for the group's G queries (q [G, hd], e_g at
 * e + g * stride) and the n keys from k: four keys at a time for three queries at a time (the
 * last block repeats the last key, and the padding up to 8 gets the last key's score too) */
static INLINE AVX2 void KV_NAME(scores)(const float *q, int64_t group, const KV_T *k, int64_t hd, int64_t n,
                        float scale, float *e, int64_t stride) {
    int64_t padded = (n + 7) & ~(int64_t)7;
    for (int64_t j0 = 0; j0 < padded; j0 += 4) {
        const KV_T *r[4];
        for (int u = 0; u < 4; u++) r[u] = k + (j0 + u < n ? j0 + u : n - 1) * hd;
        for (int u = 0; u < 4; u++) KV_NAME(prefetch_row)(k, j0 + ROWS_AHEAD + u, n, hd);
        for (int64_t g = 0; g < group; g += 3) {
            int64_t left = group - g;
            const float *qg = q + g * hd;
            float *eg = e + g * stride + j0;
            if (left >= 3) KV_NAME(scores_block)(3, qg, r, hd, scale, eg, stride);
            else if (left == 2) KV_NAME(scores_block)(2, qg, r, hd, scale, eg, stride);
            else KV_NAME(scores_block)(1, qg, r, hd, scale, eg, stride);
        }
    }
}

#define VALUE_BLOCK 32 /* value rows a block, read once for the whole group */

/* y_g [d .. d + 31] += sum_j e_g[j] v_j[d .. d + 31] over rows j0 .. j1 - 1, for G (1 to 3)
 * queries: each 8 values of a row loaded once for the G queries, every output summed in row
 * order */
static INLINE AVX2 void KV_NAME(values_block)(int G, const float *e, int64_t stride, const KV_T *v,
                                     int64_t hd, int64_t j0, int64_t j1, float *y, int64_t ahead) {
    __m256 a[3][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) a[g][c] = _mm256_loadu_ps(y + g * hd + 8 * c);
    for (int64_t j = j0; j < j1; j++) {
        KV_NAME(prefetch_row)(v, j + ROWS_AHEAD, ahead, hd);  /* ahead: the rows to ask for (0: none) */
        __m256 w[3];
        for (int g = 0; g < G; g++) w[g] = _mm256_set1_ps(e[g * stride + j]);
        const KV_T *r = v + j * hd;
        for (int c = 0; c < 4; c++) {
            __m256 vc = KV_LOAD8(r + 8 * c);
            for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(w[g], vc, a[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(y + g * hd + 8 * c, a[g][c]);
}

/* y_g [hd] = sum_j e_g[j] v_j over the n value rows from v (y [G, hd], e_g at e + g * stride),
 * each output summed in row order: where hd is a multiple of 32, a block of rows after another,
 * and in each, 32 outputs of up to three queries at a time in registers; else through y */
static INLINE AVX2 void KV_NAME(weighted_values)(const float *e, int64_t stride, int64_t group, const KV_T *v,
                                 int64_t hd, int64_t n, float *y) {
    for (int64_t i = 0; i < group * hd; i++) y[i] = 0.f;
    if (hd % 32 == 0) {
        for (int64_t j0 = 0; j0 < n; j0 += VALUE_BLOCK)  /* a block's rows, all outputs */
            for (int64_t d = 0; d < hd; d += 32) {
                int64_t j1 = j0 + VALUE_BLOCK < n ? j0 + VALUE_BLOCK : n;
                for (int64_t g = 0; g < group; g += 3) {
                    int64_t left = group - g;
                    const float *eg = e + g * stride;
                    float *yg = y + g * hd + d;
                    /* the first pass over a block asks for the rows ahead, whole */
                    int64_t ahead = d == 0 && g == 0 ? n : 0;
                    if (left >= 3) KV_NAME(values_block)(3, eg, stride, v + d, hd, j0, j1, yg, ahead);
                    else if (left == 2) KV_NAME(values_block)(2, eg, stride, v + d, hd, j0, j1, yg, ahead);
                    else KV_NAME(values_block)(1, eg, stride, v + d, hd, j0, j1, yg, ahead);
                }
            }
        return;
    }
    int64_t wide = hd & ~(int64_t)7;
    for (int64_t g = 0; g < group; g++) {
        float *out = y + g * hd;
        const float *w = e + g * stride;
        for (int64_t j = 0; j < n; j++) {
            const KV_T *r = v + j * hd;
            __m256 wj = _mm256_set1_ps(w[j]);
            for (int64_t d = 0; d < wide; d += 8)
                _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wj, KV_LOAD8(r + d), _mm256_loadu_ps(out + d)));
            for (int64_t d = wide; d < hd; d++) out[d] += w[j] * KV_SCALAR(r + d);
        }
    }
}

/* y [G, hd] = the attention of a group's queries q [G, hd] over keys k and values v [slots, hd]
 * (their KV head's rows of one cache row), slots lo..hi inclusive; e: scratch of
 * G * (hi - lo + 8) floats. `attend` below runs it. */
static INLINE AVX2 void KV_NAME(attend_body)(const float *q, int64_t group, const KV_T *k, const KV_T *v, int64_t hd,
                        int64_t lo, int64_t hi, float scale, float softcap, float *e, float *y) {
    int64_t n = hi - lo + 1, padded = (n + 7) & ~(int64_t)7;
    KV_NAME(scores)(q, group, k + lo * hd, hd, n, scale, e, padded);
    for (int64_t g = 0; g < group; g++) {
        float *eg = e + g * padded;
        if (softcap > 0)
            for (int64_t j = 0; j < n; j++) eg[j] = softcap * tanhf(eg[j] / softcap);
        for (int64_t j = n; j < padded; j++) eg[j] = -INFINITY;  /* exp -> 0 */
        __m256 top = _mm256_loadu_ps(eg);  /* the largest score: a maximum is exact in any order */
        for (int64_t j = 8; j < padded; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(eg + j));
        __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
        t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
        __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(t4)), total = _mm256_setzero_ps();
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
    KV_NAME(weighted_values)(e, padded, group, v + lo * hd, hd, n, y);
}

/* attend_body compiled apart for common head sizes and query groups (SmolLM2's 64 and 3,
 * Llama 3.2 1B's 64 and 4, Llama 3 8B's 128 and 4), and for the head sizes alone: the loops
 * over a head and a group then have fixed bounds (an attention over 256 positions about 0.83x
 * the time at 8 rows). The same operations run in the same order, so the same bits. */
#undef ATTEND_FIXED
#define ATTEND_FIXED(name, HD, G)                                                             \
    static AVX2 void KV_NAME(name)(const float *q, int64_t group, const KV_T *k, const KV_T *v, \
                          int64_t lo, int64_t hi, float scale, float softcap, float *e,         \
                          float *y) {                                                           \
        KV_NAME(attend_body)(q, (G) ? (G) : group, k, v, HD, lo, hi, scale, softcap, e, y);     \
    }
ATTEND_FIXED(attend_64_3, 64, 3)
ATTEND_FIXED(attend_64_4, 64, 4)
ATTEND_FIXED(attend_128_4, 128, 4)
ATTEND_FIXED(attend_64, 64, 0)
ATTEND_FIXED(attend_128, 128, 0)

static AVX2 void KV_NAME(attend)(const float *q, int64_t group, const KV_T *k, const KV_T *v, int64_t hd,
                        int64_t lo, int64_t hi, float scale, float softcap, float *e, float *y) {
    if (hd == 64 && group == 3) KV_NAME(attend_64_3)(q, group, k, v, lo, hi, scale, softcap, e, y);
    else if (hd == 64 && group == 4) KV_NAME(attend_64_4)(q, group, k, v, lo, hi, scale, softcap, e, y);
    else if (hd == 128 && group == 4) KV_NAME(attend_128_4)(q, group, k, v, lo, hi, scale, softcap, e, y);
    else if (hd == 64) KV_NAME(attend_64)(q, group, k, v, lo, hi, scale, softcap, e, y);
    else if (hd == 128) KV_NAME(attend_128)(q, group, k, v, lo, hi, scale, softcap, e, y);
    else KV_NAME(attend_body)(q, group, k, v, hd, lo, hi, scale, softcap, e, y);
}
