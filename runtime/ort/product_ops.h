/* The products' custom ops, Q4Gemm, Q4GemmSwiGlu, Q4GemmNorm, Q4GemmSwiGluNorm and Q8Gemm
 * (_q4kernel.c includes this file once, after q4_simd.h and its shared helpers). */

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
    int level = ortspec_q4_isa(), wide = level >= 2;
#ifdef ORTSPEC_AMX
    if (level == 3 && a->rows >= AMX_MIN_ROWS) {  /* (fewer: AVX-512, the same bits) */
        if (w->op == OP_Q4) q4_tiles_amx(a, w->q, w->d, w->m, y, t0, t1);
        else q8_tiles_amx(a, w->q, w->d, y, t0, t1);
        return;
    }
#endif
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

/* the most rows an AVX2 product takes at a time: its broadcast activations (Activations.xb)
 * take 8 bytes an input a row (16 for 8-bit weights), which a long prompt's call of thousands of
 * rows would hold per thread for good; each further slab reads the weights once more */
#define AVX2_SLAB_ROWS 256

/* y [rows, n] = x [rows, k] times the weight; context: onnxruntime's kernel context, whose
 * thread pool takes the output tiles (NULL: this thread alone). -1 where memory ran out. */
static int product(const Weight *w, const float *x, int64_t rows, float *y, void *context) {
#ifdef ORTSPEC_X86
    int64_t nb = w->k / QK, stride = w->k + QX_PAD;
    int wide = ortspec_q4_isa() >= 2;
    if (!wide && rows > AVX2_SLAB_ROWS) {  /* (a row's result is the same in any slab) */
        for (int64_t r = 0; r < rows; r += AVX2_SLAB_ROWS) {
            int64_t slab = rows - r < AVX2_SLAB_ROWS ? rows - r : AVX2_SLAB_ROWS;
            if (product(w, x + r * w->k, slab, y + r * w->n, context) != 0) return -1;
        }
        return 0;
    }
    size_t need = (size_t)(rows * stride) + 4 * sizeof(float) * (size_t)(rows * nb) + 64 +
                  (wide ? 0 : (size_t)(rows * w->k * 8) * (w->op == OP_Q8 ? 2 : 1) + 32);
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
    int8_t *xb = NULL, *xa = NULL;  /* AVX2: the broadcast activations (Activations.xb) */
    if (!wide && rows > 1) {  /* (a lone row's kernels broadcast from qx) */
        xb = (int8_t *)(((uintptr_t)(qs + rows * nb) + 31) & ~(uintptr_t)31);
        if (w->op == OP_Q8) xa = xb + rows * w->k * 8;
        broadcast_rows(qx, rows, w->k, stride, xb, xa);
    }
    Activations a = {rows, w->k, w->n, stride, qx, sx, bx, ix, qs, xb, xa};
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
    if (!kern) return;  /* a node its create refused (an attribute missing): no output */
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
static CustomOp q4_norm_op = CUSTOM_OP_N(create_q4_norm, q4_norm_name, q4_norm_input_type,
                                          q4_norm_inputs, two_outputs, kernel_compute,
                                          destroy_kernel);
static CustomOp q4_swiglu_norm_op = CUSTOM_OP_N(create_q4_swiglu_norm, q4_swiglu_norm_name,
                                                 q4_norm_input_type, q4_norm_inputs,
                                                 two_outputs, kernel_compute, destroy_kernel);
static CustomOp q8_op = CUSTOM_OP(create_q8, q8_name, q8_input_type, q8_inputs, kernel_compute,
                                  destroy_kernel);
