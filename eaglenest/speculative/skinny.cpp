// bf16 decode kernels for the CPU (AVX512-BF16), for forwards of a few rows (decode steps, verifies):
//
// - skinny_linear: y[M, N] = x[M, K] @ w[N, K]^T. Reads w once in its own row-major layout (no
//   prepacked copy), one weight row after another, with every row of x in L1: a k-row verify streams
//   the weights like a 1-row GEMV.
// - decode_attention: grouped-query attention of S new rows over one layer's preallocated keys/values,
//   each head's keys and values read once for all its rows.
// - skinny_linear_i8: the same product over int8 weights with one fp32 scale per weight row (half the
//   bytes of bf16 to stream; each int8 value is exact in bf16, so the dot products are skinny_linear's
//   over the dequantized row, scaled once at the end).
// - skinny_linear_q4: the same product over int4 weights, two per byte, with one bf16 scale per group of
//   G values along K (a quarter of the bytes of bf16); each group's dot product (its int4 values are exact in
//   bf16) is scaled and added to the row's sum.
//
// Each output row is computed by the same instruction sequence whatever the other rows are (fixed
// k order and reduction trees, fp32 accumulation, one round to bf16; masked keys skipped, never
// added as zeros in another order), so a verify forward reproduces 1-row decode steps bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace {

constexpr int NJ = 4;  // weight rows (output columns) per tile
constexpr int MB = 4;  // input rows per tile

// Four fp32 accumulators -> their four sums, by one fixed tree.
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
  __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
  __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Asks for a weight row's cache lines ahead of its use (non-temporal: streamed weights need not stay cached).
// The hardware prefetchers alone left the weight stream at ~26 GB/s here; a row prefetched one tile ahead
// reads ~31 GB/s for 1 row of x and keeps 8 rows of x close to that (2 cores, AMD EPYC).
inline void prefetch_lines(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_NTA);
}

// A weight matrix [N, K] read as bf16 pairs for the dot products: stored in bf16, or in int8 with one fp32
// scale per row (each int8 value is exact in bf16; the row's scale multiplies its finished sums).
struct Bf16Weights {
  const uint16_t* w;
  int64_t K;
  void prefetch(int64_t n) const { prefetch_lines(w + n * K, K * 2); }
  __m512bh full(int64_t n, int64_t k) const { return (__m512bh)_mm512_loadu_si512(w + n * K + k); }
  __m512bh part(int64_t n, int64_t k, int64_t left) const {  // the first left (< 32) values, zeros after
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), w + n * K + k);
  }
  __m128 scale4(int64_t) const { return _mm_set1_ps(1.0f); }  // (x * 1 is x, bit for bit)
};

// 32 int8 values at p -> 32 bf16
inline __m512bh i8_to_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

struct Int8Weights {
  const int8_t* w;
  const float* scale;
  int64_t K;
  void prefetch(int64_t n) const { prefetch_lines(w + n * K, K); }
  __m512bh full(int64_t n, int64_t k) const { return i8_to_bf16(w + n * K + k); }
  __m512bh part(int64_t n, int64_t k, int64_t left) const {
    alignas(64) int8_t buf[32] = {0};
    std::copy(w + n * K + k, w + n * K + k + left, buf);
    return i8_to_bf16(buf);
  }
  __m128 scale4(int64_t n0) const { return _mm_loadu_ps(scale + n0); }
};

// Weight row n against rows [0, R) of x: two accumulator sets over alternating 32-element chunks
// (two independent dependency chains), added at the end; the K tail goes to the first set.
template <int R, class W>
inline void row_dot(const uint16_t* x, const W& wt, int64_t n, int64_t K, __m512* out) {
  __m512 a[R], b[R];
  for (int m = 0; m < R; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = wt.full(n, k), w1 = wt.full(n, k + 32);
    for (int m = 0; m < R; ++m) {
      a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), w0);
      b[m] = _mm512_dpbf16_ps(b[m], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32), w1);
    }
  }
  for (; k < K; k += 32) {
    const int64_t left = std::min<int64_t>(32, K - k);
    const __mmask32 mask = (__mmask32)((1ull << left) - 1);
    const __m512bh w0 = left == 32 ? wt.full(n, k) : wt.part(n, k, left);
    for (int m = 0; m < R; ++m)
      a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), w0);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_add_ps(a[m], b[m]);
}

// A weight matrix [N, K] in int4: row n is K / 2 bytes, byte 32 b + j holding value 64 b + j in its low nibble
// and value 64 b + 32 + j in its high one, each stored as q + 8 (q in [-8, 7]); one bf16 scale per group of
// G values along K. Rows shorter than 1 KB are left to the hardware prefetcher: asking for the next tile's
// 288-byte rows (K 576) made the LM head's product slower (0.68 of int8's time instead of 0.58), while 3 KB
// rows (K 6144) under 4 rows of x were faster with it (0.65 instead of 0.84).
// (A row is skipped by asking for 0 bytes: gcc 12 deleted the prefetch loop altogether behind an early return.)
struct Int4Weights {
  const uint8_t* w;
  const uint16_t* scale;  // bf16 [N, K / G]
  int64_t K, groups;
  int64_t ask_bytes;  // K / 2 for rows of 1 KB or more, else 0
  void prefetch(int64_t n) const { prefetch_lines(w + n * (K / 2), ask_bytes); }
  __m128 scale4(int64_t) const { return _mm_set1_ps(1.0f); }  // the scales multiply each group's sums instead
};

// bf16 of q for table index q + 8 (lanes 16..31 unused: the shifted nibbles never exceed 15)
inline __m512i q4_table() {
  const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(q));
}

// The bf16 at p as an fp32 in every lane (a broadcast and a shift).
inline __m512 bf16_broadcast(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi16((short)*p), 16));
}

// 32 packed bytes -> their 64 values as bf16: the first 32 (low nibbles) and the last 32 (high nibbles), by a
// mask, a shift and two 16-bit table lookups (cheaper than int8's widening and conversions).
inline void q4_values(const uint8_t* p, __m512i table, __m512bh& lo, __m512bh& hi) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(15)), table);
  hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
}

// The unscaled dot products g of rows [0, R) of x with the G values of row p's group starting at k (G % 64 == 0).
template <int G, int R>
inline void group_dot(const uint16_t* x, const uint8_t* p, __m512i table, int64_t K, int64_t k, __m512* g) {
  for (int m = 0; m < R; ++m) g[m] = _mm512_setzero_ps();
  for (const int64_t end = k + G; k < end; k += 64) {
    __m512bh lo, hi;
    q4_values(p + k / 2, table, lo, hi);
    for (int m = 0; m < R; ++m) {
      g[m] = _mm512_dpbf16_ps(g[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), lo);
      g[m] = _mm512_dpbf16_ps(g[m], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32), hi);
    }
  }
}

// Weight row n (int4, groups of G) against rows [0, R) of x: each group's dot products (its int4 values are exact
// in bf16) times its scale, added to the sums of the even or of the odd groups (two dependency chains), which
// are added at the end; K % 64 == 0.
template <int G, int R>
inline void row_dot_q4(const uint16_t* x, const Int4Weights& wt, int64_t n, int64_t K, __m512* out) {
  const __m512i table = q4_table();
  const uint8_t* p = wt.w + n * (K / 2);
  const uint16_t* s = wt.scale + n * wt.groups;
  __m512 a[R], b[R];
  for (int m = 0; m < R; ++m) a[m] = b[m] = _mm512_setzero_ps();
  if constexpr (G == 32) {  // each 64-value block holds an even and an odd group
    for (int64_t k = 0; k < K; k += 64) {
      __m512bh lo, hi;
      q4_values(p + k / 2, table, lo, hi);
      const __m512 s0 = bf16_broadcast(s + k / 32), s1 = bf16_broadcast(s + k / 32 + 1), z = _mm512_setzero_ps();
      for (int m = 0; m < R; ++m) {
        a[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(z, (__m512bh)_mm512_loadu_si512(x + m * K + k), lo), s0, a[m]);
        b[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(z, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32), hi), s1, b[m]);
      }
    }
  } else {
    __m512 g[R];
    int64_t k = 0;
    for (; k + 2 * G <= K; k += 2 * G) {
      group_dot<G, R>(x, p, table, K, k, g);
      const __m512 s0 = bf16_broadcast(s + k / G);
      for (int m = 0; m < R; ++m) a[m] = _mm512_fmadd_ps(g[m], s0, a[m]);
      group_dot<G, R>(x, p, table, K, k + G, g);
      const __m512 s1 = bf16_broadcast(s + k / G + 1);
      for (int m = 0; m < R; ++m) b[m] = _mm512_fmadd_ps(g[m], s1, b[m]);
    }
    if (k < K) {  // an odd number of groups: the last one
      group_dot<G, R>(x, p, table, K, k, g);
      const __m512 s0 = bf16_broadcast(s + k / G);
      for (int m = 0; m < R; ++m) a[m] = _mm512_fmadd_ps(g[m], s0, a[m]);
    }
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_add_ps(a[m], b[m]);
}

// The int4 reader with its group size fixed at compile time; tile() reaches row_dot_q4 through this overload.
template <int G>
struct Int4Group : Int4Weights {};

template <int R, int G>
inline void row_dot(const uint16_t* x, const Int4Group<G>& wt, int64_t n, int64_t K, __m512* out) {
  row_dot_q4<G, R>(x, wt, n, K, out);
}

// Rows [0, R) of x against weight rows n0 .. n0 + NJ - 1, one weight row after another: one memory
// stream per thread (two or more interleaved weight rows streamed measurably slower here).
template <int R, class W>
inline void tile(const uint16_t* x, const W& wt, int64_t K, int64_t n0, c10::BFloat16* y, int64_t N) {
  __m512 acc[NJ][R];
  for (int j = 0; j < NJ; ++j) {
    if (n0 + NJ + j < N) wt.prefetch(n0 + NJ + j);  // the next tile's row j
    row_dot<R>(x, wt, n0 + j, K, acc[j]);
  }
  const __m128 sc = wt.scale4(n0);
  for (int m = 0; m < R; ++m) {  // four sums (scaled) rounded to bf16 (nearest even) in one instruction
    __m128bh h = _mm_cvtneps_pbh(_mm_mul_ps(sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]), sc));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(y + m * N + n0), (__m128i)h);
  }
}

template <class W>
void rows_tile(const uint16_t* x, int64_t M, const W& wt, int64_t K, int64_t n0, c10::BFloat16* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const uint16_t* xm = x + m0 * K;
    c10::BFloat16* ym = y + m0 * N;
    switch (std::min<int64_t>(MB, M - m0)) {
      case 1: tile<1>(xm, wt, K, n0, ym, N); break;
      case 2: tile<2>(xm, wt, K, n0, ym, N); break;
      case 3: tile<3>(xm, wt, K, n0, ym, N); break;
      default: tile<4>(xm, wt, K, n0, ym, N); break;
    }
  }
}

// y[M, N] = x[M, K] @ W^T over N / NJ tiles shared by the threads (at least about 128 KB of weights per task;
// row_bytes: the bytes of one weight row).
template <class W>
at::Tensor skinny(const at::Tensor& x, const W& wt, int64_t N, int64_t row_bytes) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, N / NJ, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rows_tile(xp, M, wt, K, t * NJ, yp, N);
  });
  return y;
}

}  // namespace

namespace {

// AMX (Sapphire Rapids and later): the same product on the tile unit. Each output value is the sum over K, in
// 32-value chunks in order, of one TDPBF16PS per chunk: a function of its weight row and its row of x only, so a
// k-row verify still reproduces the 1-row steps bit for bit (a different rounding than the AVX512 path's: a
// weight takes one path for every row count). Tiles: C0..C3 (tmm0-3) the sums of 64 weight rows (16 each) for
// the M rows of x, B (tmm4) one 32-value chunk of x (pairs of K values x M rows, VNNI order), A (tmm5, tmm6) 16
// weight rows' chunk, read in place (rows n0..n0+63 are one contiguous block of the weight).
constexpr int AMX_ROWS = 64;  // weight rows per block

bool amx_ready() {  // the CPU has AMX-BF16 and the kernel let this process use the tile registers
  static const bool ok = [] {
    const char* env = std::getenv("EAGLENEST_AMX");
    if (env != nullptr && env[0] == '0') return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure(int M) {  // this thread's tiles for M rows of x
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * M);  // C0..C3, B
  for (int t = 5; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;                          // A
  _tile_loadconfig(&cfg);
}

// x [M, K] -> xv: chunk c of 32 values as 16 rows (value pairs) of M * 2 bf16 (row p: x[m][32c + 2p], x[m][32c + 2p
// + 1] for each m)
void amx_pack_x(const uint16_t* x, int64_t M, int64_t K, uint16_t* xv) {
  for (int64_t c = 0; c < K / 32; ++c)
    for (int p = 0; p < 16; ++p)
      for (int64_t m = 0; m < M; ++m) {
        uint16_t* o = xv + ((c * 16 + p) * M + m) * 2;
        o[0] = x[m * K + 32 * c + 2 * p];
        o[1] = x[m * K + 32 * c + 2 * p + 1];
      }
}

// weight rows [n0, n0 + 64) against the M rows of x (packed): the sums, rounded to bf16, into y[m, n0 ..]
void amx_block(const uint16_t* w, int64_t K, int64_t n0, const uint16_t* xv, int64_t M, c10::BFloat16* y,
               int64_t N, bool ask_next) {
  const uint16_t* a = w + n0 * K;
  const int64_t stride = 2 * K, chunk = 16 * M * 2;
  constexpr int64_t ahead = 8;  // chunks: 4 and 16 streamed slower here (Xeon SPR VM, 2 cores)
  const int64_t chunks = K / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < K / 32; ++c) {
    {  // chunk c + ahead of each of the 64 rows (of the next block past the last chunk): without it the tile
       // loads, 64 rows apart, streamed at half the AVX512 path's rate
      const int64_t f = c + ahead;
      if (f < chunks || ask_next) {
        const uint16_t* base = f < chunks ? a + 32 * f : a + AMX_ROWS * K + 32 * (f - chunks);
        for (int r = 0; r < AMX_ROWS; ++r) _mm_prefetch(reinterpret_cast<const char*>(base + r * K), _MM_HINT_T0);
      }
    }
    _tile_loadd(4, xv + c * chunk, 4 * M);
    _tile_loadd(5, a + 32 * c, stride);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, a + 16 * K + 32 * c, stride);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(5, a + 32 * K + 32 * c, stride);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(6, a + 48 * K + 32 * c, stride);
    _tile_dpbf16ps(3, 6, 4);
  }
  alignas(64) float sums[AMX_ROWS * 16];  // [weight row][m]
  _tile_stored(0, sums, 4 * M);
  _tile_stored(1, sums + 16 * M, 4 * M);
  _tile_stored(2, sums + 32 * M, 4 * M);
  _tile_stored(3, sums + 48 * M, 4 * M);
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < AMX_ROWS; j += 16) {  // 16 sums of row m -> bf16 (nearest even) in one instruction
      const __m512 v = _mm512_i32gather_ps(
          _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                      10, 11, 12, 13, 14, 15)),
                             _mm512_set1_epi32(static_cast<int>(M))),
          sums + m, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + n0 + j), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

std::atomic<bool> amx_on{false};  // set_amx: the caller's choice (the speculative decoder's forwards, not plain steps)

bool amx_fits(int64_t M, int64_t K, int64_t N) { return M >= 1 && M <= 16 && K % 32 == 0 && N % AMX_ROWS == 0; }

at::Tensor skinny_amx(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  std::vector<uint16_t> xv(M * K);
  amx_pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xv.data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = N / AMX_ROWS, grain = std::max<int64_t>(1, 131072 / (AMX_ROWS * 2 * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    amx_configure(static_cast<int>(M));
    for (int64_t b = b0; b < b1; ++b) amx_block(wp, K, b * AMX_ROWS, xv.data(), M, yp, N, b + 1 < b1);
  });
  return y;
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "skinny_linear: bf16 x and w expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu(), "skinny_linear: contiguous CPU tensors");
  TORCH_CHECK(w.size(0) % NJ == 0, "skinny_linear: output features must be a multiple of ", NJ);
  if (amx_on.load(std::memory_order_relaxed) && amx_fits(x.size(0), x.size(1), w.size(0)) && amx_ready())
    return skinny_amx(x, w);
  const Bf16Weights wt{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), x.size(1)};
  return skinny(x, wt, w.size(0), 2 * x.size(1));
}


namespace {

// bf16 [16] at p -> fp32 [16]
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// e^x for x <= 0 lanes (x = -inf gives 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial.
inline __m512 exp_neg(__m512 x) {
  const __mmask16 dead = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~dead, p, _mm512_castsi512_ps(e));
}

// The softmax of one row's scores [T] in place (max subtracted, exponentiated); returns 1 / their sum. Key t adds
// into lane t % 16, then the lanes are reduced.
inline float softmax_row(float* scores, int64_t T, float mx) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  int64_t t = 0;
  for (; t + 16 <= T; t += 16) {
    const __m512 p = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(scores + t), m));
    _mm512_storeu_ps(scores + t, p);
    sum = _mm512_add_ps(sum, p);
  }
  if (t < T) {
    const __mmask16 tail = (__mmask16)((1u << (T - t)) - 1);
    const __m512 p = exp_neg(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, scores + t), m));
    _mm512_mask_storeu_ps(scores + t, tail, p);
    sum = _mm512_add_ps(sum, p);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// softmax_row for a row whose keys from `full` on may be masked (-inf) between visible ones (a tree's node row
// sees its ancestors, not its siblings): the exponentials stay in place (masked ones 0), and the sum takes the
// visible keys in the lanes of their rank among them, through `packed` [T + 16]. The row alone over the cache
// compacted to its visible keys (a plain step after the tree's path is accepted) then sums in the same lanes,
// and its output is bit-identical (lanes by key index gave another rounding of the sum: in bf16, SmolLM2's
// greedy output then differed from plain decoding in a third of the prompts).
// Masked keys only after the visible ones (a chain's verify rows) leave every visible key in its lane: the plain
// sum, adding zeros for them, is already the compacted one.
inline float softmax_row_holes(float* scores, int64_t T, int64_t full, float mx, float* packed) {
  int64_t n = full;
  bool masked = false, holes = false;
  for (int64_t t = full; t < T; ++t) {
    if (scores[t] == -INFINITY) {
      masked = true;
    } else {
      holes = holes || masked;
      packed[n++] = scores[t];
    }
  }
  if (!holes) return softmax_row(scores, T, mx);
  std::copy(scores, scores + full, packed);
  const float inv = softmax_row(packed, n, mx);
  softmax_row(scores, T, mx);  // the exponentials in place for the weighted sum of values (the same per key)
  return inv;
}

// R query rows q[r] [16 * CH] (fp32) of one head over keys/values [T, 16 * CH] (bf16, row stride ld); every
// row sees the first `full` keys, and beyond them row r skips the keys with see(r, t) false; writes the bf16
// outputs out[r]. Each key and value is loaded once for all R rows (a verify's extra rows then cost little
// memory traffic), and each row's arithmetic is the same instruction sequence as when it is alone: every
// visible key in the same order and lanes whatever T, R and the mask are, so a row's result does not
// depend on the other rows of the forward.
template <int R, int CH, typename See>
void attend_rows(const float* const* q, const uint16_t* k, const uint16_t* v, int64_t ld, int64_t T,
                 int64_t full, float scale, See see, float* const* scores, float* packed,
                 c10::BFloat16* const* out) {
  __m512 qv[R][CH];
  float mx[R];
  for (int r = 0; r < R; ++r) {
    mx[r] = -INFINITY;
    for (int c = 0; c < CH; ++c) qv[r][c] = _mm512_loadu_ps(q[r] + 16 * c);
  }
  auto score = [&](int r, int64_t t, const __m512* kc) {
    __m512 acc = _mm512_mul_ps(qv[r][0], kc[0]);
    for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(qv[r][c], kc[c], acc);
    const float sc = _mm512_reduce_add_ps(acc) * scale;
    scores[r][t] = sc;
    mx[r] = std::max(mx[r], sc);
  };
  int64_t t = 0;
  for (; t < full; ++t) {  // seen by every row
    __m512 kc[CH];
    for (int c = 0; c < CH; ++c) kc[c] = load16(k + t * ld + 16 * c);
    for (int r = 0; r < R; ++r) score(r, t, kc);
  }
  for (; t < T; ++t) {
    __m512 kc[CH];
    for (int c = 0; c < CH; ++c) kc[c] = load16(k + t * ld + 16 * c);
    for (int r = 0; r < R; ++r) {
      if (see(r, t)) score(r, t, kc);
      else scores[r][t] = -INFINITY;
    }
  }
  float inv[R];
  for (int r = 0; r < R; ++r) inv[r] = softmax_row_holes(scores[r], T, full, mx[r], packed);
  __m512 o[R][CH];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CH; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < T; ++u) {
    __m512 vc[CH];
    for (int c = 0; c < CH; ++c) vc[c] = load16(v + u * ld + 16 * c);
    for (int r = 0; r < R; ++r) {
      if (scores[r][u] == 0.0f) continue;  // masked (or vanishing) keys add nothing
      const __m512 p = _mm512_set1_ps(scores[r][u]);
      for (int c = 0; c < CH; ++c) o[r][c] = _mm512_fmadd_ps(p, vc[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CH; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], _mm512_set1_ps(inv[r])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * c), (__m256i)h);
    }
}

template <int CH, typename See>
void attend_n(int n, const float* const* q, const uint16_t* k, const uint16_t* v, int64_t ld, int64_t T,
              int64_t full, float scale, See see, float* const* sc, float* pk, c10::BFloat16* const* o) {
  switch (n) {
    case 1: attend_rows<1, CH>(q, k, v, ld, T, full, scale, see, sc, pk, o); break;
    case 2: attend_rows<2, CH>(q, k, v, ld, T, full, scale, see, sc, pk, o); break;
    case 3: attend_rows<3, CH>(q, k, v, ld, T, full, scale, see, sc, pk, o); break;
    default: attend_rows<4, CH>(q, k, v, ld, T, full, scale, see, sc, pk, o); break;
  }
}

constexpr int AR = 4;  // query rows per attend_rows call

}  // namespace

// Grouped-query attention of S new rows: q [S, H, hd] (post-RoPE, any row/head strides), keys and
// values [Hkv, capacity, hd] of one layer (first T rows valid), mask [S, T] bool or None (row s sees
// keys 0 .. T - S + s). Returns [S, H * hd] bf16: the o_proj input.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t T,
                            const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "decode_attention: bf16 expected");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.strides() == k.strides() && k.sizes() == v.sizes(),
              "decode_attention: q [S, H, hd], k/v [Hkv, capacity, hd] with rows contiguous");
  const int64_t S = q.size(0), H = q.size(1), hd = q.size(2), Hkv = k.size(0);
  TORCH_CHECK(k.size(2) == hd && hd % 16 == 0 && hd <= 128 && H % Hkv == 0 && T <= k.size(1) && T >= S,
              "decode_attention: head_dim a multiple of 16 up to 128, heads a multiple of K/V heads");
  const uint8_t* mp = nullptr;
  at::Tensor mc;
  if (mask.has_value()) {
    mc = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mc.dim() == 2 && mc.size(0) == S && mc.size(1) == T, "decode_attention: mask [S, T]");
    mp = reinterpret_cast<const uint8_t*>(mc.data_ptr<bool>());
  }
  auto out = at::empty({S, H * hd}, q.options());
  const auto qf = q.to(at::kFloat);  // [S, H, hd] fp32 (strides of q kept by to())
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t group = H / Hkv, past = T - S;
  at::parallel_for(0, H, 1, [&](int64_t b, int64_t e) {  // one head's rows per task: its keys read once
    std::vector<float> buf((AR + 1) * (T + 16));  // each row's scores, then one row's visible keys packed
    for (int64_t h = b; h < e; ++h) {
      const uint16_t* kh = kp + (h / group) * k.stride(0);
      const uint16_t* vh = vp + (h / group) * k.stride(0);
      for (int64_t s0 = 0; s0 < S; s0 += AR) {
        const int n = (int)std::min<int64_t>(AR, S - s0);
        const float* qr[AR];
        float* sc[AR];
        c10::BFloat16* orow[AR];
        for (int r = 0; r < n; ++r) {
          qr[r] = qf.data_ptr<float>() + (s0 + r) * qf.stride(0) + h * qf.stride(1);
          sc[r] = buf.data() + r * (T + 16);
          orow[r] = out.data_ptr<at::BFloat16>() + (s0 + r) * H * hd + h * hd;
        }
        float* pk = buf.data() + AR * (T + 16);
        auto run = [&](int64_t full, auto see) {
          switch (hd / 16) {
            case 1: attend_n<1>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            case 2: attend_n<2>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            case 3: attend_n<3>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            case 4: attend_n<4>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            case 5: attend_n<5>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            case 6: attend_n<6>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            case 7: attend_n<7>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
            default: attend_n<8>(n, qr, kh, vh, hd, T, full, scale, see, sc, pk, orow); break;
          }
        };
        if (mp) {
          const uint8_t* rows = mp + s0 * T;
          int64_t full = T;  // the keys every row of the block sees (the cache, for a tree's rows)
          for (int r = 0; r < n; ++r) {
            int64_t f = 0;
            while (f < full && rows[r * T + f]) ++f;
            full = f;
          }
          run(full, [rows, T](int r, int64_t t) { return rows[r * T + t] != 0; });
        } else {
          const int64_t last = past + s0;  // row r sees keys 0 .. last + r
          run(last + 1, [last](int r, int64_t t) { return t <= last + r; });
        }
      }
    }
  });
  return out;
}


at::Tensor skinny_linear_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "skinny_linear_i8: bf16 x, int8 w and fp32 scale expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && scale.dim() == 1 && scale.size(0) == w.size(0),
              "skinny_linear_i8: x [M, K], w [N, K], scale [N]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && x.device().is_cpu(),
              "skinny_linear_i8: contiguous CPU tensors");
  TORCH_CHECK(w.size(0) % NJ == 0, "skinny_linear_i8: output features must be a multiple of ", NJ);
  const Int8Weights wt{w.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(1)};
  return skinny(x, wt, w.size(0), x.size(1));
}

at::Tensor skinny_linear_q4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kByte && scale.scalar_type() == at::kBFloat16,
              "skinny_linear_q4: bf16 x, uint8 w (two int4 per byte) and bf16 scale expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 2 && 2 * w.size(1) == x.size(1) &&
              scale.size(0) == w.size(0) && scale.size(1) > 0 && x.size(1) % scale.size(1) == 0,
              "skinny_linear_q4: x [M, K], w [N, K / 2], scale [N, K / G]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && x.device().is_cpu(),
              "skinny_linear_q4: contiguous CPU tensors");
  const int64_t N = w.size(0), K = x.size(1), G = K / scale.size(1);
  TORCH_CHECK(N % NJ == 0, "skinny_linear_q4: output features must be a multiple of ", NJ);
  TORCH_CHECK(K % 64 == 0 && (G == 32 || G == 64 || G == 128),
              "skinny_linear_q4: input features a multiple of 64 in groups of 32, 64 or 128, got K ", K, ", G ", G);
  const Int4Weights wt{w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>()), K,
                       scale.size(1), K / 2 >= 1024 ? K / 2 : 0};
  switch (G) {
    case 32: return skinny(x, Int4Group<32>{wt}, N, K / 2);
    case 64: return skinny(x, Int4Group<64>{wt}, N, K / 2);
    default: return skinny(x, Int4Group<128>{wt}, N, K / 2);
  }
}

// ---- the small ops around the matmuls of a few rows: one call each instead of a chain of torch ops ----

namespace {

// sum of squares of x[0, n) (bf16, n % 16 == 0), fp32 lanes then one reduction
inline float sum_squares(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// bf16 [16] at p <- fp32 [16] (nearest even)
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// v rounded to bf16 (nearest even) and back: what a torch op on bf16 tensors leaves of an fp32 result
inline __m512 bf16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

}  // namespace

// out[s] = x[s] / rms(x[s]) * w for rows of x [S, N] and out [S, N] (bf16, unit stride along N, any row stride: out
// may be a column block of a wider tensor), in fp32 with one rounding to bf16; ``round_twice``: the normalized row
// is rounded to bf16 before the product with w, as transformers' Llama RMSNorm does (``w * normed.to(bf16)``).
void rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor out, bool round_twice) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat,
              "rms_norm_out: bf16 x and out, fp32 w");
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous() &&
              w.numel() == x.size(1) && x.size(1) % 16 == 0, "rms_norm_out: x, out [S, N] (N % 16 == 0), w [N]");
  const int64_t S = x.size(0), N = x.size(1);
  const float* wp = w.data_ptr<float>();
  for (int64_t r = 0; r < S; ++r) {
    const auto* xr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * x.stride(0);
    auto* yr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + r * out.stride(0);
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(sum_squares(xr, N) / (float)N + (float)eps));
    for (int64_t i = 0; i < N; i += 16) {
      __m512 normed = _mm512_mul_ps(load16(xr + i), inv);
      if (round_twice) normed = bf16_round(normed);
      store16(yr + i, _mm512_mul_ps(normed, _mm512_loadu_ps(wp + i)));
    }
  }
}

// Neox RoPE in place on x [S, heads, hd] (bf16, unit stride along hd, any row/head strides) with cos, sin [S, hd]
// (fp32): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves, in fp32, rounded once; ``bf16_ops``:
// each product and the sum rounded to bf16, as the same torch ops on bf16 tensors (and bf16 tables) round them.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool bf16_ops) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_: bf16 x, fp32 cos and sin");
  const int64_t S = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && half % 16 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.sizes() == sin.sizes() && cos.size(0) == S && cos.size(1) == hd,
              "rope_: x [S, heads, hd] (hd % 32 == 0), cos/sin [S, hd]");
  auto* base = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  auto rnd = [bf16_ops](__m512 v) { return bf16_ops ? bf16_round(v) : v; };
  for (int64_t r = 0; r < S; ++r) {
    const float* c = cos.data_ptr<float>() + r * hd;
    const float* sn = sin.data_ptr<float>() + r * hd;
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* p = base + r * x.stride(0) + h * x.stride(1);
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 a = load16(p + i), b = load16(p + half + i);
        store16(p + i, _mm512_sub_ps(rnd(_mm512_mul_ps(a, _mm512_loadu_ps(c + i))),
                                     rnd(_mm512_mul_ps(b, _mm512_loadu_ps(sn + i)))));
        store16(p + half + i, _mm512_add_ps(rnd(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + i))),
                                            rnd(_mm512_mul_ps(a, _mm512_loadu_ps(sn + half + i)))));
      }
    }
  }
}

// The index of each row's largest value in x [S, V] (bf16, rows contiguous): the first one where several are equal,
// as torch.argmax; NaN is never the largest (torch's argmax would pick it).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "argmax_rows: bf16 x [S, V]");
  const int64_t S = x.size(0), V = x.size(1);
  auto out = at::empty({S}, x.options().dtype(at::kLong));
  auto* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < S; ++r) {
    const auto* xr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * x.stride(0);
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i where = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {  // per lane: the first index of its largest value
      const __m512 v = load16(xr + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      where = _mm512_mask_mov_epi32(where, gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    alignas(64) float bv[16];
    alignas(64) int32_t bi[16];
    _mm512_store_ps(bv, best);
    _mm512_store_si512(bi, where);
    float m = -INFINITY;
    int64_t at_ = 0;
    for (int l = 0; l < 16; ++l)
      if (bv[l] > m || (bv[l] == m && bi[l] < at_)) m = bv[l], at_ = bi[l];
    for (; i < V; ++i) {
      const float v = c10::BFloat16(xr[i], c10::BFloat16::from_bits());
      if (v > m) m = v, at_ = i;
    }
    op[r] = at_;
  }
  return out;
}

bool amx_available() { return amx_ready(); }
bool set_amx(bool on) { return amx_on.exchange(on); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("skinny_linear", &skinny_linear, "y = x @ w.T, bf16, few rows");
  m.def("amx_available", &amx_available, "whether skinny_linear can run bf16 weights on AMX here");
  m.def("set_amx", &set_amx, "AMX on or off for skinny_linear (returns the previous setting)");
  m.def("decode_attention", &decode_attention, "grouped-query attention of a few bf16 rows");
  m.def("skinny_linear_i8", &skinny_linear_i8, "y = x @ (w * scale).T, bf16 x, int8 w, few rows");
  m.def("skinny_linear_q4", &skinny_linear_q4, "y = x @ dequantized(w).T, bf16 x, int4 w in scaled groups, few rows");
  m.def("rms_norm_out", &rms_norm_out, "out = x / rms(x) * w, bf16 rows, fp32 math");
  m.def("rope_", &rope_, "neox RoPE in place on bf16 [S, heads, hd]");
  m.def("argmax_rows", &argmax_rows, "first index of each bf16 row's maximum"); }
