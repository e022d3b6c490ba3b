// int8-weight matrix product for CPUs with AVX2 and FMA but no VNNI (e.g. AMD Zen 3):
// y[M, N] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k] (+ bias), x quantized to int8 per row.
//
// Why our own kernel: there, oneDNN's int8 matmul (`gemm:jit`) took 1.8-2x bfloat16's time for one row,
// which is most of what decoding runs. Without VNNI the integer product of signed bytes is AVX2's
// `vpmaddubsw`, which takes one unsigned operand: as in llama.cpp's Q8 x Q8 dot products, the
// activation's absolute value is the unsigned side and its sign is moved onto the weight (`vpsignb`), so
// every product is exact, and a pair of them (at most 2 * 127 * 127 = 32258) fits int16 without
// saturating; `vpmaddwd` then widens the pairs to int32 sums (exact for any K below 133,000).
// Each block of weights is read once for a chunk of up to 4 rows; one row's result does not depend on
// the other rows (the same integer sums, then the same float steps), which keeps greedy speculative
// decoding exact over int8 weights.
//
// Layout, made by flyspec/models/int8_kernel.py: output channels in blocks of 8 (N padded to 16),
//   codes: [N / 8][K / 4][32] int8; byte 4j + t of quad q is the weight of channel 8b + j for input
//          channel 4q + t.
//   scales: float32 [N] (one per output channel, padding included).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !(defined(__AVX2__) && defined(__FMA__))
#error "the int8 kernel needs AVX2 with FMA; oneDNN's int8 matmul is used instead"
#endif

static const int HALF = 8;  // output channels per block (one 256-bit vector of int32)
static const int MAX_ROWS = 4;
static const int PREFETCH = 2048;  // bytes ahead in each block's stream of weights

static inline float bf16_bits_to_float(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if (std::isnan(f)) return 0x7FC0;
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);  // round to nearest even
}

static inline float load_x(const void* x, bool bf16, int64_t at) {
    return bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(x)[at]) : static_cast<const float*>(x)[at];
}

// One row -> int8 codes with one symmetric scale, and |code| for the unsigned side. The same float32
// steps as quantize_per_token in flyspec/models/quantization.py (scale = max(amax, 1e-12) / 127, codes
// round(x / scale), ties to even), so the codes equal those oneDNN's path multiplies elsewhere.
static void quantize_row(const void* x, bool bf16, int64_t row, int64_t k, int8_t* q, uint8_t* a, float* sx) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(load_x(x, bf16, row * k + i)));
    const float scale = std::fmax(amax, 1e-12f) / 127.f;
    for (int64_t i = 0; i < k; ++i) {
        const int32_t c = static_cast<int32_t>(std::nearbyint(load_x(x, bf16, row * k + i) / scale));
        q[row * k + i] = static_cast<int8_t>(c);
        a[row * k + i] = static_cast<uint8_t>(c < 0 ? -c : c);
    }
    sx[row] = scale;
}

// R rows times H blocks of 8 channels: int32 sums over all of K.
template <int R, int H>
static void block_rows(const int8_t* q, const uint8_t* a, int64_t k, const int8_t* codes, __m256i* out) {
    const int64_t stride = (k / 4) * 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[H][R];
    for (int h = 0; h < H; ++h)
        for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < k; c += 4) {
        __m256i w[H];
        for (int h = 0; h < H; ++h) {
            // Prefetch ahead: measured 1.2-1.4x faster for 1-16 rows (the hardware prefetcher alone
            // left the loads waiting on memory).
            if (c % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + h * stride + c * 8 + PREFETCH), _MM_HINT_T0);
            w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + h * stride + c * 8));
        }
        for (int r = 0; r < R; ++r) {
            int32_t xs, xa;
            std::memcpy(&xs, q + r * k + c, 4);
            std::memcpy(&xa, a + r * k + c, 4);
            const __m256i sx = _mm256_set1_epi32(xs);
            const __m256i ax = _mm256_set1_epi32(xa);
            for (int h = 0; h < H; ++h) {
                const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[h], sx));
                acc[h][r] = _mm256_add_epi32(acc[h][r], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int h = 0; h < H; ++h)
        for (int r = 0; r < R; ++r) out[r * H + h] = acc[h][r];
}

typedef void (*BlockFn)(const int8_t*, const uint8_t*, int64_t, const int8_t*, __m256i*);

static const int WIDE = 2;  // blocks per span
static const BlockFn FNS[MAX_ROWS + 1] = {
    nullptr, block_rows<1, 2>, block_rows<2, 2>, block_rows<3, 2>, block_rows<4, 2>,
};

extern "C" {

// x: [m, k] float32 (x_bf16 = 0) or bfloat16 (1); y: [m, n] float32 (y_bf16 = 0) or bfloat16 (1);
// codes and scales as above for n rounded up to a multiple of 16; bias float32 [n] or null; k % 4 == 0.
void flyspec_int8_matmul(const void* x, int x_bf16, int64_t m, int64_t k, const int8_t* codes,
                         const float* scales, int64_t n, const float* bias, void* y, int y_bf16) {
    const int64_t blocks = (n + 2 * HALF - 1) / (2 * HALF) * 2;
    const int64_t stride = (k / 4) * 32;
    std::vector<int8_t> q(m * k);
    std::vector<uint8_t> a(m * k);
    std::vector<float> sx(m);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) quantize_row(x, x_bf16, r, k, q.data(), a.data(), sx.data());
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b += WIDE) {
            __m256i sums[MAX_ROWS * WIDE];
            for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
                const int rows = m - r0 < MAX_ROWS ? static_cast<int>(m - r0) : MAX_ROWS;
                FNS[rows](q.data() + r0 * k, a.data() + r0 * k, k, codes + b * stride, sums);
                for (int r = 0; r < rows; ++r)
                    for (int h = 0; h < WIDE; ++h) {
                        const int64_t col = (b + h) * HALF;
                        if (col >= n) continue;
                        // (dot * s_w) * s_x, in the order of oneDNN's path (Int8Linear.forward).
                        const __m256 scaled = _mm256_mul_ps(
                            _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r * WIDE + h]), _mm256_loadu_ps(scales + col)),
                            _mm256_set1_ps(sx[r0 + r]));
                        float tmp[HALF];
                        _mm256_storeu_ps(tmp, scaled);
                        const int64_t valid = n - col < HALF ? n - col : HALF;
                        for (int64_t j = 0; j < valid; ++j) {
                            const float f = bias ? tmp[j] + bias[col + j] : tmp[j];
                            if (y_bf16)
                                static_cast<uint16_t*>(y)[(r0 + r) * n + col + j] = float_to_bf16_bits(f);
                            else
                                static_cast<float*>(y)[(r0 + r) * n + col + j] = f;
                        }
                    }
            }
        }
    }
}

}
