// int4-weight matrix product for a few rows: y[M, N] = x[M, K] * W[N, K]^T (+ bias), x quantized to int8.
//
// Why our own kernel: torch's `_weight_int4pack_mm_for_cpu` unpacks the weights once per input row, so a
// verify pass of 5 rows costs about 3x one row. Here each block of weights is read once for a chunk of
// rows and multiplied as 4-bit codes, without unpacking to floats: the rows are quantized to int8 in
// groups (one scale per group of G input channels, as the weights are), the integer dot products of codes
// and activations are exact, and they are scaled once per group (the scheme of llama.cpp's Q4 x Q8 dot
// products). Plain C++ with intrinsics and no torch headers: it compiles in about a second for one
// instruction set, named by the flags flyspec/models/int4_kernel.py passes, and is called through ctypes;
// OpenMP here shares torch's runtime (the same libgomp.so.1 is loaded).
//
// Two implementations of the inner product, chosen at compile time:
// - AVX-512 VNNI: `vpdpbusd` multiplies 64 code/activation byte pairs per instruction into int32 sums;
//   16 output channels per 512-bit vector, up to 8 rows per chunk.
// - AVX2 + FMA (no VNNI, e.g. AMD Zen 3): `vpmaddubsw` multiplies 32 code/activation byte pairs into
//   int16 pair sums, up to 8 of which are added in int16 (|sum| <= 8 * 2 * 15 * 127 = 30480, so nothing
//   saturates and the sums stay exact) before `vpmaddwd` widens them to int32; 8 output channels per
//   256-bit vector, up to 4 rows per chunk (16 vector registers: for 3 and 4 rows the float
//   accumulators live in L1 so that the int16 sums of a whole block fit).
//
// Layout, made by flyspec/models/int4_kernel.py. Output channels come in blocks of 16 (N is padded).
//   codes:  [N / 16][K / 8][64] bytes; byte 4j + t of octet q holds the codes (0..15) of channel 16b + j
//           for input channels 8q + t (low nibble) and 8q + 4 + t (high nibble), t = 0..3. (AVX2 reads
//           each octet as two halves of 32 bytes: channels 0-7 and 8-15 of the block.)
//   scales: [N / 16][K / G][2][16] bfloat16 bit patterns: the group's scale, then its offset, so that
//           w = code * scale + offset.
// For an activation group x ~ sx * qx (qx int8): sum_k x w = sx * (scale * sum qx code + offset * sum qx).
//
// Exactness: a row's int8 codes depend only on that row, integer sums are exact, and the float steps per
// output element are the same operations in the same order whatever M is and wherever the row falls in
// a chunk, so a row's result does not depend on the other rows (greedy speculative decoding over int4
// weights stays token-identical to target-only decoding).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FLYSPEC_INT4_AVX512 1
static const char* const ISA_NAME = "avx512_vnni";
#elif defined(__AVX2__) && defined(__FMA__)
#define FLYSPEC_INT4_AVX2 1
static const char* const ISA_NAME = "avx2";
#else
#error "the int4 kernel needs AVX-512 VNNI or AVX2 with FMA; torch's int4 kernel is used instead"
#endif

static const int BLOCK = 16;

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

// The quantized rows: int8 codes [m][k], and per group the scale sx and sx * sum(qx) [m][k / group].
struct Rows {
    const int8_t* q;
    const float* sx;
    const float* cx;
};

static inline float load_x(const void* x, bool bf16, int64_t at) {
    return bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(x)[at]) : static_cast<const float*>(x)[at];
}

// One group of one row of x (float32 or bfloat16) -> int8 codes with one symmetric scale. The group is
// read twice (its maximum, then its codes) rather than copied into a buffer: no allocation per call.
static void quantize_group(const void* x, bool bf16, int64_t row, int64_t g, int64_t k, int64_t group, int8_t* q,
                           float* sx, float* cx) {
    const int64_t first = row * k + g * group;
    float amax = 0.f;
    for (int64_t i = 0; i < group; ++i) amax = std::fmax(amax, std::fabs(load_x(x, bf16, first + i)));
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < group; ++i) {
        const int32_t c = static_cast<int32_t>(std::nearbyint(load_x(x, bf16, first + i) * inv));
        q[first + i] = static_cast<int8_t>(c);
        sum += c;
    }
    sx[row * (k / group) + g] = scale;
    cx[row * (k / group) + g] = scale * static_cast<float>(sum);
}

// A block function computes R rows times NB consecutive blocks of 16 output channels over all of K and
// writes the float32 sums (no bias) to out[r][b * 16 + j].
typedef void (*BlockFn)(const Rows&, int64_t, const uint8_t*, const uint16_t*, int64_t, float*);

#if FLYSPEC_INT4_AVX512

static const int MAX_ROWS = 8;

static inline __m512 bf16_to_f32(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Several blocks give the VNNI units independent chains to work on. (Integer sums are exact, so how they
// are grouped cannot change a result.)
template <int R, int NB>
static void block_rows(const Rows& rows, int64_t k, const uint8_t* codes, const uint16_t* scales,
                       int64_t group, float* out) {
    const int64_t code_stride = (k / 8) * 64;
    const int64_t groups = k / group;
    const int64_t scale_stride = groups * 2 * BLOCK;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[NB][R];
    for (int b = 0; b < NB; ++b)
        for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i dots[NB][R];
        for (int b = 0; b < NB; ++b)
            for (int r = 0; r < R; ++r) dots[b][r] = _mm512_setzero_si512();
        for (int64_t c = g * group; c < (g + 1) * group; c += 8) {
            for (int b = 0; b < NB; ++b) {
                const __m512i bytes =
                    _mm512_loadu_si512(reinterpret_cast<const void*>(codes + b * code_stride + c * 8));
                const __m512i lo = _mm512_and_si512(bytes, nibble);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
                for (int r = 0; r < R; ++r) {
                    int32_t x0, x1;
                    std::memcpy(&x0, rows.q + r * k + c, 4);
                    std::memcpy(&x1, rows.q + r * k + c + 4, 4);
                    dots[b][r] = _mm512_dpbusd_epi32(dots[b][r], lo, _mm512_set1_epi32(x0));
                    dots[b][r] = _mm512_dpbusd_epi32(dots[b][r], hi, _mm512_set1_epi32(x1));
                }
            }
        }
        for (int b = 0; b < NB; ++b) {
            const __m512 scale = bf16_to_f32(scales + b * scale_stride + g * 2 * BLOCK);
            const __m512 offset = bf16_to_f32(scales + b * scale_stride + g * 2 * BLOCK + BLOCK);
            for (int r = 0; r < R; ++r) {
                const __m512 dot = _mm512_cvtepi32_ps(dots[b][r]);
                const __m512 sx = _mm512_set1_ps(rows.sx[r * groups + g]);
                const __m512 cx = _mm512_set1_ps(rows.cx[r * groups + g]);
                acc[b][r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, sx), acc[b][r]);
                acc[b][r] = _mm512_fmadd_ps(offset, cx, acc[b][r]);
            }
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r * NB + b) * BLOCK, acc[b][r]);
}

// Blocks per call for 1..MAX_ROWS rows, as many as the 32 vector registers hold.
static const int WIDE = 4;
static const int WIDTHS[MAX_ROWS + 1] = {0, 4, 4, 2, 2, 2, 2, 1, 1};
static const BlockFn WIDE_FNS[MAX_ROWS + 1] = {
    nullptr, block_rows<1, 4>, block_rows<2, 4>, block_rows<3, 2>, block_rows<4, 2>,
    block_rows<5, 2>, block_rows<6, 2>, block_rows<7, 1>, block_rows<8, 1>,
};
static const BlockFn ONE_FNS[MAX_ROWS + 1] = {
    nullptr, block_rows<1, 1>, block_rows<2, 1>, block_rows<3, 1>, block_rows<4, 1>,
    block_rows<5, 1>, block_rows<6, 1>, block_rows<7, 1>, block_rows<8, 1>,
};

#else  // AVX2 + FMA

static const int MAX_ROWS = 4;
static const int HALF = 8;  // output channels per 256-bit vector: half a block
// Software prefetch this many bytes ahead in each block's stream of codes: without it the loads waited on
// memory (1.2-1.4x slower for 1-8 rows, measured over the 1.5B model's layers).
static const int PREFETCH = 2048;

static inline __m256 bf16_to_f32(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// R rows times H half-blocks (8 channels each: halves 2b and 2b + 1 are block b's channels 0-7 and 8-15).
// Per half-block and row, int16 pair sums of up to 4 octets (8 products per lane) are added, widened to
// int32 and scaled into the float32 accumulator; the group's offset term follows at its end.
template <int R, int H>
static void half_rows(const Rows& rows, int64_t k, const uint8_t* codes, const uint16_t* scales,
                      int64_t group, float* out, int first_half) {
    const int64_t code_stride = (k / 8) * 64;
    const int64_t groups = k / group;
    const int64_t scale_stride = groups * 2 * BLOCK;
    const int64_t chunk = group < 32 ? group : 32;  // input channels summed in int16: 4 octets at most
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* base[H];
    const uint16_t* sbase[H];
    for (int h = 0; h < H; ++h) {
        const int half = first_half + h;
        base[h] = codes + (half / 2) * code_stride + (half % 2) * 32;
        sbase[h] = scales + (half / 2) * scale_stride + (half % 2) * HALF;
    }
    __m256 acc[H][R];
    for (int h = 0; h < H; ++h)
        for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256 ssx[H][R];
        for (int h = 0; h < H; ++h) {
            const __m256 scale = bf16_to_f32(sbase[h] + g * 2 * BLOCK);
            for (int r = 0; r < R; ++r) ssx[h][r] = _mm256_mul_ps(scale, _mm256_set1_ps(rows.sx[r * groups + g]));
        }
        for (int64_t c0 = g * group; c0 < (g + 1) * group; c0 += chunk) {
            __m256i sums[H][R];
            for (int h = 0; h < H; ++h)
                for (int r = 0; r < R; ++r) sums[h][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int64_t c = c0; c < c0 + chunk; c += 8) {
                for (int h = 0; h < H; ++h) {
                    if (h % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(base[h] + c * 8 + PREFETCH), _MM_HINT_T0);
                    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[h] + c * 8));
                    const __m256i lo = _mm256_and_si256(bytes, nibble);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                    for (int r = 0; r < R; ++r) {
                        int32_t x0, x1;
                        std::memcpy(&x0, rows.q + r * k + c, 4);
                        std::memcpy(&x1, rows.q + r * k + c + 4, 4);
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
                        sums[h][r] = _mm256_add_epi16(sums[h][r], p);
                    }
                }
            }
            for (int h = 0; h < H; ++h)
                for (int r = 0; r < R; ++r) {
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[h][r], ones));
                    acc[h][r] = _mm256_fmadd_ps(dot, ssx[h][r], acc[h][r]);
                }
        }
        for (int h = 0; h < H; ++h) {
            const __m256 offset = bf16_to_f32(sbase[h] + g * 2 * BLOCK + BLOCK);
            for (int r = 0; r < R; ++r)
                acc[h][r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(rows.cx[r * groups + g]), acc[h][r]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (r * H + h) * HALF, acc[h][r]);
}

// R rows times both halves of one block, with the float accumulators and scales in memory (L1): only
// the int16 sums stay in registers, so the broadcasts of the activations serve both halves.
template <int R>
static void block_mem(const Rows& rows, int64_t k, const uint8_t* codes, const uint16_t* scales,
                      int64_t group, float* out) {
    const int64_t groups = k / group;
    const int64_t chunk = group < 32 ? group : 32;
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1);
    alignas(32) float acc[R][2][HALF] = {};
    alignas(32) float ssx[R][2][HALF];
    for (int64_t g = 0; g < groups; ++g) {
        for (int h = 0; h < 2; ++h) {
            const __m256 scale = bf16_to_f32(scales + g * 2 * BLOCK + h * HALF);
            for (int r = 0; r < R; ++r)
                _mm256_store_ps(ssx[r][h], _mm256_mul_ps(scale, _mm256_set1_ps(rows.sx[r * groups + g])));
        }
        for (int64_t c0 = g * group; c0 < (g + 1) * group; c0 += chunk) {
            __m256i sums[R][2];
            for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int64_t c = c0; c < c0 + chunk; c += 8) {
                _mm_prefetch(reinterpret_cast<const char*>(codes + c * 8 + PREFETCH), _MM_HINT_T0);
                const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 8));
                const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 8 + 32));
                const __m256i lo0 = _mm256_and_si256(b0, nibble);
                const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), nibble);
                const __m256i lo1 = _mm256_and_si256(b1, nibble);
                const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), nibble);
                for (int r = 0; r < R; ++r) {
                    int32_t x0, x1;
                    std::memcpy(&x0, rows.q + r * k + c, 4);
                    std::memcpy(&x1, rows.q + r * k + c + 4, 4);
                    const __m256i v0 = _mm256_set1_epi32(x0);
                    const __m256i v1 = _mm256_set1_epi32(x1);
                    sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, v0),
                                                                                _mm256_maddubs_epi16(hi0, v1)));
                    sums[r][1] = _mm256_add_epi16(sums[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, v0),
                                                                                _mm256_maddubs_epi16(hi1, v1)));
                }
            }
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < 2; ++h) {
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][h], ones));
                    _mm256_store_ps(acc[r][h], _mm256_fmadd_ps(dot, _mm256_load_ps(ssx[r][h]), _mm256_load_ps(acc[r][h])));
                }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 offset = bf16_to_f32(scales + g * 2 * BLOCK + BLOCK + h * HALF);
            for (int r = 0; r < R; ++r)
                _mm256_store_ps(acc[r][h], _mm256_fmadd_ps(offset, _mm256_set1_ps(rows.cx[r * groups + g]),
                                                           _mm256_load_ps(acc[r][h])));
        }
    }
    for (int r = 0; r < R; ++r) std::memcpy(out + r * BLOCK, acc[r], BLOCK * sizeof(float));
}

// One or two rows: NB blocks = 2 * NB half-blocks, H at a time, everything in the 16 vector registers.
template <int R, int NB>
static void block_rows(const Rows& rows, int64_t k, const uint8_t* codes, const uint16_t* scales,
                       int64_t group, float* out) {
    static_assert(R <= 2, "3 and 4 rows: block_mem");
    constexpr int H = R == 1 ? 4 : 2;
    constexpr int STEP = H < 2 * NB ? H : 2 * NB;
    for (int first = 0; first < 2 * NB; first += STEP) {
        float part[MAX_ROWS * 4 * HALF];
        half_rows<R, STEP>(rows, k, codes, scales, group, part, first);
        for (int r = 0; r < R; ++r)
            std::memcpy(out + r * NB * BLOCK + first * HALF, part + r * STEP * HALF, STEP * HALF * sizeof(float));
    }
}

static const int WIDE = 2;
static const int WIDTHS[MAX_ROWS + 1] = {0, 2, 1, 1, 1};
static const BlockFn WIDE_FNS[MAX_ROWS + 1] = {
    nullptr, block_rows<1, 2>, block_rows<2, 1>, block_mem<3>, block_mem<4>,
};
static const BlockFn ONE_FNS[MAX_ROWS + 1] = {
    nullptr, block_rows<1, 1>, block_rows<2, 1>, block_mem<3>, block_mem<4>,
};

#endif

// Bias, then the output dtype, for the columns of block `col` that exist (n may end inside a block).
static void store(const float* v, const float* bias, bool bf16_out, void* y, int64_t row, int64_t n,
                  int64_t col) {
    const int64_t valid = n - col < BLOCK ? n - col : BLOCK;
    for (int64_t j = 0; j < valid; ++j) {
        const float f = bias ? v[j] + bias[col + j] : v[j];
        if (bf16_out)
            static_cast<uint16_t*>(y)[row * n + col + j] = float_to_bf16_bits(f);
        else
            static_cast<float*>(y)[row * n + col + j] = f;
    }
}

extern "C" {

// The instruction set this library was built for: "avx512_vnni" or "avx2".
const char* flyspec_int4_isa() { return ISA_NAME; }

// x: [m, k] float32 (x_bf16 = 0) or bfloat16 (1); y: [m, n] float32 (y_bf16 = 0) or bfloat16 (1);
// bias: float32 [n] or null; codes and scales as above for n rounded up to a multiple of 16;
// k % group == 0 and group % 8 == 0.
void flyspec_int4_matmul(const void* x, int x_bf16, int64_t m, int64_t k, const uint8_t* codes,
                         const uint16_t* scales, int64_t group, int64_t n, const float* bias, void* y,
                         int y_bf16) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    const int64_t code_stride = (k / 8) * 64;
    const int64_t scale_stride = (k / group) * 2 * BLOCK;
    const int64_t spans = (blocks + WIDE - 1) / WIDE;
    std::vector<int8_t> q(m * k);
    std::vector<float> sx(m * (k / group)), cx(m * (k / group));
    const Rows rows_all{q.data(), sx.data(), cx.data()};
#pragma omp parallel
    {
        // By group, not by row: one row's groups are shared among the threads (a decode step has one row).
        const int64_t groups = k / group;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m * groups; ++i)
            quantize_group(x, x_bf16, i / groups, i % groups, k, group, q.data(), sx.data(), cx.data());
#pragma omp for schedule(static)
        for (int64_t s = 0; s < spans; ++s) {
            const int64_t end = (s + 1) * WIDE < blocks ? (s + 1) * WIDE : blocks;
            float out[MAX_ROWS * WIDE * BLOCK];
            for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
                const int rows = m - r0 < MAX_ROWS ? static_cast<int>(m - r0) : MAX_ROWS;
                const Rows chunk{rows_all.q + r0 * k, rows_all.sx + r0 * (k / group),
                                 rows_all.cx + r0 * (k / group)};
                int64_t b = s * WIDE;
                while (b < end) {
                    const int width = b + WIDTHS[rows] <= end ? WIDTHS[rows] : 1;
                    (width > 1 ? WIDE_FNS : ONE_FNS)[rows](chunk, k, codes + b * code_stride,
                                                          scales + b * scale_stride, group, out);
                    for (int r = 0; r < rows; ++r)
                        for (int i = 0; i < width; ++i)
                            store(out + (r * width + i) * BLOCK, bias, y_bf16, y, r0 + r, n, (b + i) * BLOCK);
                    b += width;
                }
            }
        }
    }
}

}
