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
/* The permutations that interleave two rows of 32 bf16 values a and b for AMX's B layout:
 * (a, low, b) gives a[0], b[0], a[1], b[1] .. a[15], b[15]; (a, high, b) the same from
 * element 16 on. */
static inline void pair_indices(__m512i* low, __m512i* high) {
    uint16_t lo[32], hi[32];
    for (int d = 0; d < 16; d++) {
        lo[2 * d] = (uint16_t)d;
        lo[2 * d + 1] = (uint16_t)(32 + d);
        hi[2 * d] = (uint16_t)(16 + d);
        hi[2 * d + 1] = (uint16_t)(48 + d);
    }
    *low = _mm512_loadu_si512(lo);
    *high = _mm512_loadu_si512(hi);
}

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
    pair_indices(&low_index, &high_index);
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

/* Each session's new keys and values (rows row0[b] .. + n[b] - 1) into layer `layer` of its
 * slot, at positions base[b] .. */
static void write_new_keys_values(int n_sessions, const int64_t* row0, const int64_t* n,
                                  const int64_t* base, const int64_t* slots, const int64_t* cap,
                                  int layer, const uint16_t* k_new, int64_t k_stride,
                                  const uint16_t* v_new, int64_t v_stride, int H_kv, int D) {
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
}

/* 0 on success; -1 for a head size this kernel does not take; -2 when memory ran out. */
int asymspec_attend_bf16(int n_sessions, const int64_t* row0, const int64_t* n,
                         const int64_t* base, const int64_t* slots, const int64_t* cap,
                         int layer, const uint16_t* q, int64_t q_stride, const uint16_t* k_new,
                         int64_t k_stride, const uint16_t* v_new, int64_t v_stride,
                         uint16_t* out, int H, int H_kv, int D, float scale, int n_threads) {
    if (D % 32 != 0 || D > 32 * MAX_CHUNKS || H % H_kv != 0) return -1;
    const int g = H / H_kv, amx = asymspec_attention_uses_amx();
    write_new_keys_values(n_sessions, row0, n, base, slots, cap, layer, k_new, k_stride, v_new,
                          v_stride, H_kv, D);
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

/* ------------------------------------------------------------------------------ prefill
 * Prefill chunks: sessions with many new queries. Work items are (session, query head,
 * 16 consecutive new positions), the latest positions first (they see the most keys), so
 * a chunk of 256 tokens gives 16 x H items where the decode path above would give H_kv.
 * Each session's keys and values are first laid out once per call in AMX's B layout (keys
 * transposed into pairs of dimensions per 16-key block, values interleaved in pairs of
 * keys per 32-key block), read by every query block of their KV head's group. An item
 * then takes all its scores (16 x visible keys, float32, in L2), a float32 softmax whose
 * weights are rounded to bf16 (as torch's flash kernel rounds them for its bf16 value
 * product), and the value products over every visible key at once, so no accumulator is
 * ever rescaled; the float32 sums are divided by the softmax sums and rounded to bf16. */
#if HAVE_AMX
/* e^x (x <= 0 here) in 16 lanes: 2^n e^r, n = round(x log2 e), r = x - n ln 2 (ln 2 in two
 * parts, |r| <= ln 2 / 2), e^r by its Taylor polynomial to r^5: relative error < 3.5e-6
 * (~19 bits, as torch's exp_u20 that its flash kernel uses), far inside the 2^-9 of the
 * bf16 weights it feeds. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 120);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* Keys [L, D] -> kt: per 16-key block and 32-dimension chunk a 16 x 32 tile whose row p
 * holds the block's keys' dimensions 2p, 2p + 1 (chunk-relative); keys past L are zero. */
static void lay_out_keys(const uint16_t* K, int64_t L, int D, int64_t block16, uint16_t* kt) {
    const int chunks = D / 32;
    for (int c = 0; c < chunks; c++) {
        __m512i r[16];
        for (int t = 0; t < 16; t++) {
            const int64_t key = block16 * 16 + t;
            r[t] = key < L ? _mm512_loadu_si512(K + key * D + 32 * c) : _mm512_setzero_si512();
        }
        transpose_16x16(r);
        uint16_t* tile = kt + (block16 * chunks + c) * 512;
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(tile + 32 * p, r[p]);
    }
}

/* Values [L, D] -> vp: per 32-key block and 16 dimensions a 16 x 32 tile whose row k
 * interleaves keys 2k and 2k + 1 dimension by dimension; keys past L are zero. */
static void lay_out_values(const uint16_t* V, int64_t L, int D, int64_t block32, uint16_t* vp) {
    static const uint16_t zero_row[32 * MAX_CHUNKS];
    __m512i low_index, high_index;
    pair_indices(&low_index, &high_index);
    const int lanes = D / 16;
    for (int k = 0; k < 16; k++) {
        const int64_t t = block32 * 32 + 2 * k;
        const uint16_t* r0 = t < L ? V + t * D : zero_row;
        const uint16_t* r1 = t + 1 < L ? V + (t + 1) * D : zero_row;
        for (int f = 0; f < lanes; f += 2) {
            const __m512i a = _mm512_loadu_si512(r0 + 16 * f);
            const __m512i b = _mm512_loadu_si512(r1 + 16 * f);
            _mm512_storeu_si512(vp + ((block32 * lanes + f) * 16 + k) * 32,
                                _mm512_permutex2var_epi16(a, low_index, b));
            _mm512_storeu_si512(vp + ((block32 * lanes + f + 1) * 16 + k) * 32,
                                _mm512_permutex2var_epi16(a, high_index, b));
        }
    }
}

/* One item: 16 query rows (rows of them real) at positions first .. first + 15, seeing
 * keys 0 .. first + i. qs: their rows, q_step elements apart. S: 16 x stride floats; P: 16
 * x stride bf16, stride >= the visible keys rounded up to 64. out_row(i) = out + i * o_step. */
static inline __attribute__((always_inline)) void prefill_block(
    const uint16_t* qs, int64_t q_step, int rows, int64_t first, const int D,
    const uint16_t* kt, const uint16_t* vp, float scale, float* S, uint16_t* P, uint16_t* out,
    int64_t o_step) {
    const int chunks = D / 32, lanes = D / 16;
    const int64_t seen_max = first + rows, blocks = (seen_max + 63) / 64, stride = blocks * 64;
    const int64_t sub = (int64_t)chunks * 512; /* one 16-key block of kt */
    /* Scores, 64 keys a step. Up to 64 dimensions: tiles 1-2 the queries' chunks, 0, 3, 4
     * and 7 the four 16-key blocks' sums (four independent chains), 5 and 6 keys. Up to
     * 128: tiles 1-4 the chunks, two 16-key blocks at a time in 0 and 7. */
    _tile_loadd(1, qs, q_step * 2);
    if (chunks > 1) _tile_loadd(2, qs + 32, q_step * 2);
    if (chunks > 2) _tile_loadd(3, qs + 64, q_step * 2);
    if (chunks > 3) _tile_loadd(4, qs + 96, q_step * 2);
    __m512 top[16];
    for (int i = 0; i < 16; i++) top[i] = _mm512_set1_ps(-FLT_MAX);
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t* k = kt + 4 * b * sub;
        float* s = S + 64 * b;
        if (chunks <= 2) {
            _tile_zero(0);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(7);
            _tile_loadd(5, k, 64);
            _tile_dpbf16ps(0, 1, 5);
            _tile_loadd(6, k + sub, 64);
            _tile_dpbf16ps(3, 1, 6);
            _tile_loadd(5, k + 2 * sub, 64);
            _tile_dpbf16ps(4, 1, 5);
            _tile_loadd(6, k + 3 * sub, 64);
            _tile_dpbf16ps(7, 1, 6);
            if (chunks > 1) {
                _tile_loadd(5, k + 512, 64);
                _tile_dpbf16ps(0, 2, 5);
                _tile_loadd(6, k + sub + 512, 64);
                _tile_dpbf16ps(3, 2, 6);
                _tile_loadd(5, k + 2 * sub + 512, 64);
                _tile_dpbf16ps(4, 2, 5);
                _tile_loadd(6, k + 3 * sub + 512, 64);
                _tile_dpbf16ps(7, 2, 6);
            }
            _tile_stored(0, s, stride * 4);
            _tile_stored(3, s + 16, stride * 4);
            _tile_stored(4, s + 32, stride * 4);
            _tile_stored(7, s + 48, stride * 4);
        } else {
            for (int half = 0; half < 2; half++) {
                const uint16_t* k0 = k + 2 * half * sub;
                const uint16_t* k1 = k0 + sub;
                _tile_zero(0);
                _tile_zero(7);
                _tile_loadd(5, k0, 64);
                _tile_loadd(6, k1, 64);
                _tile_dpbf16ps(0, 1, 5);
                _tile_dpbf16ps(7, 1, 6);
                _tile_loadd(5, k0 + 512, 64);
                _tile_loadd(6, k1 + 512, 64);
                _tile_dpbf16ps(0, 2, 5);
                _tile_dpbf16ps(7, 2, 6);
                _tile_loadd(5, k0 + 1024, 64);
                _tile_loadd(6, k1 + 1024, 64);
                _tile_dpbf16ps(0, 3, 5);
                _tile_dpbf16ps(7, 3, 6);
                if (chunks > 3) {
                    _tile_loadd(5, k0 + 1536, 64);
                    _tile_loadd(6, k1 + 1536, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(7, 4, 6);
                }
                _tile_stored(0, s + 32 * half, stride * 4);
                _tile_stored(7, s + 32 * half + 16, stride * 4);
            }
        }
        /* each row's running maximum over its visible keys, while the block is in L1 */
        const int64_t key0 = 64 * b;
        for (int i = 0; i < 16; i++) {
            const int64_t seen = first + i + 1 - key0; /* of this block's 64 */
            const float* r = s + i * stride;
            if (seen >= 64) {
                top[i] = _mm512_max_ps(top[i], _mm512_max_ps(
                    _mm512_max_ps(_mm512_loadu_ps(r), _mm512_loadu_ps(r + 16)),
                    _mm512_max_ps(_mm512_loadu_ps(r + 32), _mm512_loadu_ps(r + 48))));
            } else {
                for (int64_t t = 0; t < seen; t += 16) {
                    const __mmask16 m = seen - t >= 16 ? 0xffff : (__mmask16)((1u << (seen - t)) - 1);
                    top[i] = _mm512_mask_max_ps(top[i], m, top[i], _mm512_loadu_ps(r + t));
                }
            }
        }
    }
    /* softmax, row by row over its visible keys; weights past them (and rows past `rows`)
     * are zero, so the value products can run over whole blocks */
    float inv_sum[16];
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int i = 0; i < 16; i++) {
        uint16_t* p = P + i * stride;
        if (i >= rows) {
            memset(p, 0, (size_t)stride * 2);
            continue;
        }
        const float* s = S + i * stride;
        const int64_t seen = first + i + 1, whole = seen / 16 * 16;
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top[i]) * scale);
        __m512 sum = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t < whole; t += 16) {
            const __m512 e = exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), scale_v, shift));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i*)(p + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (t < seen) {
            const __mmask16 m = (__mmask16)((1u << (seen - t)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(
                m, exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), scale_v, shift)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i*)(p + t), (__m256i)_mm512_cvtneps_pbh(e));
            t += 16;
        }
        for (; t < stride; t += 16) _mm256_storeu_si256((__m256i*)(p + t), _mm256_setzero_si256());
        inv_sum[i] = 1.f / _mm512_reduce_add_ps(sum);
    }
    /* values: tiles 0-3 64 output dimensions, 4 the weights, 5 and 6 values */
    float o[16 * 64];
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int tiles = D - d0 < 64 ? (D - d0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < stride / 32; b++) {
            const uint16_t* block = vp + (b * lanes + d0 / 16) * 512;
            _tile_loadd(4, P + 32 * b, stride * 2);
            _tile_loadd(5, block, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (tiles > 1) {
                _tile_loadd(6, block + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (tiles > 2) {
                _tile_loadd(5, block + 1024, 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (tiles > 3) {
                _tile_loadd(6, block + 1536, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, o, 256);
        _tile_stored(1, o + 16, 256);
        _tile_stored(2, o + 32, 256);
        _tile_stored(3, o + 48, 256);
        for (int i = 0; i < rows; i++) {
            const __m512 inv = _mm512_set1_ps(inv_sum[i]);
            for (int f = 0; f < tiles; f++)
                _mm256_storeu_si256(
                    (__m256i*)(out + i * o_step + d0 + 16 * f),
                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + i * 64 + 16 * f), inv)));
        }
    }
}

static void prefill_block_any(const uint16_t* qs, int64_t q_step, int rows, int64_t first, int D,
                              const uint16_t* kt, const uint16_t* vp, float scale, float* S,
                              uint16_t* P, uint16_t* out, int64_t o_step) {
    if (D == 64)
        prefill_block(qs, q_step, rows, first, 64, kt, vp, scale, S, P, out, o_step);
    else
        prefill_block(qs, q_step, rows, first, D, kt, vp, scale, S, P, out, o_step);
}
#endif

/* The widest head the prefill path takes: a query block's chunks fill tiles 1-4. */
#define PREFILL_MAX_HEAD_DIM 128

int asymspec_prefill_max_head_dim(void) { return PREFILL_MAX_HEAD_DIM; }

/* The arguments of asymspec_attend_bf16, for sessions with many new tokens each. 0 on
 * success; -1 for shapes this kernel does not take (or no AMX); -2 when memory ran out. */
int asymspec_prefill_bf16(int n_sessions, const int64_t* row0, const int64_t* n,
                          const int64_t* base, const int64_t* slots, const int64_t* cap,
                          int layer, const uint16_t* q, int64_t q_stride,
                          const uint16_t* k_new, int64_t k_stride, const uint16_t* v_new,
                          int64_t v_stride, uint16_t* out, int H, int H_kv, int D, float scale,
                          int n_threads) {
#if HAVE_AMX
    if (D % 32 != 0 || D > PREFILL_MAX_HEAD_DIM || H % H_kv != 0) return -1;
    if (!asymspec_attention_uses_amx()) return -1;
    const int g = H / H_kv;
    write_new_keys_values(n_sessions, row0, n, base, slots, cap, layer, k_new, k_stride, v_new,
                          v_stride, H_kv, D);
    /* per (session, KV head): its keys and values in the tiles' layouts, each
     * ceil(L / 64) x 64 x D bf16; items_before[b]: query-block items of earlier sessions */
    int64_t* layout_at = malloc(sizeof(int64_t) * (size_t)(n_sessions + 1));
    int64_t* blocks_before = malloc(sizeof(int64_t) * (size_t)(n_sessions + 1));
    int64_t* items_before = malloc(sizeof(int64_t) * (size_t)(n_sessions + 1));
    if (layout_at == NULL || blocks_before == NULL || items_before == NULL) {
        free(layout_at);
        free(blocks_before);
        free(items_before);
        return -2;
    }
    int64_t longest = 0;
    layout_at[0] = blocks_before[0] = items_before[0] = 0;
    for (int b = 0; b < n_sessions; b++) {
        const int64_t L = base[b] + n[b], blocks = (L + 63) / 64;
        longest = L > longest ? L : longest;
        layout_at[b + 1] = layout_at[b] + (int64_t)H_kv * blocks * 64 * D;
        blocks_before[b + 1] = blocks_before[b] + (int64_t)H_kv * blocks;
        items_before[b + 1] = items_before[b] + (int64_t)H * ((n[b] + 15) / 16);
    }
    uint16_t* kt_all = malloc(2 * sizeof(uint16_t) * (size_t)layout_at[n_sessions]);
    if (kt_all == NULL) {
        free(layout_at);
        free(blocks_before);
        free(items_before);
        return -2;
    }
    uint16_t* vp_all = kt_all + layout_at[n_sessions];
    const int64_t stride_max = (longest + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < blocks_before[n_sessions]; it++) {
            int b = 0;
            while (blocks_before[b + 1] <= it) b++;
            const int64_t L = base[b] + n[b], blocks = (L + 63) / 64;
            const int h = (int)((it - blocks_before[b]) / blocks);
            const int64_t block = (it - blocks_before[b]) % blocks;
            const uint16_t* slot = (const uint16_t*)slots[b] + (int64_t)layer * 2 * H_kv * cap[b] * D;
            const int64_t at = layout_at[b] + (int64_t)h * blocks * 64 * D;
            for (int j = 0; j < 4; j++)
                lay_out_keys(slot + (int64_t)h * cap[b] * D, L, D, 4 * block + j, kt_all + at);
            for (int j = 0; j < 2; j++)
                lay_out_values(slot + (int64_t)(H_kv + h) * cap[b] * D, L, D, 2 * block + j,
                               vp_all + at);
        }
        float* S = malloc(sizeof(float) * 16 * (size_t)stride_max);
        uint16_t* P = malloc(sizeof(uint16_t) * 16 * (size_t)stride_max);
        uint16_t* Q = calloc(16 * (size_t)D, sizeof(uint16_t));
        if (S == NULL || P == NULL || Q == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* every thread reaches the loop (its implicit barrier), and skips its items when
         * it has no buffers */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items_before[n_sessions]; it++) {
            if (S == NULL || P == NULL || Q == NULL) continue;
            int b = 0;
            while (items_before[b + 1] <= it) b++;
            const int64_t blocks = (n[b] + 15) / 16, local = it - items_before[b];
            const int64_t qb = blocks - 1 - local / H; /* latest positions first */
            const int hd = (int)(local % H), h = hd / g;
            const int64_t j0 = qb * 16;
            const int rows = n[b] - j0 < 16 ? (int)(n[b] - j0) : 16;
            const uint16_t* qs = q + (row0[b] + j0) * q_stride + (int64_t)hd * D;
            int64_t q_step = q_stride;
            if (rows < 16) { /* the tile load reads 16 rows */
                memset(Q, 0, 16 * (size_t)D * 2);
                for (int i = 0; i < rows; i++) memcpy(Q + i * D, qs + i * q_stride, (size_t)D * 2);
                qs = Q;
                q_step = D;
            }
            const int64_t L = base[b] + n[b];
            const int64_t at = layout_at[b] + (int64_t)h * ((L + 63) / 64) * 64 * D;
            prefill_block_any(qs, q_step, rows, base[b] + j0, D, kt_all + at, vp_all + at, scale,
                              S, P, out + ((row0[b] + j0) * H + hd) * D, (int64_t)H * D);
        }
        _tile_release();
        free(S);
        free(P);
        free(Q);
    }
    free(kt_all);
    free(layout_at);
    free(blocks_before);
    free(items_before);
    return failed ? -2 : 0;
#else
    (void)n_sessions, (void)row0, (void)n, (void)base, (void)slots, (void)cap, (void)layer;
    (void)q, (void)q_stride, (void)k_new, (void)k_stride, (void)v_new, (void)v_stride;
    (void)out, (void)H, (void)H_kv, (void)D, (void)scale, (void)n_threads;
    return -1;
#endif
}
