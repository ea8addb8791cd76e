/* The products on Intel AMX (AMX-TILE and AMX-INT8: Sapphire Rapids and later), for calls of
 * many rows, a prompt's (_q4kernel.c includes this file once, after q4_simd.h).
 *
 * The AVX-512 kernels spend 8 VNNI dot products a row on each tile-block (16 outputs by 32
 * inputs), so each row of a call costs as much as the first. Here one tile multiply
 * (TDPBSUD: signed activations by unsigned weights) computes the int32 sums of up to 16 rows at
 * once; each row then only scales its sums. The tiles' layouts are the packed ones:
 * - A (tile 1): R rows of a block's 32 int8 activations, read from qx at its row stride;
 * - B (tile 2): 8 rows of 64 bytes, row g holding inputs 4g..4g+3 of each of the 16 outputs,
 *   which is the Q8 tile-block as stored and the Q4 one once its nibbles are split (low nibbles
 *   inputs 0..15, high nibbles 16..31: q4_tile512's w[0..7]);
 * - C (tile 0): the R x 16 int32 sums, stored for the rows' scaling.
 * The sums are exact integers, and each row scales and adds them block after block in
 * q4_tile512's and q8_tile512's order and operations, so every output is bit for bit what the
 * AVX-512 kernels compute, whatever the number of rows. */

#if defined(__GNUC__) && (__GNUC__ >= 11 || (defined(__clang__) && __clang_major__ >= 12))
#define ORTSPEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define ROWS_AMX 16  /* a tile's rows */
#define AMX_BLOCKS 8  /* blocks whose sums are stored before the rows scale them */
/* the fewest rows a product runs on AMX. Each block's multiply waits on its tiles' loads and
 * its sums' store, and only two run at once, so a call of a few rows is faster on AVX-512
 * (measured on a Xeon with AMX, one 576 x 1536 product: 1.63x the AVX-512 time at 2 rows, 1.14x
 * at 8, 0.81x at 16, 0.79x at 32, 0.88x at 128; a 512-token prefill 0.91x) */
#define AMX_MIN_ROWS 32

/* the tile configuration (palette 1), 64 bytes */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* whether this CPU has AMX-INT8 and the kernel lets this process use the tile data (Linux asks
 * for it once: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
static int amx_usable(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return 0;  /* AMX-TILE, AMX-INT8 */
#ifdef SYS_arch_prctl
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

/* tiles for R rows: C (0) R x 16 int32, A (1) R x 32 int8, B (2) 8 x 64 bytes. Loaded on every
 * call: onnxruntime's own AMX kernels configure the tiles of the same threads their way */
static AMX void amx_configure(int R) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)R;
    cfg.colsb[0] = TILE * 4;
    cfg.rows[1] = (uint8_t)R;
    cfg.colsb[1] = QK;
    cfg.rows[2] = QK / 4;
    cfg.colsb[2] = 64;
    for (int t = 3; t < 6; t++) {  /* the second set (amx_sums) */
        cfg.rows[t] = cfg.rows[t - 3];
        cfg.colsb[t] = cfg.colsb[t - 3];
    }
    _tile_loadconfig(&cfg);
}

/* the int32 sums of `blocks` blocks, [blocks, ROWS_AMX, TILE]: activations from x (row stride
 * `stride`, a block QK bytes on), weights from w (a block `wstep` bytes on). Two blocks at a
 * time on two sets of tiles, so that one's multiply runs while the other's tiles load and store */
static AMX INLINE void amx_sums(int64_t blocks, const int8_t *x, int64_t stride, const uint8_t *w,
                                int64_t wstep, int32_t *sums) {
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, x + b * QK, stride);
        _tile_loadd(2, w + b * wstep, 64);
        _tile_loadd(4, x + (b + 1) * QK, stride);
        _tile_loadd(5, w + (b + 1) * wstep, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_dpbsud(3, 4, 5);
        _tile_stored(0, sums + b * ROWS_AMX * TILE, TILE * 4);
        _tile_stored(3, sums + (b + 1) * ROWS_AMX * TILE, TILE * 4);
    }
    if (b < blocks) {
        _tile_zero(0);
        _tile_loadd(1, x + b * QK, stride);
        _tile_loadd(2, w + b * wstep, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums + b * ROWS_AMX * TILE, TILE * 4);
    }
}

/* ---- Q4: R rows x one tile ---------------------------------------------------------------- */

static AMX INLINE void q4_tile_amx(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                   const uint16_t *d, const uint16_t *m, float *y,
                                   int32_t *sums, uint8_t *wbuf) {
    const int64_t nb = a->k / QK, stride = a->stride;
    const int8_t *qx = a->qx + r0 * stride;
    const float *sx = a->sx + r0 * nb, *bx = a->bx + r0 * nb, *qs = a->qs + r0 * nb;
    __m512 acc[ROWS_AMX];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_BLOCKS) {
        int64_t b1 = b0 + AMX_BLOCKS < nb ? b0 + AMX_BLOCKS : nb;
        for (int64_t b = b0; b < b1; b++) {  /* the split nibbles of each block */
            uint8_t *wb = wbuf + (b - b0) * 512;
            prefetch(q + b * 256, PREFETCH_AHEAD, 4);
            if ((b & 1) == 0) {
                prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
                prefetch(m + b * TILE, PREFETCH_AHEAD / 8, 1);
            }
            __m512i w[8];
            q4_split512(q, b, w);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) _mm512_store_si512((void *)(wb + g * 64), w[g]);
        }
        amx_sums(b1 - b0, qx + b0 * QK, stride, wbuf, 512, sums);
        for (int64_t b = b0; b < b1; b++) {  /* each row scales them as q4_tile512 does */
            const int32_t *s = sums + (b - b0) * ROWS_AMX * TILE;
            Q4Terms t = q4_terms512(d, m, b);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                acc[r] = q4_add512(acc[r], _mm512_load_si512((const void *)(s + r * TILE)), &t,
                                   sx[r * nb + b], qs[r * nb + b], bx[r * nb + b]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * a->n, acc[r]);
}

/* ---- Q8: R rows x one tile ---------------------------------------------------------------- */

/* (the Q8 tile-blocks are B tiles as stored: nothing to split) */
static AMX INLINE void q8_tile_amx(int R, const Activations *a, int64_t r0, const uint8_t *q,
                                   const float *d, float *y, int32_t *sums) {
    const int64_t nb = a->k / QK, stride = a->stride;
    const int8_t *qx = a->qx + r0 * stride;
    const float *sx = a->sx + r0 * nb;
    const int32_t *ix = a->ix + r0 * nb;
    __m512 acc[ROWS_AMX];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_BLOCKS) {
        int64_t b1 = b0 + AMX_BLOCKS < nb ? b0 + AMX_BLOCKS : nb;
        for (int64_t b = b0; b < b1; b++) {
            prefetch(q + b * 512, PREFETCH_AHEAD, 8);
            prefetch(d + b * TILE, PREFETCH_AHEAD / 8, 1);
        }
        amx_sums(b1 - b0, qx + b0 * QK, stride, q + b0 * 512, 512, sums);
        for (int64_t b = b0; b < b1; b++) {  /* each row scales them as q8_tile512 does */
            const int32_t *s = sums + (b - b0) * ROWS_AMX * TILE;
            __m512 dv = _mm512_loadu_ps(d + b * TILE);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                acc[r] = q8_add512(acc[r],
                                   _mm512_add_epi32(_mm512_load_si512((const void *)(s + r * TILE)),
                                                    _mm512_set1_epi32(-128 * ix[r * nb + b])),
                                   dv, sx[r * nb + b]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * a->n, acc[r]);
}

/* ---- every row of output tiles [t0, t1) --------------------------------------------------- */

/* groups of up to 16 rows, each group over tiles [t0, t1) with the tiles configured for it */
#define AMX_ROW_GROUPS(T, ...)                                                          \
    for (int64_t r = 0; r < a->rows; r += ROWS_AMX) {                                      \
        int R = a->rows - r >= ROWS_AMX ? ROWS_AMX : (int)(a->rows - r);                   \
        amx_configure(R);                                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                \
            switch (R) { ROW_CASES_UP_TO_16(T, __VA_ARGS__) }                              \
        }                                                                                  \
    }                                                                                      \
    _tile_release();

static AMX void q4_tiles_amx(const Activations *a, const uint8_t *q, const uint16_t *d,
                             const uint16_t *m, float *y, int64_t t0, int64_t t1) {
    int64_t nb = a->k / QK;
    int32_t sums[AMX_BLOCKS * ROWS_AMX * TILE] __attribute__((aligned(64)));
    uint8_t wbuf[AMX_BLOCKS * 512] __attribute__((aligned(64)));
    AMX_ROW_GROUPS(q4_tile_amx, q + t * nb * 256, d + t * nb * TILE, m + t * nb * TILE,
                   y + t * TILE, sums, wbuf)
}

static AMX void q8_tiles_amx(const Activations *a, const uint8_t *q, const float *d, float *y,
                             int64_t t0, int64_t t1) {
    int64_t nb = a->k / QK;
    int32_t sums[AMX_BLOCKS * ROWS_AMX * TILE] __attribute__((aligned(64)));
    AMX_ROW_GROUPS(q8_tile_amx, q + t * nb * 512, d + t * nb * TILE, y + t * TILE, sums)
}
#endif
