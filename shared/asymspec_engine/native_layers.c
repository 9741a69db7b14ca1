/* The decoder layers of one forward in one call: per layer the qkv product, rotary, the
 * native attention (decode and verify sessions, then prefill chunks), the o product, the
 * residual add and norm, gate_up, SiLU * up, down, and the add and norm again.
 *
 * Why: driven from Python, each of a layer's nine kernel calls costs 10-25 us of glue
 * (argument checks, tensor allocation, ctypes), about 6 ms of a 21 ms one-session decode
 * step over SmolLM2's 30 layers. This loop calls the same kernels with the same arguments
 * in the same order, through the entry points Python hands it, so a forward gives the same
 * bits either way; only the glue goes.
 *
 * No kernel is compiled in here: the entry points come from the libraries the engine has
 * already loaded (native_linear.c, native_pointwise.c, native_attention.c), which keeps one
 * copy of each kernel and of its per-thread tile state. */
#include <stddef.h>
#include <stdint.h>

typedef int (*linear_fn)(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed,
                         int64_t N, const float* bias, uint16_t* y, int threads);
typedef void (*add_norm_fn)(uint16_t* x, const uint16_t* delta, int64_t rows, int64_t H,
                            const uint16_t* w, float eps, uint16_t* out, int n_threads);
typedef void (*rotary_fn)(uint16_t* qk, int64_t rows, int64_t stride, int64_t heads, int64_t D,
                          const uint16_t* cos, const uint16_t* sin);
typedef void (*silu_mul_fn)(const uint16_t* gate_up, int64_t rows, int64_t I, uint16_t* out,
                            int n_threads);
typedef int (*attend_fn)(int n_sessions, const int64_t* row0, const int64_t* n,
                         const int64_t* base, const int64_t* slots, const int64_t* cap,
                         int layer, const uint16_t* q, int64_t q_stride, const uint16_t* k_new,
                         int64_t k_stride, const uint16_t* v_new, int64_t v_stride,
                         uint16_t* out, int H, int H_kv, int D, float scale, int n_threads);

struct asymspec_kernels {
    linear_fn linear;
    add_norm_fn add_rms_norm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    attend_fn attend;  /* decode and verify sessions */
    attend_fn prefill; /* prefill chunks; NULL where the attention kernel has no prefill path */
};

/* One layer's packed weights (native_linear.c's layout), float32 biases or NULL, and its
 * norms; next_norm: the following layer's input norm, NULL for the last layer. */
struct asymspec_layer {
    const uint16_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const uint16_t *post_norm, *next_norm;
};

/* Sessions as native_attention.c takes them (count 0: none). */
struct asymspec_sessions {
    int64_t count;
    const int64_t *row0, *n, *base, *slots, *cap;
};

/* The shapes: T rows, hidden width, intermediate width I, H query heads and H_kv key-value
 * heads of D. */
struct asymspec_shape {
    int64_t T, hidden, I;
    int64_t H, H_kv, D;
    float eps, scale;
    int threads;
};

static int attend(attend_fn entry, const struct asymspec_sessions* s, int layer,
                  uint16_t* qkv, int64_t qkv_width, uint16_t* attn,
                  const struct asymspec_shape* sh) {
    if (s->count == 0) return 0;
    if (entry == NULL) return -2;
    const uint16_t* k_new = qkv + sh->H * sh->D;
    const uint16_t* v_new = qkv + (sh->H + sh->H_kv) * sh->D;
    return entry((int)s->count, s->row0, s->n, s->base, s->slots, s->cap, layer, qkv, qkv_width,
                 k_new, qkv_width, v_new, qkv_width, attn, (int)sh->H, (int)sh->H_kv,
                 (int)sh->D, sh->scale, sh->threads);
}

/* x [T, hidden]: the residual stream, updated in place; h [T, hidden]: its normed rows by
 * the first layer's input norm on entry, by next_norm of the last layer on return (left as
 * the last layer's post-attention rows where that is NULL). cos, sin [T, D]. Scratch:
 * qkv [T, (H + 2 H_kv) D], attn [T, H D], delta [T, hidden], gate_up [T, 2 I], act [T, I].
 * Returns 0, or the failing kernel's code with the layer: 1000 * (layer + 1) + step. */
int asymspec_layers_bf16(const struct asymspec_kernels* k, const struct asymspec_layer* layers,
                         int n_layers, const struct asymspec_shape* sh,
                         const struct asymspec_sessions* decoding,
                         const struct asymspec_sessions* prefilling, uint16_t* x, uint16_t* h,
                         const uint16_t* cos, const uint16_t* sin, uint16_t* qkv,
                         uint16_t* attn, uint16_t* delta, uint16_t* gate_up, uint16_t* act) {
    const int64_t T = sh->T, hidden = sh->hidden, I = sh->I, D = sh->D;
    const int64_t qkv_width = (sh->H + 2 * sh->H_kv) * D, attn_width = sh->H * D;
    for (int i = 0; i < n_layers; i++) {
        const struct asymspec_layer* L = &layers[i];
        const int fail = 1000 * (i + 1);
        int rc = k->linear(h, T, hidden, L->qkv, qkv_width, L->qkv_bias, qkv, sh->threads);
        if (rc != 0) return fail + 1;
        k->rotary(qkv, T, qkv_width, sh->H + sh->H_kv, D, cos, sin);
        if (attend(k->attend, decoding, i, qkv, qkv_width, attn, sh) != 0) return fail + 2;
        if (attend(k->prefill, prefilling, i, qkv, qkv_width, attn, sh) != 0) return fail + 3;
        rc = k->linear(attn, T, attn_width, L->o, hidden, L->o_bias, delta, sh->threads);
        if (rc != 0) return fail + 4;
        k->add_rms_norm(x, delta, T, hidden, L->post_norm, sh->eps, h, sh->threads);
        rc = k->linear(h, T, hidden, L->gate_up, 2 * I, L->gate_up_bias, gate_up, sh->threads);
        if (rc != 0) return fail + 5;
        k->silu_mul(gate_up, T, I, act, sh->threads);
        rc = k->linear(act, T, I, L->down, hidden, L->down_bias, delta, sh->threads);
        if (rc != 0) return fail + 6;
        k->add_rms_norm(x, delta, T, hidden, L->next_norm, sh->eps,
                        L->next_norm == NULL ? NULL : h, sh->threads);
    }
    return 0;
}
