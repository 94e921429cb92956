/* One decode step's sampling for the built-in engine, in one call: what producers/sampling.py's
 * sample_tokens computes with ~20 torch ops, row by row. Built and loaded by runtime/cbuild.py.
 *
 * Row b of logits [B, V]: temperature 0 = greedy (argmax, log softmax of the raw logits);
 * otherwise log mu = log softmax(logits / temperature), cut to the top-p nucleus and renormalised,
 * and the token drawn by inverse CDF (in vocabulary order) from the row's uniform u[b].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static float logsumexp(const float *x, int64_t n) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    if (top == -INFINITY) return top;
    for (int64_t i = 0; i < n; i++) total += expf(x[i] - top);
    return top + logf(total);
}

typedef struct {
    float logp;
    int64_t token;
} Ranked; /* 16 bytes: the caller's scratch holds V of them */

static int descending(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    if (x->logp != y->logp) return x->logp > y->logp ? -1 : 1;
    return x->token < y->token ? -1 : x->token > y->token; /* ties: lower token id first */
}

/* Drop the tokens outside the smallest set, by descending probability, whose mass reaches top_p;
 * renormalise the rest. */
static void nucleus(float *logp, int64_t V, float top_p, Ranked *ranked) {
    for (int64_t v = 0; v < V; v++) ranked[v] = (Ranked){logp[v], v};
    qsort(ranked, (size_t)V, sizeof *ranked, descending);
    float before = 0.0f; /* mass of the tokens ranked above this one */
    for (int64_t i = 0; i < V; i++) {
        const float p = expf(ranked[i].logp);
        if (before >= top_p) logp[ranked[i].token] = -INFINITY;
        before += p;
    }
    const float lse = logsumexp(logp, V);
    for (int64_t v = 0; v < V; v++) logp[v] -= lse;
}

void reel_sample(int64_t B, int64_t V, const float *logits, const float *temperature, const float *top_p,
                 const float *u, int64_t *tokens, float *logprobs, float *logp, Ranked *ranked) {
    for (int64_t b = 0; b < B; b++) {
        const float *z = logits + b * V;
        if (temperature[b] == 0.0f) {
            int64_t best = 0;
            for (int64_t v = 1; v < V; v++) best = z[v] > z[best] ? v : best;
            tokens[b] = best;
            logprobs[b] = z[best] - logsumexp(z, V);
            continue;
        }
        for (int64_t v = 0; v < V; v++) logp[v] = z[v] / temperature[b];
        const float lse = logsumexp(logp, V);
        for (int64_t v = 0; v < V; v++) logp[v] -= lse;
        if (top_p[b] < 1.0f) nucleus(logp, V, top_p[b], ranked);
        float total = 0.0f;
        for (int64_t v = 0; v < V; v++) total += expf(logp[v]);
        const float target = u[b] * total;
        float cdf = 0.0f;
        int64_t drawn = -1;
        for (int64_t v = 0; v < V; v++) {
            if (logp[v] == -INFINITY) continue;
            drawn = v; /* a rounding shortfall at the end leaves the last token that has mass */
            cdf += expf(logp[v]);
            if (cdf > target) break;
        }
        tokens[b] = drawn;
        logprobs[b] = logp[drawn];
    }
}
