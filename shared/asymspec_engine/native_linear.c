/* Native bf16 linear layers on AMX tiles: y[M, N] = x[M, K] W^T (+ bias), float32 sums.
 *
 * Why: oneDNN's packed bf16 products read the weights of SmolLM2-135M at 5-9 GB/s on this
 * machine class at 1-16 rows, against 10-21 GB/s its memory gives (1-2 threads), and a
 * decode step is little else (loadtest/results/native-linear/). This kernel streams each
 * weight tile from memory once per call, prefetched ahead, and reuses it for up to five
 * 16-row blocks of x held in L1/L2.
 *
 * Weights are packed once (asymspec_engine.native_linear.pack): for each block of 16
 * output columns, its K/32 tiles in order, each AMX's B layout [16 k-pairs][16 cols][2].
 * A thread owns a contiguous range of column blocks, so its weights are one stream.
 *
 * Rows: x is read in place, 16 rows a tile; a partial last block is copied to a
 * zero-padded buffer (AMX computes 16-row tiles, so padded rows cost what real ones do).
 * Columns: N need not be a multiple of 16 (a draft's restricted head); the packing pads
 * them with zeros and the stores are masked. K must be a multiple of 32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define ROW_BLOCKS 5 /* 16-row blocks of x per pass over a column block: tiles 0-4 */
#define PREFETCH_BYTES 2048 /* how far ahead of the tile being loaded the stream is fetched */

/* Whether this process may use AMX tile data (an arch_prctl request; oneDNN makes the
 * same one). 0 where the compiler did not target AMX. */
int asymspec_linear_uses_amx(void) {
#if HAVE_AMX
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
#else
    return 0;
#endif
}

#if HAVE_AMX
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-4 the sums of up to five row blocks (float32, 16 x 16), 5 a row block of x
 * (16 rows x 32 bf16), 7 a weight tile; all 16 rows x 64 bytes. */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* One row block's sums (tile `sums` stored to `out`) plus bias, rounded to bf16 (nearest
 * even) into `rows` rows of y at column `col`, `cols` (<= 16) of them. */
static inline void emit(const float* out, int64_t rows, const float* bias, int64_t col,
                        int cols, int64_t N, uint16_t* y) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(out + 16 * r), b);
        _mm256_mask_storeu_epi16(y + r * N + col, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

/* Returns 0, or 1 for unsupported shapes or no AMX, 2 when out of memory. */
int asymspec_linear_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed,
                         int64_t N, const float* bias, uint16_t* y, int threads) {
#if HAVE_AMX
    if (M < 1 || N < 1 || K < 32 || K % 32 != 0 || !asymspec_linear_uses_amx()) return 1;
    const int64_t col_blocks = (N + 15) / 16, k_tiles = K / 32;
    const int64_t row_blocks = (M + 15) / 16, last_rows = M - 16 * (row_blocks - 1);
    const int64_t x_stride = K * 2;
    uint16_t* padded = NULL; /* the last row block, zero-padded to 16 rows */
    if (last_rows < 16) {
        padded = aligned_alloc(64, (size_t)(16 * K * 2));
        if (!padded) return 2;
        memset(padded, 0, (size_t)(16 * K * 2));
        memcpy(padded, x + (row_blocks - 1) * 16 * K, (size_t)(last_rows * K * 2));
    }
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t first = col_blocks * id / nt, stop = col_blocks * (id + 1) / nt;
        float out[16 * 16] __attribute__((aligned(64)));
        for (int64_t cb = first; cb < stop; cb++) {
            const uint8_t* tiles = (const uint8_t*)(packed + cb * k_tiles * 512);
            const int cols = N - 16 * cb < 16 ? (int)(N - 16 * cb) : 16;
            for (int64_t rb0 = 0; rb0 < row_blocks; rb0 += ROW_BLOCKS) {
                const int count =
                    row_blocks - rb0 < ROW_BLOCKS ? (int)(row_blocks - rb0) : ROW_BLOCKS;
                const uint8_t* a[ROW_BLOCKS];
                for (int j = 0; j < count; j++) {
                    const int64_t rb = rb0 + j;
                    a[j] = (const uint8_t*)((rb == row_blocks - 1 && padded) ? padded
                                                                            : x + rb * 16 * K);
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_zero(4);
                for (int64_t kt = 0; kt < k_tiles; kt++) {
                    const uint8_t* b = tiles + kt * 1024;
                    if (rb0 == 0) /* later passes find the column block in cache */
                        for (int line = 0; line < 1024; line += 64)
                            _mm_prefetch((const char*)b + PREFETCH_BYTES + line, _MM_HINT_T0);
                    _tile_loadd(7, b, 64);
                    const int64_t k_byte = kt * 64;
                    /* tile numbers must be constants: one line per sum tile */
                    _tile_loadd(5, a[0] + k_byte, x_stride);
                    _tile_dpbf16ps(0, 5, 7);
                    if (count > 1) {
                        _tile_loadd(5, a[1] + k_byte, x_stride);
                        _tile_dpbf16ps(1, 5, 7);
                    }
                    if (count > 2) {
                        _tile_loadd(5, a[2] + k_byte, x_stride);
                        _tile_dpbf16ps(2, 5, 7);
                    }
                    if (count > 3) {
                        _tile_loadd(5, a[3] + k_byte, x_stride);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    if (count > 4) {
                        _tile_loadd(5, a[4] + k_byte, x_stride);
                        _tile_dpbf16ps(4, 5, 7);
                    }
                }
#define EMIT(j)                                                                    \
    if (count > j) {                                                               \
        const int64_t rb = rb0 + j;                                                \
        _tile_stored(j, out, 64);                                                  \
        emit(out, rb == row_blocks - 1 ? last_rows : 16, bias, 16 * cb, cols, N,   \
             y + rb * 16 * N);                                                     \
    }
                EMIT(0)
                EMIT(1)
                EMIT(2)
                EMIT(3)
                EMIT(4)
#undef EMIT
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)y, (void)threads;
    return 1;
#endif
}
