/* CacheAttention's arithmetic (_q4kernel.c includes this file once, after q4_simd.h; the
 * loops over the cache are in attention_kv.h, included here once a type of cache element).
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
 * polynomial after the usual 2^n split (relative error about 2e-7).
 *
 * The cache holds float32 or float16 keys and values; a float16 element is widened to float32
 * as it is loaded (F16C), and everything after that is the float32 arithmetic. */
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

/* the sums of four vectors' lanes, [sum a0, ..., sum a3]: within each 128-bit half the pairs,
 * then the pairs of pairs, and last the two halves */
static INLINE AVX2 __m128 sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#define ROWS_AHEAD 16 /* cache rows asked for ahead of the one being read */

#define KV_T float
#define KV_NAME(name) name##_f32
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_SCALAR(p) (*(p))
#include "attention_kv.h"
#undef KV_T
#undef KV_NAME
#undef KV_LOAD8
#undef KV_SCALAR

#define KV_T uint16_t
#define KV_NAME(name) name##_f16
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_SCALAR(p) _cvtsh_ss(*(p))
#include "attention_kv.h"
#undef KV_T
#undef KV_NAME
#undef KV_LOAD8
#undef KV_SCALAR
