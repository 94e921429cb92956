/* The KV-cache forward of runtime/model/cached_forward.py in one call, fp32, for the CPU.
 *
 * Same math, same prepared weights, same cache layout as the torch path (kvcache.py says what each
 * tensor holds); what differs is the cost: a decode step of a tiny model is ~170 small torch ops,
 * each paying dispatch and allocation, here it is plain loops over cache-resident weights. Every
 * token is computed on its own in a fixed order, so a token's result does not depend on which
 * other tokens share the call. Built by runtime/cbuild.py, called by runtime/model/native.py.
 *
 * Shapes: N tokens, H hidden, h query heads, g kv heads (r = h / g), D head dim, E experts, K top-k,
 * S cache slots, P cache positions, V vocab. Weights keep the parameters' row-major [out, in] layout
 * (x @ w.T, as nn.Linear): in fp32 they are the parameters themselves, so a weight swap writes each
 * weight once. The cache's keys and values are [in, out] operands (attend).
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
    const float *q, *k, *v;  /* [h D, H], [g D, H], [g D, H] */
    const float *qk_norm;    /* [h + g, D]: q heads, then k heads times sqrt(D) */
    const float *o;          /* [H, h D] */
    const float *post_norm;  /* [H], times sqrt(H) */
    const float *router;     /* [E, H]; NULL: a dense MLP (one "expert" of weight 1) */
    const float *gate, *up;  /* [E, W, H] */
    const float *down;       /* [E, H, W] */
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
#define TILES(VECS)                                                                               \
    {                                                                                             \
        const Mat wo = {w.data + o, w.ld};                                                        \
        int64_t n = 0;                                                                            \
        for (; n + 4 <= N; n += 4)                                                                \
            tile((Mat){x.data + n * x.ld, x.ld}, wo, y + n * ldy + o, ldy, in, 4, VECS, accumulate); \
        if (n + 2 <= N) {                                                                         \
            tile((Mat){x.data + n * x.ld, x.ld}, wo, y + n * ldy + o, ldy, in, 2, VECS, accumulate); \
            n += 2;                                                                               \
        }                                                                                         \
        if (n < N) tile((Mat){x.data + n * x.ld, x.ld}, wo, y + n * ldy + o, ldy, in, 1, VECS, accumulate); \
    }
    int64_t o = 0;
    for (; o + 16 <= out; o += 16) TILES(2)
    for (; o + 8 <= out; o += 8) TILES(1)
#undef TILES
    for (; o < out; o++)
        for (int64_t n = 0; n < N; n++) {
            float acc = accumulate ? y[n * ldy + o] : 0.0f;
            for (int64_t j = 0; j < in; j++) acc += x.data[n * x.ld + j] * w.data[j * w.ld + o];
            y[n * ldy + o] = acc;
        }
}

static inline float lanes_sum(v8 v) { /* pairwise, in a fixed order: three vector adds */
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* y[rows, outs] (+)= x[rows, in] @ w[outs, in].T: per (row, output) eight lanes of partial sums, added
 * in a fixed order at the end (a row's result never depends on the tile it was computed in). */
static inline __attribute__((always_inline)) void dot_tile(Mat x, Mat w, float *restrict y, int64_t ldy, int64_t in,
                                                           int rows, int outs, int accumulate) {
    v8 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++) acc[r][o] = (v8){0};
    int64_t j = 0;
    for (; j + 8 <= in; j += 8) {
        v8 wj[4];
        for (int o = 0; o < outs; o++) wj[o] = load8(w.data + o * w.ld + j);
        for (int r = 0; r < rows; r++) {
            const v8 xr = load8(x.data + r * x.ld + j);
            for (int o = 0; o < outs; o++) acc[r][o] += xr * wj[o];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++) {
            float s = lanes_sum(acc[r][o]);
            for (int64_t t = j; t < in; t++) s += x.data[r * x.ld + t] * w.data[o * w.ld + t];
            y[r * ldy + o] = accumulate ? y[r * ldy + o] + s : s;
        }
}

#if defined(__AVX512F__)
#define ROW_TILE_OUTS 4 /* 32 vector registers: 16 accumulators, 4 weight rows and an input row */
#else
#define ROW_TILE_OUTS 2 /* 16 vector registers */
#endif

/* y[N, out] (+)= x[N, in] @ w[out, in].T (x with row stride ldx, y with ldy): tiles of 4 rows by
 * ROW_TILE_OUTS outputs (each weight row read once per 4 tokens), then 2 x 4 and 1 x 4 for the rows left. */
static void linear(const float *x, int64_t ldx, const float *w, float *restrict y, int64_t ldy, int64_t N, int64_t in,
                   int64_t out, int accumulate) {
#define OUTS(ROWS, STEP)                                                                                     \
    {                                                                                                        \
        const Mat xn = {x + n * ldx, ldx};                                                                   \
        int64_t o = 0;                                                                                       \
        for (; o + STEP <= out; o += STEP)                                                                   \
            dot_tile(xn, (Mat){w + o * in, in}, y + n * ldy + o, ldy, in, ROWS, STEP, accumulate);           \
        for (; o < out; o++) dot_tile(xn, (Mat){w + o * in, in}, y + n * ldy + o, ldy, in, ROWS, 1, accumulate); \
    }
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) OUTS(4, ROW_TILE_OUTS)
    for (; n + 2 <= N; n += 2) OUTS(2, 4)
    for (; n < N; n++) OUTS(1, 4)
#undef OUTS
}

/* x / hypot(|x|, eps_scaled) * w_scaled == RMSNorm(x) * w, as cached_forward._rms_norm computes it. */
static void rms_norm(const float *x, const float *w, float eps_scaled, float *y, int64_t n) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float denom = hypotf(sqrtf(ss), eps_scaled);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] / denom * w[i];
}

/* x * cos + roll(x, D/2) * sin, with sin sign-folded (cached_forward._rope). */
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
    linear(hn, d->H, l->router, scores, E, 1, d->H, E, 0);
    softmax_rows(scores, 1, E, E);
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

typedef struct {
    float *in, *mid, *out; /* one expert's rows: [N K, H], [N K, 2W], [N K, H] */
    int64_t *token;        /* the token of each row */
    float *weight;         /* its gate weight */
    float *sum;            /* [N, H]: every token's expert outputs, added in expert order */
} ExpertRows;

/* x[n] += sum over token n's experts of weight * down_e(silu(gate_e(hn[n])) * up_e(hn[n])). Each
 * expert runs once over all of its tokens (rows gathered), so its weights are read once per call; a
 * row's result depends on that row alone. ids [N, K] with row stride ld; NULL: a dense MLP (one
 * expert of weight 1 for every token). */
static void experts(const Dims *d, const Layer *l, int64_t N, const float *hn, const int64_t *ids, int64_t ld,
                    const float *weights, float *x, ExpertRows b) {
    const int64_t H = d->H, W = l->width, K = ids ? d->K : 1;
    memset(b.sum, 0, (size_t)(N * H) * sizeof(float));
    for (int64_t e = 0; e < l->experts; e++) {
        int64_t M = 0;
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++)
                if (!ids || ids[n * ld + k] == e) {
                    memcpy(b.in + M * H, hn + n * H, (size_t)H * sizeof(float));
                    b.token[M] = n;
                    b.weight[M++] = ids ? weights[n * K + k] : 1.0f;
                }
        if (!M) continue;
        linear(b.in, H, l->gate + e * W * H, b.mid, 2 * W, M, H, W, 0);
        linear(b.in, H, l->up + e * W * H, b.mid + W, 2 * W, M, H, W, 0);
        for (int64_t i = 0; i < M; i++) {
            float *gu = b.mid + i * 2 * W, *act = b.mid + i * W; /* in place: act[j] only reads gu[j], gu[W + j] */
            for (int64_t j = 0; j < W; j++) act[j] = silu(gu[j]) * gu[W + j] * b.weight[i];
        }
        linear(b.mid, W, l->down + e * H * W, b.out, H, M, W, H, 0);
        for (int64_t i = 0; i < M; i++)
            for (int64_t c = 0; c < H; c++) b.sum[b.token[i] * H + c] += b.out[i * H + c];
    }
    for (int64_t i = 0; i < N * H; i++) x[i] += b.sum[i];
}

static int within(const int64_t *values, int64_t n, int64_t bound) {
    for (int64_t i = 0; i < n; i++)
        if (values[i] < 0 || values[i] >= bound) return 0;
    return 1;
}

/* Returns 0; 1, 2, 3 or 4 if a token id, slot, position or replayed expert id is out of range (then
 * nothing was written); -1 if scratch memory could not be had. routing: [N, moe layers, K]. */
int reel_forward_cached(const Dims *d, const Layer *layers, int64_t L, const float *embed, const float *norm,
                        const float *lm_head, const float *cos_PD, const float *sin_PD, float *cache_k,
                        float *cache_v, int64_t N, const int64_t *ids, const int64_t *slots, const int64_t *pos,
                        const int64_t *replay, float *logits, int64_t *routing) {
    const int64_t H = d->H, h = d->h, g = d->g, D = d->D, K = d->K, S = d->S, P = d->P;
    const int64_t O = (h + 2 * g) * D, rows = N * K;
    int64_t moe_layers = 0, widest = 0, experts_max = 0;
    for (int64_t l = 0; l < L; l++) {
        moe_layers += layers[l].router != NULL;
        widest = layers[l].width > widest ? layers[l].width : widest;
        experts_max = layers[l].experts > experts_max ? layers[l].experts : experts_max;
    }
    if (!within(ids, N, d->V)) return 1;
    if (!within(slots, N, S)) return 2;
    if (!within(pos, N, P)) return 3;
    if (replay && !within(replay, N * moe_layers * K, experts_max)) return 4;
    /* Scratch, in floats: x, hn, qkv, attention output, scores, router scores, gate weights, rope
     * temp, then the expert rows (token ids as int64 take two floats each). */
    const int64_t floats = N * H * 2 + N * O + N * h * D + h / g * P + experts_max + N * K + D +
                           rows * (H + 2 * widest + H + 1 + 2) + N * H;
    float *x = malloc((size_t)floats * sizeof(float));
    if (!x) return -1;
    float *hn = x + N * H, *qkv = hn + N * H, *att = qkv + N * O, *scores = att + N * h * D;
    float *router = scores + h / g * P, *weights = router + experts_max, *tmp = weights + N * K;
    ExpertRows b;
    b.in = tmp + D;
    b.mid = b.in + rows * H;
    b.out = b.mid + rows * 2 * widest;
    b.weight = b.out + rows * H;
    b.token = (int64_t *)(b.weight + rows);
    b.sum = (float *)(b.token + rows);
    for (int64_t n = 0; n < N; n++) memcpy(x + n * H, embed + ids[n] * H, (size_t)H * sizeof(float));
    for (int64_t l = 0, m = 0; l < L; l++) {
        const Layer *lw = layers + l;
        float *k_layer = cache_k + l * S * g * D * P, *v_layer = cache_v + l * S * g * P * D;
        for (int64_t n = 0; n < N; n++) rms_norm(x + n * H, lw->input_norm, d->eps_H, hn + n * H, H);
        linear(hn, H, lw->q, qkv, O, N, H, h * D, 0);
        linear(hn, H, lw->k, qkv + h * D, O, N, H, g * D, 0);
        linear(hn, H, lw->v, qkv + (h + g) * D, O, N, H, g * D, 0);
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
        linear(att, h * D, lw->o, x, H, N, h * D, H, 1);
        for (int64_t n = 0; n < N; n++) rms_norm(x + n * H, lw->post_norm, d->eps_H, hn + n * H, H);
        if (!lw->router) {
            experts(d, lw, N, hn, NULL, 0, NULL, x, b);
            continue;
        }
        const int64_t ld = moe_layers * K; /* routing row stride */
        for (int64_t n = 0; n < N; n++)
            route(d, lw, hn + n * H, replay ? replay + n * ld + m * K : NULL, routing + n * ld + m * K,
                  weights + n * K, router);
        experts(d, lw, N, hn, routing + m * K, ld, weights, x, b);
        m++;
    }
    for (int64_t n = 0; n < N; n++) rms_norm(x + n * H, norm, d->eps_H, hn + n * H, H);
    linear(hn, H, lm_head, logits, d->V, N, H, d->V, 0);
    free(x);
    return 0;
}
