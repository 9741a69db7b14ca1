/* Decode and verify attention over per-session KV slots: one call per layer for every
 * session of a forward, instead of one scaled_dot_product_attention call per session and
 * layer. See native_attention.py for why, how it is built and when it is used.
 *
 * Layouts (bfloat16 as uint16_t):
 *   slot b:  [layers, 2, H_kv, cap[b], D] contiguous (LlamaEngine._reserve); K then V
 *   q:       row r, query head h at q + r * q_stride + h * D
 *   k_new:   row r, KV head h at k_new + r * k_stride + h * D  (likewise v_new)
 *   out:     [T, H, D] contiguous
 * Session b owns rows row0[b] .. row0[b] + n[b] - 1 (positions base[b] ..): its new keys
 * and values are written into its slot, then each query attends causally to positions
 * 0 .. base[b] + j (query j). Work items are (session, KV head), spread over n_threads
 * OpenMP threads (the runtime torch loaded, so the two share one pool).
 *
 * Scores are bf16 x bf16 products accumulated in float32 (AMX tiles, else vdpbf16ps); the
 * softmax is float32; the value sums are float32 FMAs, or for more than QUERY_BLOCK
 * queries AMX products of the weights split into two bf16 parts (16 of their 24 bits); the
 * output is rounded to bfloat16 (nearest even). Against float64, as accurate as torch's
 * CPU flash attention on the same inputs.
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define MAX_CHUNKS 8 /* D up to 256 */

/* AMX, where the compiler targets it and the kernel lets this process use tile data (an
 * arch_prctl request; oneDNN makes the same one): each 16-key block's scores for 16
 * queries are then two tile products instead of 32 vdpbf16ps per query. */
static int amx_state = -1; /* -1 unknown, 0 off, 1 on */

int asymspec_attention_uses_amx(void) {
#if HAVE_AMX
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                           18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_state;
#else
    return 0;
#endif
}

/* Tests compare both score paths on the same inputs. */
void asymspec_attention_allow_amx(int allow) {
    amx_state = allow ? -1 : 0;
}

#if HAVE_AMX
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* All eight tiles 16 rows x 64 bytes. Scores: tmm0 16 queries x 16 keys (float32), tmm1
 * 16 queries x 32 dimensions, tmm2 16 pairs of dimensions x 16 keys (the transposed block:
 * AMX's pair-interleaved B). Values: tmm0-3 16 queries x 64 dimensions (float32), tmm4
 * and tmm5 the weights' high and low bf16 parts for 16 queries x 32 keys, tmm6 16 pairs
 * of keys x 16 dimensions. */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif
#define QUERY_BLOCK 6 /* queries whose outputs stay in registers through the value pass */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline __m512 bf16x16_to_f32(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 rows of 16 dwords, transposed in place: r[i] lane j <-> r[j] lane i. */
static inline void transpose_16x16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    /* b[4k + j], 128-bit lane l: rows 4k .. 4k + 3 of column 4l + j */
    for (int j = 0; j < 4; j++) {
        const __m512i x0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88);
        const __m512i x1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
        const __m512i y0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

#if HAVE_AMX
/* Output rows = weights x V on tiles, 16 queries and 64 dimensions at a time. Each weight
 * goes in as two bf16 parts (hi = bf16(w), lo = bf16(w - hi)), both multiplied and summed
 * in float32: 16 of its 24 bits, where one part alone would keep 8 and lose accuracy
 * against torch's float32 weights. V's rows are interleaved in pairs of keys per
 * dimension (AMX's B layout) once per 32-key block, for all query groups. */
static void weigh_values_amx(int nq, int padded, const uint16_t* V, int64_t L, const int D,
                             const float* S, int64_t stride, uint16_t* P, uint16_t* pairs,
                             uint16_t* const* out_rows) {
    /* the weights' parts: P rows [hi (stride), lo (stride)] per query, padding included */
    for (int i = 0; i < padded; i++)
        for (int64_t t = 0; t < stride; t += 16) {
            const __m512 w = _mm512_loadu_ps(S + i * stride + t);
            const __m256bh hi = _mm512_cvtneps_pbh(w);
            const __m512 back = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
            _mm256_storeu_si256((__m256i*)(P + 2 * i * stride + t), (__m256i)hi);
            _mm256_storeu_si256((__m256i*)(P + (2 * i + 1) * stride + t),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(w, back)));
        }
    /* element 2d of an interleaved row: key 2k's dimension d; 2d + 1: key 2k + 1's */
    __m512i low_index, high_index;
    {
        uint16_t lo[32], hi[32];
        for (int d = 0; d < 16; d++) {
            lo[2 * d] = (uint16_t)d;
            lo[2 * d + 1] = (uint16_t)(32 + d);
            hi[2 * d] = (uint16_t)(16 + d);
            hi[2 * d + 1] = (uint16_t)(48 + d);
        }
        low_index = _mm512_loadu_si512(lo);
        high_index = _mm512_loadu_si512(hi);
    }
    static const uint16_t zero_row[32 * MAX_CHUNKS];
    float o[16 * 64];
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int tiles = D - d0 < 64 ? (D - d0) / 16 : 4;
        for (int q0 = 0; q0 < nq; q0 += 16) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t t0 = 0; t0 < L; t0 += 32) {
                if (q0 == 0) /* the block's pairs: pairs[j] is tile j's 16 rows x 32 */
                    for (int k = 0; k < 16; k++) {
                        const int64_t t = t0 + 2 * k;
                        const uint16_t* r0 = t < L ? V + t * D + d0 : zero_row;
                        const uint16_t* r1 = t + 1 < L ? V + (t + 1) * D + d0 : zero_row;
                        for (int c = 0; c < tiles; c += 2) {
                            const __m512i a = _mm512_loadu_si512(r0 + 16 * c);
                            const __m512i b = _mm512_loadu_si512(r1 + 16 * c);
                            _mm512_storeu_si512(pairs + ((t0 / 32) * 4 + c) * 512 + k * 32,
                                                _mm512_permutex2var_epi16(a, low_index, b));
                            _mm512_storeu_si512(pairs + ((t0 / 32) * 4 + c + 1) * 512 + k * 32,
                                                _mm512_permutex2var_epi16(a, high_index, b));
                        }
                    }
                /* query i's hi row starts at P + 2 i stride: rows 4 stride bytes apart */
                _tile_loadd(4, P + 2 * q0 * stride + t0, (long)stride * 4);
                _tile_loadd(5, P + (2 * q0 + 1) * stride + t0, (long)stride * 4);
                const uint16_t* block = pairs + (t0 / 32) * 4 * 512;
                /* tile numbers must be constants: one line per output tile */
                _tile_loadd(6, block, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(0, 5, 6);
                if (tiles > 1) {
                    _tile_loadd(6, block + 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (tiles > 2) {
                    _tile_loadd(6, block + 2 * 512, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (tiles > 3) {
                    _tile_loadd(6, block + 3 * 512, 64);
                    _tile_dpbf16ps(3, 4, 6);
                    _tile_dpbf16ps(3, 5, 6);
                }
            }
            _tile_stored(0, o, 256);
            _tile_stored(1, o + 16, 256);
            _tile_stored(2, o + 32, 256);
            _tile_stored(3, o + 48, 256);
            for (int i = 0; i < 16 && q0 + i < nq; i++)
                for (int d = 0; d < 16 * tiles; d++) out_rows[q0 + i][d0 + d] = f32_to_bf16(o[i * 64 + d]);
        }
    }
}
#endif

/* One (session, KV head): nq = g * n queries, row j * g + m is query j of group member m.
 * S holds nq rows (rounded up to 16) of L rounded up to 32 floats. AMX only: Q the
 * queries' rows back to back, as many; P twice S's count of bf16 weights; pairs
 * (L / 32 rounded up) x 2048 bf16 of interleaved values. Scores are unscaled until the
 * softmax. */
static inline __attribute__((always_inline)) void attend_item(
    const uint16_t* const* q_rows, int nq, int g, const uint16_t* K, const uint16_t* V,
    int64_t base, int64_t L, const int D, float scale, float* S, const uint16_t* Q,
    uint16_t* P, uint16_t* pairs, int amx, uint16_t* const* out_rows) {
    const int chunks = D / 32, lanes = D / 16;
    const int64_t stride = (L + 31) / 32 * 32;
    /* Scores, 16 keys at a time: the block's keys transposed into pairs of dimensions
     * (kt[p] lane t = dimensions 2p, 2p + 1 of key t), so that each query's 16 scores
     * accumulate lane-wise from its broadcast pairs, with no horizontal sums. */
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int rows = L - t0 < 16 ? (int)(L - t0) : 16;
        __m512i kt[16 * MAX_CHUNKS];
        /* The keys two blocks on, fetched while this block computes: the loop's work per
         * block is too long for the core to run ahead into the next block's misses. */
        for (int t = 0; t < 16 && t0 + 32 + t < L; t++)
            for (int c = 0; c < D; c += 32) _mm_prefetch((const char*)(K + (t0 + 32 + t) * D + c), _MM_HINT_T0);
        for (int c = 0; c < chunks; c++) {
            __m512i r[16];
            for (int t = 0; t < 16; t++)
                r[t] = t < rows ? _mm512_loadu_si512(K + (t0 + t) * D + 32 * c) : _mm512_setzero_si512();
            transpose_16x16(r);
            for (int p = 0; p < 16; p++) kt[16 * c + p] = r[p];
        }
#if HAVE_AMX
        if (amx) {
            for (int i = 0; i < nq; i += 16) {
                _tile_zero(0);
                for (int c = 0; c < chunks; c++) {
                    _tile_loadd(1, Q + (int64_t)i * D + 32 * c, D * 2);
                    _tile_loadd(2, &kt[16 * c], 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, S + i * stride + t0, stride * 4);
            }
            continue;
        }
#else
        (void)Q;
        (void)P;
        (void)pairs;
        (void)amx;
#endif
        /* Four queries at a time, two accumulators each: eight independent chains of
         * vdpbf16ps, whose latency would otherwise bind (q_rows has nq rounded up to 4
         * entries, the last repeated, and S as many rows). */
        for (int i = 0; i < nq; i += 4) {
            const uint32_t* q0 = (const uint32_t*)q_rows[i];
            const uint32_t* q1 = (const uint32_t*)q_rows[i + 1];
            const uint32_t* q2 = (const uint32_t*)q_rows[i + 2];
            const uint32_t* q3 = (const uint32_t*)q_rows[i + 3];
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int p = 0; p < D / 2; p += 2) {
                const __m512bh even = (__m512bh)kt[p], odd = (__m512bh)kt[p + 1];
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32((int)q0[p]), even);
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32((int)q1[p]), even);
                a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_set1_epi32((int)q2[p]), even);
                a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_set1_epi32((int)q3[p]), even);
                b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_set1_epi32((int)q0[p + 1]), odd);
                b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_set1_epi32((int)q1[p + 1]), odd);
                b2 = _mm512_dpbf16_ps(b2, (__m512bh)_mm512_set1_epi32((int)q2[p + 1]), odd);
                b3 = _mm512_dpbf16_ps(b3, (__m512bh)_mm512_set1_epi32((int)q3[p + 1]), odd);
            }
            _mm512_storeu_ps(S + (i + 0) * stride + t0, _mm512_add_ps(a0, b0));
            _mm512_storeu_ps(S + (i + 1) * stride + t0, _mm512_add_ps(a1, b1));
            _mm512_storeu_ps(S + (i + 2) * stride + t0, _mm512_add_ps(a2, b2));
            _mm512_storeu_ps(S + (i + 3) * stride + t0, _mm512_add_ps(a3, b3));
        }
    }
    for (int i = 0; i < nq; i++) {
        const int64_t seen = base + i / g + 1; /* causal: positions 0 .. base + j */
        float* s = S + i * stride;
        float top = -FLT_MAX; /* finite: built with -ffast-math */
        for (int64_t t = 0; t < seen; t++) top = s[t] > top ? s[t] : top;
        float sum = 0.f;
        for (int64_t t = 0; t < seen; t++) {
            const float e = expf((s[t] - top) * scale);
            s[t] = e;
            sum += e;
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < seen; t++) s[t] *= inv;
        for (int64_t t = seen; t < stride; t++) s[t] = 0.f;
    }
#if HAVE_AMX
    if (amx && nq > QUERY_BLOCK) { /* one FMA pass is faster for a block or less */
        weigh_values_amx(nq, (nq + 15) / 16 * 16, V, L, D, S, stride, P, pairs, out_rows);
        return;
    }
#endif
    for (int q0 = 0; q0 < nq; q0 += QUERY_BLOCK) {
        const int block = nq - q0 < QUERY_BLOCK ? nq - q0 : QUERY_BLOCK;
        __m512 acc[QUERY_BLOCK][2 * MAX_CHUNKS];
        for (int i = 0; i < QUERY_BLOCK; i++)
            for (int f = 0; f < lanes; f++) acc[i][f] = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t++) {
            if (t + 24 < L)
                for (int c = 0; c < D; c += 32) _mm_prefetch((const char*)(V + (t + 24) * D + c), _MM_HINT_T0);
            __m512 v[2 * MAX_CHUNKS];
            for (int f = 0; f < lanes; f++) v[f] = bf16x16_to_f32(V + t * D + 16 * f);
            for (int i = 0; i < QUERY_BLOCK && i < block; i++) {
                const __m512 p = _mm512_set1_ps(S[(q0 + i) * stride + t]);
                for (int f = 0; f < lanes; f++) acc[i][f] = _mm512_fmadd_ps(p, v[f], acc[i][f]);
            }
        }
        for (int i = 0; i < block; i++) {
            float o[32 * MAX_CHUNKS];
            for (int f = 0; f < lanes; f++) _mm512_storeu_ps(o + 16 * f, acc[i][f]);
            for (int d = 0; d < D; d++) out_rows[q0 + i][d] = f32_to_bf16(o[d]);
        }
    }
}

/* The head size as a constant where it is common, so the compiler keeps the value pass's
 * accumulators in registers. */
static void attend_item_any(const uint16_t* const* q_rows, int nq, int g, const uint16_t* K,
                            const uint16_t* V, int64_t base, int64_t L, int D, float scale,
                            float* S, const uint16_t* Q, uint16_t* P, uint16_t* pairs, int amx,
                            uint16_t* const* out_rows) {
    if (D == 64)
        attend_item(q_rows, nq, g, K, V, base, L, 64, scale, S, Q, P, pairs, amx, out_rows);
    else if (D == 128)
        attend_item(q_rows, nq, g, K, V, base, L, 128, scale, S, Q, P, pairs, amx, out_rows);
    else
        attend_item(q_rows, nq, g, K, V, base, L, D, scale, S, Q, P, pairs, amx, out_rows);
}

/* 0 on success; -1 for a head size this kernel does not take; -2 when memory ran out. */
int asymspec_attend_bf16(int n_sessions, const int64_t* row0, const int64_t* n,
                         const int64_t* base, const int64_t* slots, const int64_t* cap,
                         int layer, const uint16_t* q, int64_t q_stride, const uint16_t* k_new,
                         int64_t k_stride, const uint16_t* v_new, int64_t v_stride,
                         uint16_t* out, int H, int H_kv, int D, float scale, int n_threads) {
    if (D % 32 != 0 || D > 32 * MAX_CHUNKS || H % H_kv != 0) return -1;
    const int g = H / H_kv, amx = asymspec_attention_uses_amx();
    for (int b = 0; b < n_sessions; b++) {
        uint16_t* slot = (uint16_t*)slots[b] + (int64_t)layer * 2 * H_kv * cap[b] * D;
        for (int64_t j = 0; j < n[b]; j++) {
            const int64_t r = row0[b] + j, pos = base[b] + j;
            for (int h = 0; h < H_kv; h++) {
                memcpy(slot + ((int64_t)h * cap[b] + pos) * D, k_new + r * k_stride + (int64_t)h * D,
                       (size_t)D * 2);
                memcpy(slot + ((int64_t)(H_kv + h) * cap[b] + pos) * D,
                       v_new + r * v_stride + (int64_t)h * D, (size_t)D * 2);
            }
        }
    }
    const int items = n_sessions * H_kv;
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        float* S = NULL;
        uint16_t* Q = NULL;
        const uint16_t** q_rows = NULL;
        uint16_t** out_rows = NULL;
        int64_t s_capacity = 0, rows_capacity = 0;
#if HAVE_AMX
        if (amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            const int b = it / H_kv, h = it % H_kv;
            const int64_t L = base[b] + n[b];
            const int nq = (int)(g * n[b]), padded = (nq + 15) / 16 * 16;
            if (padded * (L + 31) > s_capacity) {
                /* S (4 bytes each), then (AMX) P (2 x 2 bytes) and the interleaved values:
                 * 4096 bytes per 32 keys <= 8 bytes per S entry, as padded >= 16. */
                free(S);
                s_capacity = padded * (L + 31);
                S = malloc(16 * (size_t)s_capacity);
            }
            if (padded > rows_capacity) {
                free(Q);
                free(q_rows);
                free(out_rows);
                rows_capacity = padded;
                Q = calloc((size_t)padded * (size_t)D, sizeof(uint16_t));
                q_rows = malloc(sizeof(void*) * (size_t)padded);
                out_rows = malloc(sizeof(void*) * (size_t)padded);
            }
            if (S == NULL || Q == NULL || q_rows == NULL || out_rows == NULL) {
#pragma omp atomic write
                failed = 1;
                s_capacity = rows_capacity = 0;
                continue;
            }
            for (int64_t j = 0; j < n[b]; j++)
                for (int m = 0; m < g; m++) {
                    const int64_t r = row0[b] + j, head = (int64_t)h * g + m;
                    q_rows[j * g + m] = q + r * q_stride + head * D;
                    out_rows[j * g + m] = out + (r * H + head) * D;
                }
            for (int i = nq; i < padded; i++) q_rows[i] = q_rows[nq - 1];
            if (amx) /* the tile loads want the queries' rows at one stride */
                for (int i = 0; i < padded; i++) memcpy(Q + (int64_t)i * D, q_rows[i], (size_t)D * 2);
            const uint16_t* slot = (const uint16_t*)slots[b] + (int64_t)layer * 2 * H_kv * cap[b] * D;
            const uint16_t* K = slot + (int64_t)h * cap[b] * D;
            const uint16_t* V = slot + (int64_t)(H_kv + h) * cap[b] * D;
            uint16_t* P = (uint16_t*)(S + s_capacity);
            uint16_t* pairs = P + 2 * s_capacity;
            attend_item_any(q_rows, nq, g, K, V, base[b], L, D, scale, S, Q, P, pairs, amx,
                            out_rows);
        }
#if HAVE_AMX
        if (amx) _tile_release(); /* oneDNN configures the tiles afresh for its own kernels */
#endif
        free(S);
        free(Q);
        free(q_rows);
        free(out_rows);
    }
    return failed ? -2 : 0;
}
