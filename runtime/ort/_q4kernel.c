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
 * The products' ops are in product_ops.h and the attentions' in attention_ops.h, both included
 * below (one translation unit); their SIMD arithmetic in q4_simd.h and attention_simd.h.
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
#include "q4_amx.h"
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

/* 3: AVX-512 VNNI and AMX-INT8 (products of several rows on AMX), 2: AVX-512 VNNI, 1: AVX2 and
 * FMA, 0: no kernel for this CPU */
int ortspec_q4_isa(void) {
    if (isa < 0) {
        int best = detect_isa();
#ifdef ORTSPEC_AMX
        if (best == 2 && amx_usable()) best = 3;
#endif
        isa = best;
    }
    return forced_isa >= 0 && forced_isa < isa ? forced_isa : isa;
}

/* tests: run the AVX2 kernels on an AVX-512 machine (1), AVX-512 without AMX (2), or the best
 * again (-1) */
void ortspec_q4_force_isa(int level) { forced_isa = level; }

/* *buf holds at least `need` bytes (grown as needed); 0 where memory ran out */
static int grown(float **buf, size_t *size, size_t need) {
    if (need > *size) {
        free(*buf);
        *buf = malloc(need);
        *size = *buf ? need : 0;
    }
    return *buf != NULL;
}

#include "product_ops.h"
#include "attention_ops.h"

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
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &rotary_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &attention16_op)) ||
        (status = FN(API_CustomOpDomain_Add, domain_add_t)(domain, &rotary16_op)))
        return status;
    return FN(API_AddCustomOpDomain, add_domain_t)(options, domain);
}

/* built as an extension module so that pip builds it; loaded by onnxruntime and ctypes, never
 * imported */
void *PyInit__q4kernel(void) { return NULL; }
