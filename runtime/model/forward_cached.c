/* The KV-cache forward of runtime/model/kvcache.py in one call, fp32, for the CPU.
 *
 * Same math, same prepared weights, same cache layout as the torch path (kvcache.py says what each
 * tensor holds); what differs is the cost: a decode step of a tiny model is ~170 small torch ops,
 * each paying dispatch and allocation, here it is plain loops over cache-resident weights. Every
 * token is computed on its own in a fixed order, so a token's result does not depend on which
 * other tokens share the call. Built and loaded by runtime/model/native.py.
 *
 * Shapes: N tokens, H hidden, h query heads, g kv heads (r = h / g), D head dim, E experts, K top-k,
 * S cache slots, P cache positions, V vocab. Matrices are row-major [in, out] (x @ w).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t H, h, g, D, K, V, S, P, renormalise;
    float eps_H, eps_D; /* sqrt(width * rms_norm_eps): see rms_norm */
} Dims;

typedef struct {
    const float *input_norm; /* [H], times sqrt(H) */
    const float *qkv;        /* [H, (h + 2g) D] */
    const float *qk_norm;    /* [h + g, D]: q heads, then k heads times sqrt(D) */
    const float *o;          /* [h D, H] */
    const float *post_norm;  /* [H], times sqrt(H) */
    const float *router;     /* [H, E]; NULL: a dense MLP (one "expert" of weight 1) */
    const float *gate_up;    /* [E, H, 2W]: gate then up */
    const float *down;       /* [E, W, H] */
    int64_t experts, width;  /* E, W */
} Layer;

/* Eight floats in one register (AVX), or in two (SSE) or more elsewhere: GCC/Clang vector extensions. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* A strided matrix: element (i, j) at data[i * ld + j]. */
typedef struct {
    const float *data;
    int64_t ld;
} Mat;

/* y[rows, 8 * vecs] (+)= x[rows, in] @ w[in, 8 * vecs], accumulated in registers (rows <= 4, vecs <= 2). */
static inline __attribute__((always_inline)) void tile(Mat x, Mat w, float *restrict y, int64_t ldy, int64_t in,
                                                       int rows, int vecs, int accumulate) {
    v8 acc[4][2];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) acc[r][v] = accumulate ? load8(y + r * ldy + 8 * v) : (v8){0};
    for (int64_t j = 0; j < in; j++) {
        v8 wj[2];
        for (int v = 0; v < vecs; v++) wj[v] = load8(w.data + j * w.ld + 8 * v);
        for (int r = 0; r < rows; r++) {
            const float xr = x.data[r * x.ld + j];
            for (int v = 0; v < vecs; v++) acc[r][v] += xr * wj[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) store8(y + r * ldy + 8 * v, acc[r][v]);
}

/* y[N, out] (+)= x[N, in] @ w[in, out], y with row stride ldy: tiles of 4 rows x 16 columns, then the edges. */
static void matmul(Mat x, Mat w, float *restrict y, int64_t ldy, int64_t N, int64_t in, int64_t out,
                   int accumulate) {
#define TILES(ROWS, VECS)                                                                        \
    for (int64_t n = 0; n < N; n += ROWS) {                                                      \
        const Mat xn = {x.data + n * x.ld, x.ld}, wo = {w.data + o, w.ld};                       \
        if (n + ROWS <= N) tile(xn, wo, y + n * ldy + o, ldy, in, ROWS, VECS, accumulate);       \
        else for (int64_t m = n; m < N; m++)                                                     \
            tile((Mat){x.data + m * x.ld, x.ld}, wo, y + m * ldy + o, ldy, in, 1, VECS, accumulate); \
    }
    int64_t o = 0;
    for (; o + 16 <= out; o += 16) TILES(4, 2)
    for (; o + 8 <= out; o += 8) TILES(4, 1)
#undef TILES
    for (; o < out; o++)
        for (int64_t n = 0; n < N; n++) {
            float acc = accumulate ? y[n * ldy + o] : 0.0f;
            for (int64_t j = 0; j < in; j++) acc += x.data[n * x.ld + j] * w.data[j * w.ld + o];
            y[n * ldy + o] = acc;
        }
}

/* Contiguous rows: y[N, out] (+)= x[N, in] @ w[in, out]. */
static void dense(const float *x, const float *w, float *y, int64_t N, int64_t in, int64_t out, int accumulate) {
    matmul((Mat){x, in}, (Mat){w, out}, y, out, N, in, out, accumulate);
}

/* x / hypot(|x|, eps_scaled) * w_scaled == RMSNorm(x) * w, as kvcache._rms_norm computes it. */
static void rms_norm(const float *x, const float *w, float eps_scaled, float *y, int64_t n) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float denom = hypotf(sqrtf(ss), eps_scaled);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] / denom * w[i];
}

/* x * cos + roll(x, D/2) * sin, with sin sign-folded (kvcache._rope). */
static void rope(float *x, const float *cos_D, const float *sin_D, int64_t D, float *tmp) {
    memcpy(tmp, x, (size_t)D * sizeof(float));
    for (int64_t i = 0; i < D; i++) x[i] = tmp[i] * cos_D[i] + tmp[(i + D / 2) % D] * sin_D[i];
}

static float silu(float v) { return v / (1.0f + expf(-v)); }

/* Softmax of each of `rows` rows of `n` scores (row stride ld), in place. */
static void softmax_rows(float *s, int64_t rows, int64_t n, int64_t ld) {
    for (int64_t i = 0; i < rows; i++, s += ld) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < n; p++) top = s[p] > top ? s[p] : top;
        for (int64_t p = 0; p < n; p++) total += (s[p] = expf(s[p] - top));
        for (int64_t p = 0; p < n; p++) s[p] /= total;
    }
}

/* One token's attention over cache positions 0..pos of its slot: per kv head, its r query heads
 * at once (scores = q @ k, k stored [D, P]; o = softmax(scores) @ v, v stored [P, D]). */
static void attend(const Dims *d, const float *k_slot, const float *v_slot, const float *q, int64_t pos,
                   float *o, float *scores) {
    const int64_t r = d->h / d->g, D = d->D, P = d->P, span = pos + 1;
    for (int64_t c = 0; c < d->g; c++) {
        matmul((Mat){q + c * r * D, D}, (Mat){k_slot + c * D * P, P}, scores, span, r, D, span, 0);
        softmax_rows(scores, r, span, span);
        matmul((Mat){scores, span}, (Mat){v_slot + c * P * D, D}, o + c * r * D, D, r, span, D, 0);
    }
}

/* Router softmax, top-k (ties: lower expert id first) or the replayed ids; gate weights. */
static void route(const Dims *d, const Layer *l, const float *hn, const int64_t *replay, int64_t *ids,
                  float *weights, float *scores) {
    const int64_t E = l->experts, K = d->K;
    dense(hn, l->router, scores, 1, d->H, E, 0);
    float top = -INFINITY, total = 0.0f;
    for (int64_t e = 0; e < E; e++) top = scores[e] > top ? scores[e] : top;
    for (int64_t e = 0; e < E; e++) total += (scores[e] = expf(scores[e] - top));
    for (int64_t e = 0; e < E; e++) scores[e] /= total;
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        if (replay) {
            best = replay[k];
        } else {
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < k; i++) taken |= ids[i] == e;
                if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
            }
        }
        ids[k] = best;
        weights[k] = scores[best];
    }
    if (d->renormalise) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) sum += weights[k];
        for (int64_t k = 0; k < K; k++) weights[k] /= sum;
    }
}

/* x += sum_k weight_k * down_e(silu(gate_e(hn)) * up_e(hn)) over the token's experts. */
static void mlp(const Dims *d, const Layer *l, const float *hn, const int64_t *ids, const float *weights,
                int64_t count, float *x, float *gate_up, float *y) {
    const int64_t H = d->H, W = l->width;
    memset(y, 0, (size_t)H * sizeof(float));
    for (int64_t k = 0; k < count; k++) {
        const int64_t e = ids ? ids[k] : 0;
        dense(hn, l->gate_up + e * H * 2 * W, gate_up, 1, H, 2 * W, 0);
        for (int64_t i = 0; i < W; i++) gate_up[i] = silu(gate_up[i]) * gate_up[W + i];
        const float weight = weights ? weights[k] : 1.0f;
        for (int64_t i = 0; i < W; i++) gate_up[i] *= weight;
        dense(gate_up, l->down + e * W * H, y, 1, W, H, 1);
    }
    for (int64_t c = 0; c < H; c++) x[c] += y[c];
}

/* Returns 0, or -1 if scratch memory could not be had. routing: [N, moe layers, K]. */
int reel_forward_cached(const Dims *d, const Layer *layers, int64_t L, const float *embed, const float *norm,
                        const float *lm_head, const float *cos_PD, const float *sin_PD, float *cache_k,
                        float *cache_v, int64_t N, const int64_t *ids, const int64_t *slots, const int64_t *pos,
                        const int64_t *replay, float *logits, int64_t *routing) {
    const int64_t H = d->H, h = d->h, g = d->g, D = d->D, K = d->K, S = d->S, P = d->P;
    const int64_t O = (h + 2 * g) * D;
    int64_t moe_layers = 0, widest = 0, experts = 0;
    for (int64_t l = 0; l < L; l++) {
        moe_layers += layers[l].router != NULL;
        widest = layers[l].width > widest ? layers[l].width : widest;
        experts = layers[l].experts > experts ? layers[l].experts : experts;
    }
    float *x = malloc((size_t)(N * H + N * H + N * O + N * h * D + h / g * P + 2 * widest + H + D + experts + K) *
                      sizeof(float));
    if (!x) return -1;
    float *hn = x + N * H, *qkv = hn + N * H, *att = qkv + N * O, *scores = att + N * h * D;
    float *gate_up = scores + h / g * P, *y = gate_up + 2 * widest, *tmp = y + H, *router = tmp + D, *weights = router + experts;
    for (int64_t n = 0; n < N; n++) memcpy(x + n * H, embed + ids[n] * H, (size_t)H * sizeof(float));
    for (int64_t l = 0, m = 0; l < L; l++) {
        const Layer *lw = layers + l;
        float *k_layer = cache_k + l * S * g * D * P, *v_layer = cache_v + l * S * g * P * D;
        for (int64_t n = 0; n < N; n++) rms_norm(x + n * H, lw->input_norm, d->eps_H, hn + n * H, H);
        dense(hn, lw->qkv, qkv, N, H, O, 0);
        /* Every token's keys and values go in first, so a chunk's tokens see each other. */
        for (int64_t n = 0; n < N; n++) {
            float *t = qkv + n * O;
            for (int64_t j = 0; j < h + g; j++) {
                rms_norm(t + j * D, lw->qk_norm + j * D, d->eps_D, t + j * D, D);
                rope(t + j * D, cos_PD + pos[n] * D, sin_PD + pos[n] * D, D, tmp);
            }
            for (int64_t c = 0; c < g; c++) {
                float *k = k_layer + (slots[n] * g + c) * D * P, *v = v_layer + (slots[n] * g + c) * P * D;
                for (int64_t e = 0; e < D; e++) {
                    k[e * P + pos[n]] = t[(h + c) * D + e];
                    v[pos[n] * D + e] = t[(h + g + c) * D + e];
                }
            }
        }
        for (int64_t n = 0; n < N; n++)
            attend(d, k_layer + slots[n] * g * D * P, v_layer + slots[n] * g * P * D, qkv + n * O, pos[n],
                   att + n * h * D, scores);
        dense(att, lw->o, x, N, h * D, H, 1);
        for (int64_t n = 0; n < N; n++) {
            rms_norm(x + n * H, lw->post_norm, d->eps_H, hn + n * H, H);
            if (!lw->router) {
                mlp(d, lw, hn + n * H, NULL, NULL, 1, x + n * H, gate_up, y);
                continue;
            }
            int64_t *chosen = routing + (n * moe_layers + m) * K;
            route(d, lw, hn + n * H, replay ? replay + (n * moe_layers + m) * K : NULL, chosen, weights, router);
            mlp(d, lw, hn + n * H, chosen, weights, K, x + n * H, gate_up, y);
        }
        m += lw->router != NULL;
    }
    for (int64_t n = 0; n < N; n++) rms_norm(x + n * H, norm, d->eps_H, hn + n * H, H);
    dense(hn, lm_head, logits, N, H, d->V, 0);
    free(x);
    return 0;
}
