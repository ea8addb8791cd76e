/* ortspec's onnxruntime custom ops (domain "ortspec"), for the int4 exports' products:
 *
 *   Q4Gemm(x, q, d, m) -> y   y = x @ w.T, w [N, K] as Q4_1 blocks of 32 (w = d * q + m, q in
 *                             0..15, d and m float16), in Q4 tiles (q4_simd.h; export/quantize.py
 *                             `quantize_q4gemm` writes them): the GGUF's own blocks.
 *   Q4GemmSwiGlu(x, q, d, m) -> y
 *                             the gated MLP's first half: Q4Gemm of a weight whose N rows are
 *                             the gate's then the up projection's, and y [..., N / 2] =
 *                             silu(gate) * up, in one node.
 *   Q4GemmNorm(x, q, d, m, skip, gamma) -> y, sum
 *   Q4GemmSwiGluNorm(x, q, d, m, skip, gamma) -> y, sum
 *                             Q4Gemm and Q4GemmSwiGlu of RMSNorm(x + skip) * gamma (attribute
 *                             epsilon), sum = x + skip: onnxruntime's
 *                             SkipSimplifiedLayerNormalization before the product, in the node.
 *   Q8Gemm(x, b, scales) -> y w as MatMulNBits stores 8-bit symmetric blocks of 32
 *                             (b uint8 [N, K / 32, 32] = q + 128, scales float [N * K / 32]): the
 *                             LM head, whose bytes a tied embedding's GatherBlockQuantized also
 *                             reads. The op regroups them into Q8 tiles when its kernel is made.
 *
 *   CacheAttention(q, key, value, positions, token_rows) -> y
 *                             the attention of the queries token_rows names over their own
 *                             rows of the KV cache, read in place (attention_simd.h).
 *   RotaryCacheAttention(qkv, key, value, positions, token_rows, cos, sin) -> y, key, value
 *                             the same from packed q, k and v, with the rotary embedding and
 *                             the cache writes inside (no split, transpose or scatter nodes).
 *
 * Q4Gemm and Q8Gemm: attributes K and N; x float [..., K], y float [..., N]. x is rounded to int8 per row and block
 * of 32, as MatMulNBits does at accuracy level 4; each block's integer dot product is exact and
 * each output is summed in the same order whatever the row count, so a row of a many-row call is
 * the lone row bit for bit. A tile's weights, unpacked once, serve up to 12 rows (16 for 8-bit
 * weights; AVX-512 VNNI) or 4 (AVX2): what makes an extra row of a verify or a batch cheap.
 *
 * The onnxruntime C API is reached through the function table OrtGetApiBase hands the library;
 * the slot numbers below are that table's stable, append-only ABI, so no onnxruntime header is
 * needed. Python: runtime/ort/kernels.py. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define ORTSPEC_X86 1
#include "q4_simd.h"
#include "attention_simd.h"
#else
#define QK 32
#define TILE 16
static int detect_isa(void) { return 0; }
#endif

#include "ort_abi.h"

/* fn(data, i) for every i < total: over onnxruntime's intra-op pool through the kernel context,
 * else on this thread (context NULL: the tests' entry points) */
static void parallel(void *context, void (*fn)(void *, size_t), size_t total, void *data) {
    if (context && total > 1 &&
        !failed(FN(API_KernelContext_ParallelFor, parallel_for_t)(context, fn, total, 0, data)))
        return;  /* (where the pool failed, every task runs again here) */
    for (size_t i = 0; i < total; i++) fn(data, i);
}

static int isa = -1, forced_isa = -1;

/* 2: AVX-512 VNNI, 1: AVX2 and FMA, 0: no kernel for this CPU */
int ortspec_q4_isa(void) {
    if (isa < 0) isa = detect_isa();
    return forced_isa >= 0 && forced_isa < isa ? forced_isa : isa;
}

/* tests: run the AVX2 kernels on an AVX-512 machine (1), or the best again (-1) */
void ortspec_q4_force_isa(int level) { forced_isa = level; }

/* ---- products ------------------------------------------------------------------------------ */

enum { OP_Q4 = 0, OP_Q8 = 1 };

typedef struct {  /* what a kernel multiplies by */
    int op;
    int64_t k, n;
    const uint8_t *q;     /* Q4: the input tensor; Q8: owned, regrouped */
    const void *d, *m;    /* Q4: float16 inputs; Q8: owned float d, m unused */
} Weight;

#ifdef ORTSPEC_X86
static void run_tiles(const Weight *w, const Activations *a, float *y, int64_t t0, int64_t t1) {
    int wide = ortspec_q4_isa() == 2;
    if (w->op == OP_Q4) {
        if (wide) q4_tiles512(a, w->q, w->d, w->m, y, t0, t1);
        else q4_tiles256(a, w->q, w->d, w->m, y, t0, t1);
    } else {
        if (wide) q8_tiles512(a, w->q, w->d, y, t0, t1);
        else q8_tiles256(a, w->q, w->d, y, t0, t1);
    }
}
#endif

typedef struct {
    const Weight *w;
    const Activations *a;
    float *y;
    int64_t tiles, chunks;
} Work;

static void work_chunk(void *data, size_t i) {
#ifdef ORTSPEC_X86
    Work *job = data;
    int64_t t0 = job->tiles * (int64_t)i / job->chunks;
    int64_t t1 = job->tiles * (int64_t)(i + 1) / job->chunks;
    run_tiles(job->w, job->a, job->y, t0, t1);
#else
    (void)data; (void)i;
#endif
}

/* per-thread scratch for the quantized activations (a session may run on several threads) */
static __thread unsigned char *scratch;
static __thread size_t scratch_size;

/* y [rows, n] = x [rows, k] times the weight; context: onnxruntime's kernel context, whose
 * thread pool takes the output tiles (NULL: this thread alone). -1 where memory ran out. */
static int product(const Weight *w, const float *x, int64_t rows, float *y, void *context) {
#ifdef ORTSPEC_X86
    int64_t nb = w->k / QK, stride = w->k + QX_PAD;
    size_t need = (size_t)(rows * stride) + 4 * sizeof(float) * (size_t)(rows * nb) + 64;
    if (need > scratch_size) {
        free(scratch);
        scratch = malloc(need);
        scratch_size = scratch ? need : 0;
        if (!scratch) return -1;
    }
    int8_t *qx = (int8_t *)scratch;
    float *sx = (float *)(scratch + ((rows * stride + 15) & ~(int64_t)15));
    float *bx = sx + rows * nb;
    int32_t *ix = (int32_t *)(bx + rows * nb);
    float *qs = (float *)(ix + rows * nb);
    quantize_rows(x, rows, w->k, stride, qx, sx, bx, ix, qs);
    Activations a = {rows, w->k, w->n, stride, qx, sx, bx, ix, qs};
    int64_t tiles = w->n / TILE;
    /* chunks enough for the pool to balance, each of whole tiles */
    Work job = {w, &a, y, tiles, tiles < 16 ? tiles : 16};
    parallel(context, work_chunk, (size_t)job.chunks, &job);
    return 0;
#else
    (void)w; (void)x; (void)rows; (void)y; (void)context;
    return -1;
#endif
}

static int swiglu_product(const Weight *w, const float *x, int64_t rows, float *y,
                          void *context);

/* The tests' entry points: the whole product (Q4Gemm's, or Q4GemmSwiGlu's with `swiglu`) on the
 * calling thread. */
static int q4_entry(const float *x, int64_t rows, int64_t k, int64_t n, const uint8_t *q,
                    const uint16_t *d, const uint16_t *m, float *y, int swiglu) {
    if (ortspec_q4_isa() == 0 || k % QK || n % TILE) return -1;
    Weight w = {OP_Q4, k, n, q, d, m};
    return swiglu ? swiglu_product(&w, x, rows, y, NULL) : product(&w, x, rows, y, NULL);
}

int ortspec_q4_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const uint8_t *q,
                    const uint16_t *d, const uint16_t *m, float *y) {
    return q4_entry(x, rows, k, n, q, d, m, y, 0);
}

int ortspec_q4_swiglu(const float *x, int64_t rows, int64_t k, int64_t n, const uint8_t *q,
                      const uint16_t *d, const uint16_t *m, float *y) {
    return q4_entry(x, rows, k, n, q, d, m, y, 1);
}

int ortspec_q8_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const uint8_t *b,
                    const float *scales, float *y) {
#ifdef ORTSPEC_X86
    if (ortspec_q4_isa() == 0 || k % QK || n % TILE) return -1;
    uint8_t *q = malloc((size_t)(n * k));
    float *d = malloc(sizeof(float) * (size_t)(n * (k / QK)));
    int status = -2;
    if (q && d) {
        q8_repack(b, scales, n, k, q, d);
        Weight w = {OP_Q8, k, n, q, d, NULL};
        status = product(&w, x, rows, y, NULL);
    }
    free(q);
    free(d);
    return status;
#else
    (void)x; (void)rows; (void)k; (void)n; (void)b; (void)scales; (void)y;
    return -1;
#endif
}

/* ---- the custom ops -------------------------------------------------------------------------- */

typedef struct {
    Weight w;
    uint8_t *owned_q;  /* Q8: the regrouped weight and scales, freed with the kernel */
    float *owned_d;
    int swiglu;  /* Q4GemmSwiGlu: y = silu(first half of the product) * its second half */
    int norm;    /* ...Norm: the product of RMSNorm(x + skip) * gamma, and x + skip out */
    float eps;
} Kernel;

static int grown(float **buf, size_t *size, size_t need);

#ifdef ORTSPEC_X86
/* y [rows, n / 2] = silu(g) * u, g and u the halves of each row of x [rows, n] (n / 2 a
 * multiple of 8): silu(a) = a * sigmoid(a), sigmoid from exp(-|a|) (attention_simd.h's exp,
 * relative error about 2e-7), so no exponent overflows. Element by element: a row's output
 * is the same whatever else the call holds. */
static AVX2 void swiglu_rows(const float *x, int64_t rows, int64_t n, float *y) {
    int64_t half = n / 2;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * n, *u = g + half;
        float *out = y + r * half;
        for (int64_t j = 0; j < half; j += 8) {
            __m256 a = _mm256_loadu_ps(g + j);
            __m256 e = exp256(_mm256_or_ps(a, sign));  /* exp(-|a|) */
            __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));  /* sigmoid(|a|) */
            __m256 sig = _mm256_blendv_ps(pos, _mm256_mul_ps(e, pos),  /* a < 0: 1 - that */
                                          _mm256_cmp_ps(a, zero, _CMP_LT_OQ));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(a, sig),
                                                    _mm256_loadu_ps(u + j)));
        }
    }
}
#endif

static __thread float *glu_scratch;  /* Q4GemmSwiGlu: the product before the gating */
static __thread size_t glu_scratch_size;

/* y [rows, n / 2] = the gated halves of x [rows, k] times the weight; -1 where memory ran out */
static int swiglu_product(const Weight *w, const float *x, int64_t rows, float *y,
                          void *context) {
#ifdef ORTSPEC_X86
    if (!grown(&glu_scratch, &glu_scratch_size, sizeof(float) * (size_t)(rows * w->n)) ||
        product(w, x, rows, glu_scratch, context) != 0)
        return -1;
    swiglu_rows(glu_scratch, rows, w->n, y);
    return 0;
#else
    (void)w; (void)x; (void)rows; (void)y; (void)context;
    return -1;
#endif
}

#ifdef ORTSPEC_X86
/* sum [rows, k] = x + skip and h [rows, k] = sum * (1 / sqrt(mean(sum^2) + eps)) * gamma, k a
 * multiple of 32: each row's squares summed in 32 lanes and then in a fixed order, so a row's
 * result is the same whatever else the call holds */
static AVX2 void norm_rows(const float *x, const float *skip, const float *gamma, int64_t rows,
                           int64_t k, float eps, float *sum, float *h) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * k, *b = skip + r * k;
        float *t = sum + r * k, *out = h + r * k;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t j = 0; j < k; j += 32) {
            __m256 t0 = _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j));
            __m256 t1 = _mm256_add_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8));
            __m256 t2 = _mm256_add_ps(_mm256_loadu_ps(a + j + 16), _mm256_loadu_ps(b + j + 16));
            __m256 t3 = _mm256_add_ps(_mm256_loadu_ps(a + j + 24), _mm256_loadu_ps(b + j + 24));
            _mm256_storeu_ps(t + j, t0);
            _mm256_storeu_ps(t + j + 8, t1);
            _mm256_storeu_ps(t + j + 16, t2);
            _mm256_storeu_ps(t + j + 24, t3);
            s0 = _mm256_fmadd_ps(t0, t0, s0);
            s1 = _mm256_fmadd_ps(t1, t1, s1);
            s2 = _mm256_fmadd_ps(t2, t2, s2);
            s3 = _mm256_fmadd_ps(t3, t3, s3);
        }
        float total = sum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(total / (float)k + eps));
        for (int64_t j = 0; j < k; j += 8)
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(t + j), inv),
                                                    _mm256_loadu_ps(gamma + j)));
    }
}
#endif

static __thread float *norm_scratch;  /* ...Norm: the normalized rows */
static __thread size_t norm_scratch_size;

/* ...Norm: x + skip into output 1 and the normalized rows into scratch, which the product then
 * reads in x's place; NULL where an input does not fit x (no output: onnxruntime reports it) */
static const float *normalized(const Kernel *kern, void *context, const float *x,
                               const int64_t *dims, size_t rank, int64_t rows) {
#ifdef ORTSPEC_X86
    int64_t sd[8], gd[8];
    size_t sr = 0, gr = 0;
    const float *skip = input_of(context, 4, sd, &sr), *gamma = input_of(context, 5, gd, &gr);
    void *sum_value;
    if (!skip || !gamma || sr != rank || memcmp(sd, dims, sizeof(int64_t) * rank) || gr != 1 ||
        gd[0] != kern->w.k ||
        failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 1, dims, rank, &sum_value)))
        return NULL;
    float *sum = data_of(sum_value);
    if (!sum || !grown(&norm_scratch, &norm_scratch_size,
                       sizeof(float) * (size_t)(rows * kern->w.k)))
        return NULL;
    norm_rows(x, skip, gamma, rows, kern->w.k, kern->eps, sum, norm_scratch);
    return norm_scratch;
#else
    (void)kern; (void)context; (void)x; (void)dims; (void)rank; (void)rows;
    return NULL;
#endif
}

static void kernel_compute(void *state, void *context) {
    Kernel *kern = state;
    Weight w = kern->w;
    size_t rank = 0;
    int64_t dims[8];
    if (w.op == OP_Q4) {  /* the weight is the op's inputs 1-3, sized by the exporter */
        w.q = data_input(context, 1);
        w.d = data_input(context, 2);
        w.m = data_input(context, 3);
        if (!w.q || !w.d || !w.m) return;
    }
    const float *x = input_of(context, 0, dims, &rank);  /* NULL for an empty x */
    if (rank < 1 || dims[rank - 1] != w.k) return;  /* no output: onnxruntime reports the node */
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    if (kern->norm) {
        void *empty;  /* no rows: the sum is empty too */
        if (rows == 0 ? failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 1, dims,
                                                                           rank, &empty))
                      : !x || !(x = normalized(kern, context, x, dims, rank, rows)))
            return;
    }
    int64_t width = kern->swiglu ? w.n / 2 : w.n;
    dims[rank - 1] = width;
    void *y_value;
    if (failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 0, dims, rank, &y_value)))
        return;
    float *y = data_of(y_value);
    if (!y || rows == 0) return;
    int status = !x ? -1 : kern->swiglu ? swiglu_product(&w, x, rows, y, context)
                                        : product(&w, x, rows, y, context);
    if (status != 0)
        for (int64_t i = 0; i < rows * width; i++) y[i] = __builtin_nanf("");  /* never stale data */
}

static void destroy_kernel(void *state) {
    Kernel *kern = state;
    if (!kern) return;
    free(kern->owned_q);
    free(kern->owned_d);
    free(kern);
}

static void *create_kernel(int op, const void *info) {
    Kernel *kern = calloc(1, sizeof(Kernel));
    if (!kern) return NULL;
    kern->w.op = op;
    if (failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "K", &kern->w.k)) ||
        failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "N", &kern->w.n)) ||
        kern->w.k <= 0 || kern->w.n <= 0 || kern->w.k % QK || kern->w.n % TILE) {
        free(kern);
        return NULL;
    }
#ifdef ORTSPEC_X86
    if (op == OP_Q8) {  /* regroup the constant weight once, here */
        const void *b_value = NULL, *s_value = NULL;
        int b_const = 0, s_const = 0;
        if (failed(FN(API_KernelInfoGetConstantInput_tensor, constant_input_t)(info, 1, &b_const, &b_value)) ||
            failed(FN(API_KernelInfoGetConstantInput_tensor, constant_input_t)(info, 2, &s_const, &s_value)) ||
            !b_const || !s_const) {
            free(kern);
            return NULL;
        }
        const uint8_t *b = data_of(b_value);
        const float *scales = data_of(s_value);
        int64_t n = kern->w.n, k = kern->w.k;
        kern->owned_q = malloc((size_t)(n * k));
        kern->owned_d = malloc(sizeof(float) * (size_t)(n * (k / QK)));
        int zero = 0;  /* a byte 0 (q = -128) is out of the AVX2 kernel's range */
        for (int64_t i = 0; b && i < n * k && !zero; i++) zero = b[i] == 0;
        if (!b || !scales || !kern->owned_q || !kern->owned_d || zero) {
            destroy_kernel(kern);
            return NULL;
        }
        q8_repack(b, scales, n, k, kern->owned_q, kern->owned_d);
        kern->w.q = kern->owned_q;
        kern->w.d = kern->owned_d;
    }
#endif
    return kern;
}

static void *create_q4(const void *op, const void *unused, const void *info) {
    (void)op; (void)unused;
    return create_kernel(OP_Q4, info);
}

static void *create_q4_swiglu(const void *op, const void *unused, const void *info) {
    (void)op; (void)unused;
    Kernel *kern = create_kernel(OP_Q4, info);
    if (kern) kern->swiglu = 1;  /* N % TILE == 0: each half a multiple of 8 */
    return kern;
}

/* ...Norm: the attribute epsilon */
static Kernel *with_norm(Kernel *kern, const void *info) {
    if (kern && failed(FN(API_KernelInfoGetAttribute_float, attr_float_t)(info, "epsilon",
                                                                          &kern->eps))) {
        destroy_kernel(kern);
        return NULL;
    }
    if (kern) kern->norm = 1;
    return kern;
}

static void *create_q4_norm(const void *op, const void *unused, const void *info) {
    return with_norm(create_q4(op, unused, info), info);
}

static void *create_q4_swiglu_norm(const void *op, const void *unused, const void *info) {
    return with_norm(create_q4_swiglu(op, unused, info), info);
}

static void *create_q8(const void *op, const void *unused, const void *info) {
    (void)op; (void)unused;
    return create_kernel(OP_Q8, info);
}

static const char *q4_name(const void *op) { (void)op; return "Q4Gemm"; }
static const char *q4_swiglu_name(const void *op) { (void)op; return "Q4GemmSwiGlu"; }
static const char *q8_name(const void *op) { (void)op; return "Q8Gemm"; }
static const char *q4_norm_name(const void *op) { (void)op; return "Q4GemmNorm"; }
static const char *q4_swiglu_norm_name(const void *op) { (void)op; return "Q4GemmSwiGluNorm"; }
static int q4_input_type(const void *op, size_t i) {
    (void)op;
    return i == 0 ? ELEM_FLOAT : i == 1 ? ELEM_UINT8 : ELEM_FLOAT16;
}
static size_t q4_inputs(const void *op) { (void)op; return 4; }
static int q4_norm_input_type(const void *op, size_t i) {
    return i < 4 ? q4_input_type(op, i) : ELEM_FLOAT;
}
static size_t q4_norm_inputs(const void *op) { (void)op; return 6; }
static size_t two_outputs(const void *op) { (void)op; return 2; }
static int q8_input_type(const void *op, size_t i) { (void)op; return i == 1 ? ELEM_UINT8 : ELEM_FLOAT; }
static size_t q8_inputs(const void *op) { (void)op; return 3; }
static CustomOp q4_op = CUSTOM_OP(create_q4, q4_name, q4_input_type, q4_inputs, kernel_compute,
                                  destroy_kernel);
static CustomOp q4_swiglu_op = CUSTOM_OP(create_q4_swiglu, q4_swiglu_name, q4_input_type,
                                         q4_inputs, kernel_compute, destroy_kernel);
#define NORM_OP(create, name)                                                                 \
    {API_VERSION, create, name, cpu, q4_norm_input_type, q4_norm_inputs, output_type,           \
     two_outputs, kernel_compute, destroy_kernel, required, required, default_memory, one, one, \
     one, one, NULL, NULL, NULL, first_version, last_version, no_pairs, release_pairs,          \
     no_pairs, release_pairs, {0}}
static CustomOp q4_norm_op = NORM_OP(create_q4_norm, q4_norm_name);
static CustomOp q4_swiglu_norm_op = NORM_OP(create_q4_swiglu_norm, q4_swiglu_norm_name);
static CustomOp q8_op = CUSTOM_OP(create_q8, q8_name, q8_input_type, q8_inputs, kernel_compute,
                                  destroy_kernel);

/* ---- CacheAttention ------------------------------------------------------------------------ */

/* Inputs: q float [B, S, heads * hd] (rotary applied); key, value float [>= B, kv, cap, hd], the
 * cache after this call's keys and values went in (read in place, never copied); positions int64
 * [B, S], each query's position (it sees slots up to it); token_rows int64 [M], the flat
 * positions b * S + s whose outputs are computed. Output y float [M, heads * hd]. Attributes:
 * num_heads, scale, and optionally softcap (0: none) and local_window_size (0: none). A position
 * or token row out of range, or inputs whose shapes do not fit each other, give NaN rows, which
 * the runtime refuses. */
typedef struct {
    int64_t heads, window;
    float scale, softcap;
} Attention;

typedef struct {
    const Attention *op;
    const float *q, *k, *v;
    const int64_t *positions, *rows;
    float *y;
    int64_t b, s, kv, cap, hd, m;  /* m: the token rows */
} AttentionJob;

static __thread float *attn_scratch;  /* the scores of one query */
static __thread size_t attn_scratch_size;

/* *buf holds at least `need` bytes (grown as needed); 0 where memory ran out */
static int grown(float **buf, size_t *size, size_t need) {
    if (need > *size) {
        free(*buf);
        *buf = malloc(need);
        *size = *buf ? need : 0;
    }
    return *buf != NULL;
}

/* y [G, hd]: the group's queries q [G, hd] at position p over their KV head's cache rows k, v
 * [cap, hd], slots from the sliding window's start (or 0) to p */
static void attend_to(const Attention *op, const float *q, int64_t group, const float *k,
                      const float *v, int64_t hd, int64_t p, float *y) {
#ifdef ORTSPEC_X86
    int64_t lo = op->window > 0 && p - op->window + 1 > 0 ? p - op->window + 1 : 0;
    attend(q, group, k, v, hd, lo, p, op->scale, op->softcap, attn_scratch, y);
#else
    (void)op; (void)q; (void)group; (void)k; (void)v; (void)hd; (void)p; (void)y;
#endif
}

/* task i: the query heads of KV head i / M in token row i % M (M token rows): the tasks of one
 * KV head follow each other, so its cache rows stay in the cache from one token row to the next */
static void attention_task(void *data, size_t i) {
    AttentionJob *job = data;
    int64_t kv = job->kv, hd = job->hd, group = job->op->heads / kv;
    int64_t m = (int64_t)i % job->m, h = (int64_t)i / job->m, width = job->op->heads * hd;
    float *y = job->y + m * width + h * group * hd;
    int64_t flat = job->rows[m], p = -1;
    if (flat >= 0 && flat < job->b * job->s) p = job->positions[flat];
    if (p < 0 || p >= job->cap ||
        !grown(&attn_scratch, &attn_scratch_size, sizeof(float) * (size_t)(group * (p + 9)))) {
        for (int64_t j = 0; j < group * hd; j++) y[j] = __builtin_nanf("");
        return;
    }
    int64_t at = ((flat / job->s) * kv + h) * job->cap * hd;
    attend_to(job->op, job->q + flat * width + h * group * hd, group, job->k + at, job->v + at,
              hd, p, y);
}

static void attention_compute(void *state, void *context) {
    const Attention *op = state;
    int64_t qd[8], kd[8], vd[8], pd[8], rd[8];
    size_t qr = 0, kr = 0, vr = 0, pr = 0, rr = 0;
    const float *q = input_of(context, 0, qd, &qr), *k = input_of(context, 1, kd, &kr);
    const float *v = input_of(context, 2, vd, &vr);
    const int64_t *positions = input_of(context, 3, pd, &pr), *rows = input_of(context, 4, rd, &rr);
    if (qr != 3 || rr != 1) return;  /* no output: onnxruntime reports the missing tensor */
    int64_t out[2] = {rd[0], qd[2]};
    void *y_value;
    if (failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 0, out, 2, &y_value))) return;
    float *y = data_of(y_value);
    if (!y || rd[0] == 0) return;
    if (!q || !k || !v || !positions || !rows || kr != 4 || vr != 4 || pr != 2 ||
        qd[2] % op->heads || kd[1] <= 0 || op->heads % kd[1] || kd[3] != qd[2] / op->heads ||
        kd[0] < qd[0] || memcmp(kd, vd, sizeof(int64_t) * 4) || pd[0] != qd[0] ||
        pd[1] != qd[1]) {  /* shapes that do not fit: NaN rows, which the runtime refuses */
        for (int64_t i = 0; i < out[0] * out[1]; i++) y[i] = __builtin_nanf("");
        return;
    }
    AttentionJob job = {op, q, k, v, positions, rows, y, qd[0], qd[1], kd[1], kd[2], kd[3], rd[0]};
    size_t tasks = (size_t)(rd[0] * kd[1]);
    parallel(context, attention_task, tasks, &job);
}

static void *create_attention(const void *unused_op, const void *unused, const void *info) {
    (void)unused_op; (void)unused;
    Attention *op = calloc(1, sizeof(Attention));
    if (!op) return NULL;
    if (failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "num_heads", &op->heads)) ||
        failed(FN(API_KernelInfoGetAttribute_float, attr_float_t)(info, "scale", &op->scale)) ||
        op->heads <= 0) {
        free(op);
        return NULL;
    }
    if (failed(FN(API_KernelInfoGetAttribute_float, attr_float_t)(info, "softcap", &op->softcap)))
        op->softcap = 0.f;  /* optional attributes */
    if (failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "local_window_size", &op->window)))
        op->window = 0;
    return op;
}

static const char *attention_name(const void *op) { (void)op; return "CacheAttention"; }
static int attention_input_type(const void *op, size_t i) { (void)op; return i < 3 ? ELEM_FLOAT : ELEM_INT64; }
static size_t attention_inputs(const void *op) { (void)op; return 5; }
static CustomOp attention_op = CUSTOM_OP(create_attention, attention_name, attention_input_type,
                                         attention_inputs, attention_compute, free);

/* ---- RotaryCacheAttention ------------------------------------------------------------------ */

/* CacheAttention with the layer's rotary embedding and cache writes inside it. Inputs: qkv float
 * [B, S, (heads + 2 kv) * hd] (or [S, ...], B = 1: a graph on flat rows needs no reshape),
 * each position's q, k and v packed (before the rotary); key, value
 * float [>= B, kv, cap, hd], the cache before this call; positions int64 [B, S]; token_rows int64
 * [M]; cos, sin float [P, rotary_dim / 2], the rotary tables by position. Outputs: y float
 * [M, heads * hd]; present key and value, the cache with every position's rotated key and value
 * at its position of its row (written in place where the runtime binds the same buffer as input
 * and output; else the cache is copied first). Attributes: CacheAttention's, and rotary_dim
 * (the leading dims of each head that rotate, in halves: x_i, x_{i + r/2}). Positions out of
 * range, or shapes that do not fit, give NaN rows and write nothing. */
typedef struct {
    Attention base;
    int64_t rotary;
} RotaryAttention;

typedef struct {
    const RotaryAttention *op;
    const float *qkv, *cos, *sin;
    const float *k, *v;  /* the present cache */
    const int64_t *positions, *rows;
    float *y;
    int64_t b, s, kv, cap, hd, width, m;  /* m: the token rows */
} RotaryJob;

static __thread float *rotary_scratch;  /* a group's rotated queries */
static __thread size_t rotary_scratch_size;

/* out [hd] = x [hd] with its first r dims rotated to position p (r even, p < the tables' rows) */
static void rotate(const float *x, const float *cos, const float *sin, int64_t r, int64_t hd,
                   int64_t p, float *out) {
    int64_t half = r / 2;
    const float *c = cos + p * half, *sn = sin + p * half;
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * c[i] - x2 * sn[i];
        out[i + half] = x2 * c[i] + x1 * sn[i];
    }
    for (int64_t i = r; i < hd; i++) out[i] = x[i];
}

/* task i: the query heads of KV head i / M in token row i % M, rotated into scratch first, in
 * CacheAttention's order (rotary_compute has checked every position of the call against the
 * cache and the tables) */
static void rotary_task(void *data, size_t i) {
    RotaryJob *job = data;
    int64_t kv = job->kv, hd = job->hd, heads = job->op->base.heads, group = heads / kv;
    int64_t m = (int64_t)i % job->m, h = (int64_t)i / job->m;
    float *y = job->y + m * heads * hd + h * group * hd;
    int64_t flat = job->rows[m], p = -1;
    if (flat >= 0 && flat < job->b * job->s) p = job->positions[flat];
    if (p < 0 ||  /* a token row outside the call */
        !grown(&attn_scratch, &attn_scratch_size, sizeof(float) * (size_t)(group * (p + 9))) ||
        !grown(&rotary_scratch, &rotary_scratch_size, sizeof(float) * (size_t)(group * hd))) {
        for (int64_t j = 0; j < group * hd; j++) y[j] = __builtin_nanf("");
        return;
    }
    const float *q = job->qkv + flat * job->width + h * group * hd;
    for (int64_t g = 0; g < group; g++)
        rotate(q + g * hd, job->cos, job->sin, job->op->rotary, hd, p, rotary_scratch + g * hd);
    int64_t at = ((flat / job->s) * kv + h) * job->cap * hd;
    attend_to(&job->op->base, rotary_scratch, group, job->k + at, job->v + at, hd, p, y);
}

static void rotary_compute(void *state, void *context) {
    const RotaryAttention *op = state;
    int64_t xd[8], kd[8], vd[8], pd[8], rd[8], cd[8], sd[8];
    size_t xr = 0, kr = 0, vr = 0, pr = 0, rr = 0, cr = 0, sr = 0;
    const float *qkv = input_of(context, 0, xd, &xr), *k = input_of(context, 1, kd, &kr);
    const float *v = input_of(context, 2, vd, &vr);
    const int64_t *positions = input_of(context, 3, pd, &pr), *rows = input_of(context, 4, rd, &rr);
    const float *cos = input_of(context, 5, cd, &cr), *sin = input_of(context, 6, sd, &sr);
    if (xr == 2) {  /* [S, width]: one row of S tokens, as [1, S, width] */
        xd[2] = xd[1];
        xd[1] = xd[0];
        xd[0] = 1;
        xr = 3;
    }
    if (xr != 3 || rr != 1 || kr != 4 || vr != 4) return;  /* onnxruntime reports the output */
    int64_t heads = op->base.heads, kv = kd[1], hd = kd[3];
    int64_t out[2] = {rd[0], heads * hd};
    void *y_value, *k_value, *v_value;
    if (failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 0, out, 2, &y_value)) ||
        failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 1, kd, 4, &k_value)) ||
        failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 2, vd, 4, &v_value)))
        return;
    float *y = data_of(y_value), *kc = data_of(k_value), *vc = data_of(v_value);
    if (!kc || !vc) return;
    size_t cache = sizeof(float) * (size_t)(kd[0] * kd[1] * kd[2] * kd[3]);
    if (k && kc != k) memcpy(kc, k, cache);  /* not bound in place: the cache first */
    if (v && vc != v) memcpy(vc, v, cache);
    int bad = !qkv || !k || !v || !positions || !rows || !cos || !sin || pr != 2 || cr != 2 ||
              sr != 2 || kv <= 0 || heads % kv || xd[2] != (heads + 2 * kv) * hd ||
              kd[0] < xd[0] || memcmp(kd, vd, sizeof(int64_t) * 4) || pd[0] != xd[0] ||
              pd[1] != xd[1] || op->rotary > hd || cd[1] * 2 != op->rotary ||
              memcmp(cd, sd, sizeof(int64_t) * 2);
    for (int64_t f = 0; !bad && f < xd[0] * xd[1]; f++)
        bad = positions[f] < 0 || positions[f] >= kd[2] || positions[f] >= cd[0];
    if (bad) {  /* shapes or positions that do not fit: NaN rows, nothing written */
        for (int64_t i = 0; y && i < out[0] * out[1]; i++) y[i] = __builtin_nanf("");
        return;
    }
    int64_t width = xd[2], cap = kd[2];
    for (int64_t f = 0; f < xd[0] * xd[1]; f++) {  /* every position's key and value, stored */
        int64_t row = f / xd[1], p = positions[f];
        const float *x = qkv + f * width + heads * hd;
        for (int64_t h = 0; h < kv; h++) {
            int64_t at = ((row * kv + h) * cap + p) * hd;
            rotate(x + h * hd, cos, sin, op->rotary, hd, p, kc + at);
            memcpy(vc + at, x + (kv + h) * hd, sizeof(float) * (size_t)hd);
        }
    }
    if (!y || rd[0] == 0) return;
    RotaryJob job = {op, qkv, cos, sin, kc, vc, positions, rows, y, xd[0], xd[1], kv, cap, hd,
                     width, rd[0]};
    size_t tasks = (size_t)(rd[0] * kv);
    parallel(context, rotary_task, tasks, &job);
}

static void *create_rotary(const void *unused_op, const void *unused, const void *info) {
    RotaryAttention *op = calloc(1, sizeof(RotaryAttention));
    if (!op) return NULL;
    Attention *base = create_attention(unused_op, unused, info);
    if (!base || failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "rotary_dim",
                                                                         &op->rotary)) ||
        op->rotary <= 0 || op->rotary % 2) {
        free(base);
        free(op);
        return NULL;
    }
    op->base = *base;
    free(base);
    return op;
}

static const char *rotary_name(const void *op) { (void)op; return "RotaryCacheAttention"; }
static int rotary_input_type(const void *op, size_t i) {
    (void)op;
    return i == 3 || i == 4 ? ELEM_INT64 : ELEM_FLOAT;
}
static size_t rotary_inputs(const void *op) { (void)op; return 7; }
static size_t three_outputs(const void *op) { (void)op; return 3; }
static CustomOp rotary_op = {API_VERSION, create_rotary, rotary_name, cpu, rotary_input_type,
                             rotary_inputs, output_type, three_outputs, rotary_compute, free,
                             required, required, default_memory, one, one, one, one, NULL, NULL,
                             NULL, first_version, last_version, no_pairs, release_pairs,
                             no_pairs, release_pairs, {0}};

/* the entry point of SessionOptions.register_custom_ops_library */
OrtStatus *RegisterCustomOps(void *options, const OrtApiBase *base) {
    const void *table = base->GetApi(API_VERSION);
    if (!table) return NULL;  /* an onnxruntime too old for the table: nothing registered */
    api = (const void *const *)table;
    if (ortspec_q4_isa() == 0)
        return FN(API_CreateStatus, create_status_t)(
            1, "ortspec's kernels need an x86-64 CPU with AVX2 and FMA; export with "
               "--kernel onnxruntime");
    /* a domain for each session options: it must outlive their sessions, so it is kept */
    void *domain;
    OrtStatus *status;
    if ((status = FN(API_CreateCustomOpDomain, create_domain_t)("ortspec", &domain)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &q4_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &q4_swiglu_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &q4_norm_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &q4_swiglu_norm_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &q8_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &attention_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &rotary_op)))
        return status;
    return FN(API_AddCustomOpDomain, add_domain_t)(options, domain);
}

/* built as an extension module so that pip builds it; loaded by onnxruntime and ctypes, never
 * imported */
void *PyInit__q4kernel(void) { return NULL; }
