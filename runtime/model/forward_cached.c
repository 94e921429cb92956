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

/* Vectors through GCC/Clang vector extensions: v8 (AVX), and vw, the widest the CPU has, 16 floats
 * with AVX-512 else 8. Products are fused (fmaw: one rounding) where the CPU has FMA. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define TILE_VECS 4     /* 32 vector registers: 16 accumulators */
#define ROW_TILE_OUTS 4 /* 16 accumulators, 4 weight rows and an input row */
typedef float vw __attribute__((vector_size(64)));
typedef int32_t vwi __attribute__((vector_size(64)));
/* The first n floats at p, zeros after (masked: nothing past p + n is read). */
static inline vw load_part(const float *p, int n) { return (vw)_mm512_maskz_loadu_ps((__mmask16)~(~0u << n), p); }
static inline void store_part(float *p, vw v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)~(~0u << n), (__m512)v); }
static inline vw fmaw(vw a, vw b, vw c) { return (vw)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline v8 fold(vw v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
#define VW 8
#define TILE_VECS 2     /* 16 vector registers */
#define ROW_TILE_OUTS 2
typedef v8 vw;
typedef v8i vwi;
static inline vw load_part(const float *p, int n) { vw v = {0}; memcpy(&v, p, (size_t)n * sizeof(float)); return v; }
static inline void store_part(float *p, vw v, int n) { memcpy(p, &v, (size_t)n * sizeof(float)); }
#if defined(__FMA__)
#include <immintrin.h>
static inline vw fmaw(vw a, vw b, vw c) { return (vw)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline vw fmaw(vw a, vw b, vw c) { return a * b + c; }
#endif
static inline v8 fold(vw v) { return v; }
#endif

/* a where mask (a comparison's lanes of all ones), else b. */
static inline vw pickw(vwi mask, vw a, vw b) { return (vw)(((vwi)a & mask) | ((vwi)b & ~mask)); }

/* A strided matrix: element (i, j) at data[i * ld + j]. */
typedef struct {
    const float *data;
    int64_t ld;
} Mat;

/* y[rows, cols] (+)= x[rows, in] @ w[in, cols], accumulated in registers: rows <= 4, cols <= VW * TILE_VECS;
 * the last vector may be partial (`last` columns: masked loads and stores, nothing read past a row).
 * Each column is its own lane, summed over j in order, so no tiling changes a result. */
static inline __attribute__((always_inline)) void tile(Mat x, Mat w, float *restrict y, int64_t ldy, int64_t in,
                                                       int rows, int vecs, int last, int accumulate) {
    vw acc[4][TILE_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++)
            acc[r][v] = accumulate ? load_part(y + r * ldy + VW * v, v + 1 < vecs ? VW : last) : (vw){0};
    for (int64_t j = 0; j < in; j++) {
        vw wj[TILE_VECS];
        for (int v = 0; v < vecs; v++) wj[v] = load_part(w.data + j * w.ld + VW * v, v + 1 < vecs ? VW : last);
        for (int r = 0; r < rows; r++) {
            const vw xr = (vw){0} + x.data[r * x.ld + j];
            for (int v = 0; v < vecs; v++) acc[r][v] = fmaw(xr, wj[v], acc[r][v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) store_part(y + r * ldy + VW * v, acc[r][v], v + 1 < vecs ? VW : last);
}

/* y[N, out] (+)= x[N, in] @ w[in, out], y with row stride ldy: tiles of 4 rows (then 2, then 1) by
 * TILE_VECS vectors of columns, then one tile of the columns left, its last vector partial. */
static void matmul(Mat x, Mat w, float *restrict y, int64_t ldy, int64_t N, int64_t in, int64_t out,
                   int accumulate) {
#define TILES(VECS, LAST)                                                                                     \
    {                                                                                                         \
        const Mat wo = {w.data + o, w.ld};                                                                    \
        int64_t n = 0;                                                                                        \
        for (; n + 4 <= N; n += 4)                                                                            \
            tile((Mat){x.data + n * x.ld, x.ld}, wo, y + n * ldy + o, ldy, in, 4, VECS, LAST, accumulate);    \
        if (n + 2 <= N) {                                                                                     \
            tile((Mat){x.data + n * x.ld, x.ld}, wo, y + n * ldy + o, ldy, in, 2, VECS, LAST, accumulate);    \
            n += 2;                                                                                           \
        }                                                                                                     \
        if (n < N) tile((Mat){x.data + n * x.ld, x.ld}, wo, y + n * ldy + o, ldy, in, 1, VECS, LAST, accumulate); \
    }
    int64_t o = 0;
    for (; o + VW * TILE_VECS <= out; o += VW * TILE_VECS) TILES(TILE_VECS, VW)
    if (o == out) return;
    const int vecs = (int)((out - o + VW - 1) / VW), last = (int)(out - o) - (vecs - 1) * VW;
    switch (vecs) { /* the columns left, in one tile (constant vector counts: unrolled) */
    case 1: TILES(1, last) break;
    case 2: TILES(2, last) break;
#if TILE_VECS > 2
    case 3: TILES(3, last) break;
#endif
    default: TILES(TILE_VECS, last)
    }
#undef TILES
}

/* Eight partial-sum vectors' totals at once: lane i = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) of
 * a[i], the same pairwise order for every i, as lane-wise adds on shuffled halves (seven vector adds
 * where summing each vector on its own takes seven scalar adds per vector). */
static inline v8 lane_sums(const v8 *a) {
    v8 c[4], d[2];
    for (int i = 0; i < 4; i++) /* c[i] = (a[2i][k] + a[2i][k + 4], a[2i + 1][k] + a[2i + 1][k + 4]), k < 4 */
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* pairs (k = 0, 2) and (1, 3) of four vectors */
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* y[rows, outs] (+)= x[rows, in] @ w[outs, in].T: per (row, output) VW lanes of partial sums (the last
 * vector of a row zero-filled past `in`), added in a fixed order at the end: a row's result never
 * depends on the tile it was computed in. */
static inline __attribute__((always_inline)) void dot_tile(Mat x, Mat w, float *restrict y, int64_t ldy, int64_t in,
                                                           int rows, int outs, int accumulate) {
    vw acc[16]; /* (row, output) at r * outs + o */
    for (int i = 0; i < rows * outs; i++) acc[i] = (vw){0};
    for (int64_t j = 0; j < in; j += VW) {
        const int n = in - j < VW ? (int)(in - j) : VW;
        vw wj[4];
        for (int o = 0; o < outs; o++) wj[o] = load_part(w.data + o * w.ld + j, n);
        for (int r = 0; r < rows; r++) {
            const vw xr = load_part(x.data + r * x.ld + j, n);
            for (int o = 0; o < outs; o++) acc[r * outs + o] = fmaw(xr, wj[o], acc[r * outs + o]);
        }
    }
    v8 folded[16] = {0}; /* unused ones stay zero, summed alongside */
    for (int i = 0; i < rows * outs; i++) folded[i] = fold(acc[i]);
    float sums[16];
    for (int i = 0; i < rows * outs; i += 8) store8(sums + i, lane_sums(folded + i));
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++) y[r * ldy + o] = sums[r * outs + o] + (accumulate ? y[r * ldy + o] : 0.0f);
}

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

/* x * cos + roll(x, D/2) * sin, with sin sign-folded (cached_forward._rope): element i pairs with i + D/2. */
static void rope(float *x, const float *cos_D, const float *sin_D, int64_t D) {
    for (int64_t i = 0; i < D / 2; i++) {
        const float a = x[i], b = x[i + D / 2];
        x[i] = a * cos_D[i] + b * sin_D[i];
        x[i + D / 2] = b * cos_D[i + D / 2] + a * sin_D[i + D / 2];
    }
}

/* e^x per lane (Cephes' expf: 2^n * e^r with |r| <= ln2 / 2 by a degree-7 polynomial, within ~2 ulp
 * of expf; inputs clamped to [-87.3, 88.7], so e^x of a large negative x is ~1e-38, not 0). */
static inline vw expw(vw x) {
    const vw lo = (vw){0} - 87.3365447f, hi = (vw){0} + 88.7228391f;
    x = pickw(x < lo, lo, pickw(x > hi, hi, x)); /* NaN stays NaN */
    const vw t = x * 1.44269504088896341f + 0.5f;
    vwi n = __builtin_convertvector(t, vwi);            /* truncated, then floored: */
    n -= (vwi)(__builtin_convertvector(n, vw) > t) & 1; /* -1 where truncation rounded up */
    const vw fn = __builtin_convertvector(n, vw), r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    static const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
    vw y = (vw){0} + c[0];
    for (int i = 1; i < 6; i++) y = y * r + c[i];
    return (y * (r * r) + r + 1.0f) * (vw)((n + 127) << 23);
}

/* Softmax of each of `rows` rows of `n` scores (row stride ld), in place. The maximum is exact in any
 * order (taken VW lanes at a time); the exponentials are summed in index order. */
static void softmax_rows(float *s, int64_t rows, int64_t n, int64_t ld) {
    for (int64_t i = 0; i < rows; i++, s += ld) {
        vw top_w = (vw){0} - INFINITY;
        int64_t p = 0;
        for (; p + VW <= n; p += VW) top_w = pickw(load_part(s + p, VW) > top_w, load_part(s + p, VW), top_w);
        float top = -INFINITY, total = 0.0f;
        for (int k = 0; k < VW; k++) top = top_w[k] > top ? top_w[k] : top;
        for (; p < n; p++) top = s[p] > top ? s[p] : top;
        for (p = 0; p < n; p += VW) {
            const int m = n - p < VW ? (int)(n - p) : VW;
            store_part(s + p, expw(load_part(s + p, m) - top), m);
        }
        for (p = 0; p < n; p++) total += s[p];
        for (p = 0; p < n; p++) s[p] /= total;
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
        int64_t best = replay ? replay[k] : -1;
        for (int64_t e = 0; !replay && e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < k; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
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
            for (int64_t j = 0; j < W; j += VW) { /* silu(gate) * up * weight; silu(v) = v / (1 + e^-v) */
                const int m = W - j < VW ? (int)(W - j) : VW;
                const vw gate = load_part(gu + j, m), up = load_part(gu + W + j, m);
                store_part(act + j, gate / (1.0f + expw(-gate)) * up * b.weight[i], m);
            }
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
    for (const Layer *l = layers; l < layers + L; l++) {
        moe_layers += l->router != NULL;
        widest = l->width > widest ? l->width : widest;
        experts_max = l->experts > experts_max ? l->experts : experts_max;
    }
    if (!within(ids, N, d->V)) return 1;
    if (!within(slots, N, S)) return 2;
    if (!within(pos, N, P)) return 3;
    if (replay && !within(replay, N * moe_layers * K, experts_max)) return 4;
    /* Scratch, in floats: x, hn, qkv, attention output, scores, router scores, gate weights, then
     * the expert rows (token ids as int64 take two floats each). */
    const int64_t floats = N * H * 2 + N * O + N * h * D + h / g * P + experts_max + N * K +
                           rows * (H + 2 * widest + H + 1 + 2) + N * H;
    float *x = malloc((size_t)floats * sizeof(float));
    if (!x) return -1;
    float *hn = x + N * H, *qkv = hn + N * H, *att = qkv + N * O, *scores = att + N * h * D;
    float *router = scores + h / g * P, *weights = router + experts_max;
    ExpertRows b = {.in = weights + N * K};
    b.mid = b.in + rows * H, b.out = b.mid + rows * 2 * widest, b.weight = b.out + rows * H;
    b.token = (int64_t *)(b.weight + rows), b.sum = (float *)(b.token + rows);
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
                rope(t + j * D, cos_PD + pos[n] * D, sin_PD + pos[n] * D, D);
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
