/* ortspec.Q4Gemm: y = x @ w.T for a weight stored as llama.cpp's Q4_1 blocks (w = d * q + m,
 * 32 consecutive inputs a block, q in 0..15, d and m float16), as an onnxruntime custom op.
 *
 * x [..., K] float32 is quantized per row and block of 32 to int8 (scale max|x| / 127), the
 * same activation rounding as onnxruntime's MatMulNBits at accuracy level 4. Each block's
 * integer dot product is exact, and every output element is accumulated in the same order
 * whatever the number of rows, so a row of a many-row call equals the same row called alone,
 * bit for bit.
 *
 * Inputs: x float [..., K]; q uint8 [N / 16, K / 32, 4, 64]; d, m float16 [N / 16, K / 32, 16].
 * A tile of 16 outputs and a block of 32 inputs is 256 bytes of q: byte 4 * c + u of 64-byte
 * row j holds input 4 * j + u of output c in its low nibble and input 16 + 4 * j + u in its
 * high nibble (export/kernel_pack.py writes it). Attributes: K, N. Output: y float [..., N].
 *
 * The unpacked nibbles of a tile are shared by up to 8 rows (AVX-512 VNNI) or 4 (AVX2), which
 * is what makes an extra row cheap; onnxruntime's kernel unpacks them again for every pair of
 * rows and adds a second float product for the block minima.
 *
 * The onnxruntime C API is reached through the function table OrtGetApiBase hands the library
 * (indices are that table's stable, append-only ABI), so no onnxruntime header is needed. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define QK 32
#define TILE 16

typedef void OrtStatus;
typedef void OrtApi;
typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* slots of the OrtApi function table */
enum {
    API_CreateStatus = 0, API_GetErrorMessage = 2, API_CreateCustomOpDomain = 26,
    API_CustomOpDomain_Add = 27, API_AddCustomOpDomain = 28, API_GetTensorMutableData = 51,
    API_GetDimensionsCount = 61, API_GetDimensions = 62, API_GetTensorTypeAndShape = 65,
    API_KernelInfoGetAttribute_int64 = 86, API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91, API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99, API_GetBuildInfoString = 254,
    API_KernelContext_ParallelFor = 274,
};
#define API_VERSION_PARALLEL_FOR 16 /* the first API version with KernelContext_ParallelFor */

static const void *const *api;  /* the table, as an array of function pointers */
#define FN(slot, type) ((type)api[slot])

typedef OrtStatus *(*create_status_t)(int, const char *);
typedef void (*release_t)(void *);

/* ---- the kernels ------------------------------------------------------------------------- */

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* x [rows, k] -> qx int8 [rows, k], sx [rows, k / 32] (max|x| / 127 per block) and bx (sx times
 * the block's sum of qx); rounding to nearest even, as lrintf does */
static AVX2 void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *qx, float *sx,
                               float *bx) {
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
            __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            /* int32 -> int8 in order: packs interleave the 128-bit lanes, the permute undoes it */
            __m256i p16 = _mm256_packs_epi32(i0, i1), p16b = _mm256_packs_epi32(i2, i3);
            __m256i p8 = _mm256_packs_epi16(p16, p16b);
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qx + r * k + b * QK), p8);
            sx[r * nb + b] = amax / 127.f;
            bx[r * nb + b] = amax / 127.f * (float)_mm_cvtsi128_si32(s4);
        }
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

/* R rows x one tile of 16 outputs, all blocks */
static inline AVX512 __attribute__((always_inline)) void
tile512(int R, int64_t nb, int64_t k, const int8_t *qx, const float *sx, const float *bx,
        const uint8_t *q, const uint16_t *d, const uint16_t *m, float *y, int64_t ldy) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512((const void *)(q + b * 256 + j * 64));
            w[j] = _mm512_and_si512(packed, low);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * TILE)));
        __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * TILE)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int32_t *xr = (const int32_t *)(qx + r * k + b * QK);
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(xr[g]));
            __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(bx[r * nb + b]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

static AVX512 void tiles512(int64_t rows, int64_t k, int64_t n, const int8_t *qx, const float *sx,
                            const float *bx, const uint8_t *q, const uint16_t *d,
                            const uint16_t *m, float *y, int64_t t0, int64_t t1) {
    int64_t nb = k / QK;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *qt = q + t * nb * 256;
        const uint16_t *dt = d + t * nb * TILE, *mt = m + t * nb * TILE;
        for (int64_t r = 0; r < rows; r += 8) {
#define ROWS(R) tile512(R, nb, k, qx + r * k, sx + r * nb, bx + r * nb, qt, dt, mt, y + r * n + t * TILE, n)
            switch (rows - r >= 8 ? 8 : rows - r) {
                case 8: ROWS(8); break; case 7: ROWS(7); break; case 6: ROWS(6); break;
                case 5: ROWS(5); break; case 4: ROWS(4); break; case 3: ROWS(3); break;
                case 2: ROWS(2); break; default: ROWS(1); break;
            }
#undef ROWS
        }
    }
}

/* AVX2: a tile as two halves of 8 outputs; u8 x s8 pairs summed in int16 over the block's 8
 * groups (at most 8 * 2 * 15 * 127 = 30480, so nothing saturates), then widened once */
static inline AVX2 __attribute__((always_inline)) void
tile256(int R, int64_t nb, int64_t k, const int8_t *qx, const float *sx, const float *bx,
        const uint8_t *q, const uint16_t *d, const uint16_t *m, float *y, int64_t ldy) {
    __m256 acc[2][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(q + b * 256 + j * 64 + h * 32));
                w[j] = _mm256_and_si256(packed, low);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            }
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * TILE + h * 8)));
            __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b * TILE + h * 8)));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int32_t *xr = (const int32_t *)(qx + r * k + b * QK);
                __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xr[0]));
#pragma GCC unroll 7
                for (int g = 1; g < 8; g++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(xr[g])));
                __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[r * nb + b]));
                acc[h][r] = _mm256_fmadd_ps(f, scale, acc[h][r]);
                acc[h][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(bx[r * nb + b]), acc[h][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * ldy, acc[0][r]);
        _mm256_storeu_ps(y + r * ldy + 8, acc[1][r]);
    }
}

static AVX2 void tiles256(int64_t rows, int64_t k, int64_t n, const int8_t *qx, const float *sx,
                          const float *bx, const uint8_t *q, const uint16_t *d,
                          const uint16_t *m, float *y, int64_t t0, int64_t t1) {
    int64_t nb = k / QK;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *qt = q + t * nb * 256;
        const uint16_t *dt = d + t * nb * TILE, *mt = m + t * nb * TILE;
        for (int64_t r = 0; r < rows; r += 4) {
#define ROWS(R) tile256(R, nb, k, qx + r * k, sx + r * nb, bx + r * nb, qt, dt, mt, y + r * n + t * TILE, n)
            switch (rows - r >= 4 ? 4 : rows - r) {
                case 4: ROWS(4); break; case 3: ROWS(3); break; case 2: ROWS(2); break;
                default: ROWS(1); break;
            }
#undef ROWS
        }
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
#else
static int detect_isa(void) { return 0; }
#endif

static int isa = -1;
static int forced_isa = -1;

/* 2: AVX-512 VNNI, 1: AVX2 and FMA, 0: no kernel for this CPU */
int ortspec_q4_isa(void) {
    if (isa < 0) isa = detect_isa();
    return forced_isa >= 0 && forced_isa < isa ? forced_isa : isa;
}

/* tests: run the AVX2 kernel on an AVX-512 machine (isa 1), or back to the best (-1) */
void ortspec_q4_force_isa(int level) { forced_isa = level; }

/* y [rows, n] for output tiles [t0, t1), x already quantized */
static void run_tiles(int64_t rows, int64_t k, int64_t n, const int8_t *qx, const float *sx,
                      const float *bx, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                      float *y, int64_t t0, int64_t t1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (ortspec_q4_isa() == 2) tiles512(rows, k, n, qx, sx, bx, q, d, m, y, t0, t1);
    else tiles256(rows, k, n, qx, sx, bx, q, d, m, y, t0, t1);
#endif
}

/* The whole product on the calling thread (the tests' reference entry point). */
int ortspec_q4_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const uint8_t *q,
                    const uint16_t *d, const uint16_t *m, float *y) {
    if (ortspec_q4_isa() == 0 || k % QK || n % TILE) return -1;
    int8_t *qx = malloc((size_t)(rows * k) + 1);
    float *sx = malloc(sizeof(float) * (size_t)(rows * (k / QK)) + 4);
    float *bx = malloc(sizeof(float) * (size_t)(rows * (k / QK)) + 4);
    if (!qx || !sx || !bx) { free(qx); free(sx); free(bx); return -2; }
#if defined(__x86_64__) || defined(_M_X64)
    quantize_rows(x, rows, k, qx, sx, bx);
#endif
    run_tiles(rows, k, n, qx, sx, bx, q, d, m, y, 0, n / TILE);
    free(qx); free(sx); free(bx);
    return 0;
}

/* ---- the custom op ----------------------------------------------------------------------- */

typedef struct { int64_t k, n; } Kernel;

typedef struct {
    int64_t rows, k, n, tiles, chunks;
    const int8_t *qx; const float *sx, *bx;
    const uint8_t *q; const uint16_t *d, *m;
    float *y;
} Work;

static void work_chunk(void *data, size_t i) {
    Work *w = data;
    int64_t t0 = w->tiles * (int64_t)i / w->chunks, t1 = w->tiles * (int64_t)(i + 1) / w->chunks;
    run_tiles(w->rows, w->k, w->n, w->qx, w->sx, w->bx, w->q, w->d, w->m, w->y, t0, t1);
}

typedef OrtStatus *(*get_input_t)(const void *, size_t, const void **);
typedef OrtStatus *(*get_output_t)(void *, size_t, const int64_t *, size_t, void **);
typedef OrtStatus *(*type_shape_t)(const void *, void **);
typedef OrtStatus *(*dims_count_t)(const void *, size_t *);
typedef OrtStatus *(*dims_t)(const void *, int64_t *, size_t);
typedef OrtStatus *(*mutable_data_t)(void *, void **);
typedef OrtStatus *(*parallel_for_t)(const void *, void (*)(void *, size_t), size_t, size_t, void *);

static int failed(OrtStatus *status) {
    if (!status) return 0;
    FN(API_ReleaseStatus, release_t)(status);
    return 1;
}

/* per-thread scratch for the quantized activations (a session may run on several threads) */
static __thread int8_t *scratch;
static __thread size_t scratch_size;

static void kernel_compute(void *state, void *context) {
    const Kernel *kern = state;
    const void *x_value, *q_value, *d_value, *m_value;
    if (failed(FN(API_KernelContext_GetInput, get_input_t)(context, 0, &x_value)) ||
        failed(FN(API_KernelContext_GetInput, get_input_t)(context, 1, &q_value)) ||
        failed(FN(API_KernelContext_GetInput, get_input_t)(context, 2, &d_value)) ||
        failed(FN(API_KernelContext_GetInput, get_input_t)(context, 3, &m_value)))
        return;
    void *info;
    size_t rank = 0;
    int64_t dims[8];
    if (failed(FN(API_GetTensorTypeAndShape, type_shape_t)(x_value, &info))) return;
    int bad = failed(FN(API_GetDimensionsCount, dims_count_t)(info, &rank)) || rank < 1 || rank > 8 ||
              failed(FN(API_GetDimensions, dims_t)(info, dims, rank));
    FN(API_ReleaseTensorTypeAndShapeInfo, release_t)(info);
    if (bad || dims[rank - 1] != kern->k) return;
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    dims[rank - 1] = kern->n;
    void *y_value;
    float *y;
    void *x, *q, *d, *m;
    if (failed(FN(API_KernelContext_GetOutput, get_output_t)(context, 0, dims, rank, &y_value)) ||
        failed(FN(API_GetTensorMutableData, mutable_data_t)(y_value, (void **)&y)) ||
        failed(FN(API_GetTensorMutableData, mutable_data_t)((void *)x_value, &x)) ||
        failed(FN(API_GetTensorMutableData, mutable_data_t)((void *)q_value, &q)) ||
        failed(FN(API_GetTensorMutableData, mutable_data_t)((void *)d_value, &d)) ||
        failed(FN(API_GetTensorMutableData, mutable_data_t)((void *)m_value, &m)))
        return;
    if (rows == 0) return;
    int64_t nb = kern->k / QK;
    size_t need = (size_t)(rows * kern->k) + 2 * sizeof(float) * (size_t)(rows * nb) + 64;
    if (need > scratch_size) {
        free(scratch);
        scratch = malloc(need);
        scratch_size = scratch ? need : 0;
        if (!scratch) return;
    }
    float *sx = (float *)(scratch + ((rows * kern->k + 15) & ~(int64_t)15));
    float *bx = sx + rows * nb;
#if defined(__x86_64__) || defined(_M_X64)
    quantize_rows(x, rows, kern->k, scratch, sx, bx);
#endif
    int64_t tiles = kern->n / TILE;
    /* enough chunks for the pool to balance, each at least a few tiles of work */
    int64_t chunks = tiles < 16 ? tiles : 16;
    Work w = {rows, kern->k, kern->n, tiles, chunks, scratch, sx, bx, q, d, m, y};
    if (chunks <= 1 || failed(FN(API_KernelContext_ParallelFor, parallel_for_t)(
                                  context, work_chunk, (size_t)chunks, 0, &w)))
        run_tiles(rows, kern->k, kern->n, scratch, sx, bx, q, d, m, y, 0, tiles);
}

typedef OrtStatus *(*attr_int_t)(const void *, const char *, int64_t *);

static void *create_kernel(const void *op, const void *unused_api, const void *info) {
    (void)op; (void)unused_api;
    Kernel *kern = calloc(1, sizeof(Kernel));
    if (!kern) return NULL;
    if (failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "K", &kern->k)) ||
        failed(FN(API_KernelInfoGetAttribute_int64, attr_int_t)(info, "N", &kern->n)) ||
        kern->k <= 0 || kern->n <= 0 || kern->k % QK || kern->n % TILE) {
        free(kern);
        return NULL;
    }
    return kern;
}

static void destroy_kernel(void *state) { free(state); }
static const char *op_name(const void *op) { (void)op; return "Q4Gemm"; }
static const char *op_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
/* ONNX element types: 1 float, 2 uint8, 10 float16 */
static int input_type(const void *op, size_t i) { (void)op; return i == 0 ? 1 : i == 1 ? 2 : 10; }
static size_t input_count(const void *op) { (void)op; return 4; }
static int output_type(const void *op, size_t i) { (void)op; (void)i; return 1; }
static size_t output_count(const void *op) { (void)op; return 1; }

static int required(const void *op, size_t i) { (void)op; (void)i; return 0; }  /* INPUT_OUTPUT_REQUIRED */
static int default_memory(const void *op, size_t i) { (void)op; (void)i; return 0; }  /* OrtMemTypeDefault */
static int one(const void *op) { (void)op; return 1; }
static int first_version(const void *op) { (void)op; return 1; }
static int last_version(const void *op) { (void)op; return 0x7fffffff; }
static size_t no_pairs(int **a, int **b) { *a = NULL; *b = NULL; return 0; }
static void release_pairs(int *a, int *b) { (void)a; (void)b; }

/* OrtCustomOp: every member onnxruntime may read, in the C API's order. The V2 kernel entry
 * points and shape inference are left out (NULL), so the V1 ones run and outputs are sized at
 * run time. */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *, const void *, const void *);
    const char *(*GetName)(const void *);
    const char *(*GetExecutionProviderType)(const void *);
    int (*GetInputType)(const void *, size_t);
    size_t (*GetInputTypeCount)(const void *);
    int (*GetOutputType)(const void *, size_t);
    size_t (*GetOutputTypeCount)(const void *);
    void (*KernelCompute)(void *, void *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const void *, size_t);
    int (*GetOutputCharacteristic)(const void *, size_t);
    int (*GetInputMemoryType)(const void *, size_t);
    int (*GetVariadicInputMinArity)(const void *);
    int (*GetVariadicInputHomogeneity)(const void *);
    int (*GetVariadicOutputMinArity)(const void *);
    int (*GetVariadicOutputHomogeneity)(const void *);
    void *CreateKernelV2;
    void *KernelComputeV2;
    void *InferOutputShapeFn;
    int (*GetStartVersion)(const void *);
    int (*GetEndVersion)(const void *);
    size_t (*GetMayInplace)(int **, int **);
    void (*ReleaseMayInplace)(int *, int *);
    size_t (*GetAliasMap)(int **, int **);
    void (*ReleaseAliasMap)(int *, int *);
    void *unused[16];  /* zeroed room for members of later versions */
} CustomOp;

static CustomOp q4gemm_op = {
    API_VERSION_PARALLEL_FOR, create_kernel, op_name, op_provider, input_type, input_count,
    output_type, output_count, kernel_compute, destroy_kernel, required, required,
    default_memory, one, one, one, one, NULL, NULL, NULL, first_version, last_version,
    no_pairs, release_pairs, no_pairs, release_pairs, {0}};

typedef OrtStatus *(*create_domain_t)(const char *, void **);
typedef OrtStatus *(*domain_add_t)(void *, const void *);
typedef OrtStatus *(*add_domain_t)(void *, void *);

/* the entry point of SessionOptions.register_custom_ops_library */
OrtStatus *RegisterCustomOps(void *options, const OrtApiBase *base) {
    const OrtApi *table = base->GetApi(API_VERSION_PARALLEL_FOR);
    if (!table) return NULL;  /* an onnxruntime too old to hand out the table: nothing registered */
    api = (const void *const *)table;
    if (ortspec_q4_isa() == 0)
        return FN(API_CreateStatus, create_status_t)(
            1, "ortspec.Q4Gemm needs an x86-64 CPU with AVX2 and FMA; export without the ortspec kernel (--kernel onnxruntime)");
    /* a domain for each session options: it must outlive their sessions, so it is never released */
    void *domain;
    OrtStatus *status;
    if ((status = FN(API_CreateCustomOpDomain, create_domain_t)("ortspec", &domain))) return status;
    if ((status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &q4gemm_op))) return status;
    return FN(API_AddCustomOpDomain, add_domain_t)(options, domain);
}

/* the library is built as an extension module so that pip builds it; it is loaded by
 * onnxruntime and ctypes, never imported */
void *PyInit__q4kernel(void) { return NULL; }
