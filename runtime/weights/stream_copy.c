/* Copies of a weight swap written around the CPU caches (non-temporal stores).
 *
 * A swap writes gigabytes that no step reads before the swap is over; ordinary stores first read
 * every destination line into the cache (a third memory pass) and evict what decoding uses.
 * Streaming stores skip both. Called by runtime/weights/stream_copy.py; built by runtime/cbuild.py. Where
 * the CPU has no AVX-512 or AVX the loops below are plain copies, still correct.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

/* bf16 -> fp32 is exact: the 16 bits become the high half of the float. */
static inline void widen_one(const uint16_t *src, float *dst) {
    const uint32_t bits = (uint32_t)*src << 16;
    memcpy(dst, &bits, sizeof bits);
}

/* dst[0..n) = float(src[0..n)), src bf16. */
void reel_widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < n && ((uintptr_t)(dst + i) & 63); i++) widen_one(src + i, dst + i); /* to a 64-byte line */
    for (; i + 16 <= n; i += 16) {
        const __m256i half = _mm256_loadu_si256((const __m256i *)(src + i));
        _mm512_stream_si512((void *)(dst + i), _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    _mm_sfence();
#endif
    for (; i < n; i++) widen_one(src + i, dst + i);
}

/* dst[0..n) = src[0..n), bytes. */
void reel_stream_bytes(const uint8_t *src, uint8_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX__)
    const int64_t head = (int64_t)((32 - ((uintptr_t)dst & 31)) & 31); /* bytes to a 32-byte boundary */
    if (n >= head + 32) {
        memcpy(dst, src, (size_t)head);
        for (i = head; i + 32 <= n; i += 32)
            _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
        _mm_sfence();
    }
#endif
    memcpy(dst + i, src + i, (size_t)(n - i));
}
