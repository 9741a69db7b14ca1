/* A decoder layer's pointwise work in bf16, fused: RMSNorm (with the residual add before
 * it), the rotary embedding, and SiLU(gate) * up.
 *
 * Why: in torch each is 2-5 ops, ~17 a layer, each paying dispatch and an OpenMP fork on a
 * few kilobytes of data; at 16 to 80 rows they cost as much as a quarter of a forward
 * (loadtest/results/native-linear/). Here each is one call, one thread, one pass.
 *
 * The roundings are torch's on the same bf16 tensors, op by op, so the results are the
 * ones transformers' Llama computes in bf16 up to float32 evaluation order: the norm's
 * variance and scale in float32 then rounded, the weight product rounded; the rotary's
 * two products and their sum each rounded; SiLU in float32 rounded, then the product.
 *
 * The norms and SiLU split a call with at least PARALLEL_ELEMENTS elements by rows over
 * n_threads OpenMP threads (torch's pool: the library is loaded after torch); a smaller
 * call runs on the calling thread, where the fork would cost more than the second thread
 * saves. Every row is computed the same way either way. The rotary runs on the calling
 * thread: at 80 rows two threads did not beat one (loadtest/results/native-prefill/).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ELEMENTS 16384

/* Runs body(first, last) over rows 0 .. rows - 1: in contiguous ranges on n_threads threads
 * where the call is large enough, else in one range here. Not `omp parallel for if (...)`:
 * a false if-clause still opens a one-thread team, ~0.5 us a call (2.4 -> 2.9 us for a
 * one-row norm), ~90 calls a forward. */
#define SPLIT_ROWS(rows, elements, n_threads, body)                                          \
    do {                                                                                     \
        if ((elements) >= PARALLEL_ELEMENTS && (n_threads) > 1) {                            \
            _Pragma("omp parallel num_threads(n_threads)") {                                 \
                const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();       \
                body((rows) * me / team, (rows) * (me + 1) / team);                          \
            }                                                                                \
        } else {                                                                             \
            body(0, (rows));                                                                 \
        }                                                                                    \
    } while (0)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

static inline __m512 load16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* vcvtneps2bf16 rounds to nearest even, as torch does (for normal numbers; it flushes
 * float32 subnormals, below 1.2e-38, which activations do not reach). */
static inline __m256i to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline __m512 round16(__m512 v) {
    const __m512i wide = _mm512_cvtepu16_epi32(to_bf16x16(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, to_bf16x16(v)); }
#else
#define HAVE_AVX512_BF16 0
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch does (inputs here are finite). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static void norm_row(const uint16_t* x, int64_t H, const uint16_t* w, float eps, uint16_t* out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < H; i++) {
        const float v = bf16_to_f32(x[i]);
        sum += v * v;
    }
    const float scale = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t i = 0; i < H; i++) {
        const float normed = round_bf16(bf16_to_f32(x[i]) * scale);
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * normed);
    }
}

/* out = weight * RMSNorm(x), rows x H. */
void asymspec_rms_norm(const uint16_t* x, int64_t rows, int64_t H, const uint16_t* w, float eps,
                       uint16_t* out, int n_threads) {
#define NORM_ROWS(first, last) \
    for (int64_t r = (first); r < (last); r++) norm_row(x + r * H, H, w, eps, out + r * H)
    SPLIT_ROWS(rows, rows * H, n_threads, NORM_ROWS);
#undef NORM_ROWS
}

/* x += delta (the residual), then out = weight * RMSNorm(x); w NULL: the add alone. */
static void add_norm_rows(uint16_t* x, const uint16_t* delta, int64_t first, int64_t last,
                          int64_t H, const uint16_t* w, float eps, uint16_t* out) {
    for (int64_t r = first; r < last; r++) {
        uint16_t* xr = x + r * H;
        const uint16_t* dr = delta + r * H;
        for (int64_t i = 0; i < H; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
        if (w) norm_row(xr, H, w, eps, out + r * H);
    }
}

void asymspec_add_rms_norm(uint16_t* x, const uint16_t* delta, int64_t rows, int64_t H,
                           const uint16_t* w, float eps, uint16_t* out, int n_threads) {
#define ADD_NORM_ROWS(first, last) add_norm_rows(x, delta, (first), (last), H, w, eps, out)
    SPLIT_ROWS(rows, rows * H, n_threads, ADD_NORM_ROWS);
#undef ADD_NORM_ROWS
}

/* In place over `heads` heads of size D in each of `rows` rows (row stride `stride`
 * elements): x * cos + rotate_half(x) * sin, with cos and sin [rows, D]. */
void asymspec_rotary(uint16_t* qk, int64_t rows, int64_t stride, int64_t heads, int64_t D,
                     const uint16_t* cos, const uint16_t* sin) {
    const int64_t half = D / 2;
#if HAVE_AVX512_BF16
    if (half % 16 == 0) {
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t* c = cos + r * D;
            const uint16_t* s = sin + r * D;
            for (int64_t h = 0; h < heads; h++) {
                uint16_t* x = qk + r * stride + h * D;
                for (int64_t i = 0; i < half; i += 16) {
                    const __m512 lo = load16(x + i), hi = load16(x + half + i);
                    const __m512 a = round16(_mm512_mul_ps(lo, load16(c + i)));
                    const __m512 b = round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi),
                                                           load16(s + i)));
                    const __m512 a2 = round16(_mm512_mul_ps(hi, load16(c + half + i)));
                    const __m512 b2 = round16(_mm512_mul_ps(lo, load16(s + half + i)));
                    store16(x + i, _mm512_add_ps(a, b));
                    store16(x + half + i, _mm512_add_ps(a2, b2));
                }
            }
        }
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* c = cos + r * D;
        const uint16_t* s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t* x = qk + r * stride + h * D;
            float lo[256], hi[256]; /* head sizes up to 512 */
            for (int64_t i = 0; i < half; i++) {
                lo[i] = bf16_to_f32(x[i]);
                hi[i] = bf16_to_f32(x[i + half]);
            }
            for (int64_t i = 0; i < half; i++) {
                const float a = round_bf16(lo[i] * bf16_to_f32(c[i]));
                const float b = round_bf16(-hi[i] * bf16_to_f32(s[i]));
                x[i] = f32_to_bf16(a + b);
                const float a2 = round_bf16(hi[i] * bf16_to_f32(c[i + half]));
                const float b2 = round_bf16(lo[i] * bf16_to_f32(s[i + half]));
                x[i + half] = f32_to_bf16(a2 + b2);
            }
        }
    }
}

/* out[r, i] = SiLU(gate[r, i]) * up[r, i], where each row of gate_up is [gate (I) | up (I)]. */
static void silu_mul_rows(const uint16_t* gate_up, int64_t first, int64_t last, int64_t I,
                          uint16_t* out) {
    for (int64_t r = first; r < last; r++) {
        const uint16_t* g = gate_up + r * 2 * I;
        const uint16_t* u = g + I;
        uint16_t* o = out + r * I;
        for (int64_t i = 0; i < I; i++) { /* gcc vectorizes it, expf through libmvec */
            const float v = bf16_to_f32(g[i]);
            const float silu = round_bf16(v / (1.0f + expf(-v)));
            o[i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
        }
    }
}

void asymspec_silu_mul(const uint16_t* gate_up, int64_t rows, int64_t I, uint16_t* out,
                       int n_threads) {
#define SILU_ROWS(first, last) silu_mul_rows(gate_up, (first), (last), I, out)
    SPLIT_ROWS(rows, rows * I, n_threads, SILU_ROWS);
#undef SILU_ROWS
}
