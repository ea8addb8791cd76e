/* The attention custom ops, CacheAttention and RotaryCacheAttention (_q4kernel.c includes this
 * file once, after attention_simd.h and its shared helpers), each in two types: with a float32
 * cache, and with a float16 one (CacheAttention16, RotaryCacheAttention16: the same inputs,
 * outputs and attributes, with key and value float16; the keys and values a call stores are
 * rounded to float16 to nearest, ties to even, and every product is taken in float32). */

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
    int half;  /* the cache holds float16 (the ...16 ops), else float32 */
} Attention;

typedef struct {
    const Attention *op;
    const float *q;
    const void *k, *v;  /* float, or uint16_t (float16) where op->half */
    const int64_t *positions, *rows;
    float *y;
    int64_t b, s, kv, cap, hd, m;  /* m: the token rows */
} AttentionJob;

static __thread float *attn_scratch;  /* the scores of one query */
static __thread size_t attn_scratch_size;

/* the bytes of a cache element */
static size_t kv_size(const Attention *op) { return op->half ? sizeof(uint16_t) : sizeof(float); }

/* y [G, hd]: the group's queries q [G, hd] at position p over their KV head's cache rows k, v
 * [cap, hd] (elements from `at` on), slots from the sliding window's start (or 0) to p */
static void attend_to(const Attention *op, const float *q, int64_t group, const void *k,
                      const void *v, int64_t at, int64_t hd, int64_t p, float *y) {
#ifdef ORTSPEC_X86
    int64_t lo = op->window > 0 && p - op->window + 1 > 0 ? p - op->window + 1 : 0;
    if (op->half)
        attend_f16(q, group, (const uint16_t *)k + at, (const uint16_t *)v + at, hd, lo, p,
                   op->scale, op->softcap, attn_scratch, y);
    else
        attend_f32(q, group, (const float *)k + at, (const float *)v + at, hd, lo, p, op->scale,
                   op->softcap, attn_scratch, y);
#else
    (void)at;
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
    attend_to(job->op, job->q + flat * width + h * group * hd, group, job->k, job->v, at, hd, p,
              y);
}

static void attention_compute(void *state, void *context) {
    const Attention *op = state;
    if (!op) return;  /* a node its create refused: no output */
    int64_t qd[8], kd[8], vd[8], pd[8], rd[8];
    size_t qr = 0, kr = 0, vr = 0, pr = 0, rr = 0;
    const float *q = input_of(context, 0, qd, &qr);
    const void *k = input_of(context, 1, kd, &kr), *v = input_of(context, 2, vd, &vr);
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

static void *create_attention16(const void *unused_op, const void *unused, const void *info) {
    Attention *op = create_attention(unused_op, unused, info);
    if (op) op->half = 1;
    return op;
}

static const char *attention_name(const void *op) { (void)op; return "CacheAttention"; }
static int attention_input_type(const void *op, size_t i) { (void)op; return i < 3 ? ELEM_FLOAT : ELEM_INT64; }
static size_t attention_inputs(const void *op) { (void)op; return 5; }
static CustomOp attention_op = CUSTOM_OP(create_attention, attention_name, attention_input_type,
                                         attention_inputs, attention_compute, free);

static const char *attention16_name(const void *op) { (void)op; return "CacheAttention16"; }
static int attention16_input_type(const void *op, size_t i) {
    (void)op;
    return i == 0 ? ELEM_FLOAT : i < 3 ? ELEM_FLOAT16 : ELEM_INT64;
}
static CustomOp attention16_op = CUSTOM_OP(create_attention16, attention16_name,
                                           attention16_input_type, attention_inputs,
                                           attention_compute, free);

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
    const void *k, *v;  /* the present cache (float, or float16 where op->base.half) */
    const int64_t *positions, *rows;
    float *y;
    int64_t b, s, kv, cap, hd, width, m;  /* m: the token rows */
} RotaryJob;

static __thread float *rotary_scratch;  /* a group's rotated queries */
static __thread size_t rotary_scratch_size;

/* out [n] = x [n] as float16, rounded to nearest, ties to even */
#ifdef ORTSPEC_X86
static AVX2 void to_half(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}
#else
static void to_half(const float *x, int64_t n, uint16_t *out) { (void)x; (void)n; (void)out; }
#endif

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
    attend_to(&job->op->base, rotary_scratch, group, job->k, job->v, at, hd, p, y);
}

static void rotary_compute(void *state, void *context) {
    const RotaryAttention *op = state;
    if (!op) return;  /* a node its create refused: no output */
    int64_t xd[8], kd[8], vd[8], pd[8], rd[8], cd[8], sd[8];
    size_t xr = 0, kr = 0, vr = 0, pr = 0, rr = 0, cr = 0, sr = 0;
    const float *qkv = input_of(context, 0, xd, &xr);
    const void *k = input_of(context, 1, kd, &kr), *v = input_of(context, 2, vd, &vr);
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
    float *y = data_of(y_value);
    void *kc = data_of(k_value), *vc = data_of(v_value);
    if (!kc || !vc) return;
    size_t cache = kv_size(&op->base) * (size_t)(kd[0] * kd[1] * kd[2] * kd[3]);
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
    if (op->base.half && !grown(&rotary_scratch, &rotary_scratch_size, sizeof(float) * (size_t)hd))
        return;  /* no output: onnxruntime reports the missing tensor */
    for (int64_t f = 0; f < xd[0] * xd[1]; f++) {  /* every position's key and value, stored */
        int64_t row = f / xd[1], p = positions[f];
        const float *x = qkv + f * width + heads * hd;
        for (int64_t h = 0; h < kv; h++) {
            int64_t at = ((row * kv + h) * cap + p) * hd;
            if (op->base.half) {
                rotate(x + h * hd, cos, sin, op->rotary, hd, p, rotary_scratch);
                to_half(rotary_scratch, hd, (uint16_t *)kc + at);
                to_half(x + (kv + h) * hd, hd, (uint16_t *)vc + at);
            } else {
                rotate(x + h * hd, cos, sin, op->rotary, hd, p, (float *)kc + at);
                memcpy((float *)vc + at, x + (kv + h) * hd, sizeof(float) * (size_t)hd);
            }
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

static void *create_rotary16(const void *unused_op, const void *unused, const void *info) {
    RotaryAttention *op = create_rotary(unused_op, unused, info);
    if (op) op->base.half = 1;
    return op;
}

static const char *rotary_name(const void *op) { (void)op; return "RotaryCacheAttention"; }
static int rotary_input_type(const void *op, size_t i) {
    (void)op;
    return i == 3 || i == 4 ? ELEM_INT64 : ELEM_FLOAT;
}
static size_t rotary_inputs(const void *op) { (void)op; return 7; }
static size_t three_outputs(const void *op) { (void)op; return 3; }
static CustomOp rotary_op = CUSTOM_OP_N(create_rotary, rotary_name, rotary_input_type,
                                        rotary_inputs, three_outputs, rotary_compute, free);

static const char *rotary16_name(const void *op) { (void)op; return "RotaryCacheAttention16"; }
static int rotary16_input_type(const void *op, size_t i) {
    (void)op;
    return i == 3 || i == 4 ? ELEM_INT64 : i == 1 || i == 2 ? ELEM_FLOAT16 : ELEM_FLOAT;
}
static int rotary16_output_type(const void *op, size_t i) {
    (void)op;
    return i == 0 ? ELEM_FLOAT : ELEM_FLOAT16;
}
static CustomOp rotary16_op = CUSTOM_OP_TYPED(create_rotary16, rotary16_name, rotary16_input_type,
                                              rotary_inputs, rotary16_output_type, three_outputs,
                                              rotary_compute, free);
