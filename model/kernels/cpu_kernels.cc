// CPU kernels for XLA:CPU through the FFI, compiled on first use by `cpu_kernels.py` (which also
// checks that the CPU has AVX-512 BF16 and VNNI). Two of them are for the two places where a batched decode
// step on a CPU spent most of its time in XLA's generic code; the third reads int8 weights:
//
// jaxgen_bf16_matmul: out[M, N] (float32) = x[M, K] (bf16) . w[N, K]^T (bf16), for a few
//   activation rows against every weight. XLA:CPU ran that at ~60-75% of its own large-matmul
//   rate; this reads each weight row once from its stored [out, in] layout (no repacking), with
//   software prefetch, into AVX-512 BF16 dot-product instructions (vdpbf16ps).
//   Tiling: 4 weight rows x 4 activation rows = 16 float32 accumulators of 16 lanes, each lane a
//   partial dot product over K, summed across lanes together at the end. The weight rows of a tile
//   stay in L1 while all activation rows pass over them.
//
// jaxgen_int8_matmul: out[M, N] (float32) = x[M, K] (float32) . (w[N, K] (int8) * scale)^T, with
//   one float32 scale per 32 consecutive weights of a row (`model/quant.py`'s layout). The weights
//   are read as stored, 1.125 bytes each, into AVX-512 VNNI integer dot products (vpdpbusd: 64
//   int8 products per instruction). For that the activations are split into two int8 parts with a
//   float32 step per group of 4 (the 4 bytes one lane sums): each is off by at most 1/16256 of its
//   group's max |x| (bf16 rounds to 1/512 of the value). One int8 part (llama.cpp's way) was 1.1x faster
//   but moved the embedded model's golden top-1 agreement under the 98% bar; widening each weight
//   to float32 for FMAs (the previous kernel) was 1.05-1.2x slower at one row. Same tiling as above.
//
// jaxgen_cache_attention: folds the keys [0, limit) of a float32 KV cache block into a running
//   softmax state (max, sum of exp, exp-weighted sum of values) for a few query rows per kv head,
//   reading keys and values where they lie. XLA copied every key/value chunk out of the cache
//   before its matmuls, and paid per-op overhead on each small step of its loop.
//
// Work is split between the calling thread and XLA's intra-op threads (`ParallelFor`).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Runs fn(i) for i in [0, n) on the calling thread and up to num_threads - 1 pool threads.
// Items are claimed from a shared counter, so the caller never waits for a thread that has not
// started (it takes what nobody claimed), only for items already being worked on; a late task
// finds nothing left and returns (the state it holds outlives the call).
void ParallelFor(ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n;
    std::function<void(int64_t)> fn;
    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>();
  state->n = n;
  state->fn = std::move(fn);
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Work(); });
  state->Work();
  while (state->done.load(std::memory_order_acquire) < n) _mm_pause();
}

//===----------------------------------------------------------------------===//
// bf16 matmul
//===----------------------------------------------------------------------===//

constexpr int64_t kTileN = 4;  // weight rows per tile
constexpr int64_t kTileM = 4;  // activation rows per tile
constexpr int64_t kStepK = 32;  // bf16 elements per vector
constexpr int64_t kPrefetchTiles = 2;  // how far ahead weight rows are prefetched

// Lane sums of r[0..15] -> one vector, lane (j % 4) * 4 + j / 4 holding the sum of r[j].
inline __m512 SumLanes16(const __m512* r) {
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) {
    __m512 a = r[2 * i], b = r[2 * i + 1];
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    __m512 a = s8[2 * i], b = s8[2 * i + 1];
    s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    __m512 a = s4[2 * i], b = s4[2 * i + 1];
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
}

// One tile: rows [m, m + TM) of x against rows [n, n + TN) of w. Missing rows add zeros.
// ahead: null, or the first of kTileN weight rows to pull into L2 meanwhile (a later tile's).
template <int TM, int TN>
inline void Tile(const uint16_t* x, const uint16_t* w, float* out, int64_t m, int64_t n, int64_t N,
                 int64_t K, const uint16_t* ahead) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStepK) {
    if (ahead)
      for (int j = 0; j < kTileN; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + k), _MM_HINT_T1);
    __m512bh wv[TN], xv[TM];
    for (int j = 0; j < TN; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n + j) * K + k);
    for (int i = 0; i < TM; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + (m + i) * K + k);
    for (int i = 0; i < TM; ++i)
      for (int j = 0; j < TN; ++j) acc[i * 4 + j] = _mm512_dpbf16_ps(acc[i * 4 + j], xv[i], wv[j]);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, SumLanes16(acc));
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) out[(m + i) * N + n + j] = sums[j * 4 + i];
}

// All of x against weight rows [n, n + TN). The first pass over them also prefetches the rows
// two tiles on, into L2 (L1 holds x and the current tile): at 16 rows of x that took the logits
// matmul from 34 to 21-23 ms (hardware prefetch alone, or prefetch into L1, left it stalling).
template <int TN>
void Rows(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t n, int64_t N, int64_t K) {
  const int64_t next = n + kPrefetchTiles * kTileN;
  const uint16_t* ahead = next + kTileN <= N ? w + next * K : nullptr;
  int64_t m = 0;
  for (; m + kTileM <= M; m += kTileM, ahead = nullptr) Tile<kTileM, TN>(x, w, out, m, n, N, K, ahead);
  switch (M - m) {
    case 3: Tile<3, TN>(x, w, out, m, n, N, K, ahead); break;
    case 2: Tile<2, TN>(x, w, out, m, n, N, K, ahead); break;
    case 1: Tile<1, TN>(x, w, out, m, n, N, K, ahead); break;
  }
}

// Weight rows [n0, n1) against all of x.
void Span(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) Rows<4>(x, w, out, M, n, N, K);
  switch (n1 - n) {
    case 3: Rows<3>(x, w, out, M, n, N, K); break;
    case 2: Rows<2>(x, w, out, M, n, N, K); break;
    case 1: Rows<1>(x, w, out, M, n, N, K); break;
  }
}

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("jaxgen_bf16_matmul: expected x [M, K] and w [N, K]");
  const int64_t M = xd[0], N = wd[0], K = xd[1];
  if (K % kStepK) return ffi::Error::InvalidArgument("jaxgen_bf16_matmul: K must be a multiple of 32");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* op = out->typed_data();
  // Chunks of weight rows: ~16 per thread, so that the threads finish close together, and whole
  // tiles, so that only the last chunk has a ragged end.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t target = std::max<int64_t>(kTileN, N / (16 * threads));
  const int64_t chunk = (target + kTileN - 1) / kTileN * kTileN;
  ParallelFor(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    Span(xp, wp, op, M, N, K, c * chunk, std::min(N, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

//===----------------------------------------------------------------------===//
// int8 (blocks of 32, float32 scales) matmul
//===----------------------------------------------------------------------===//

constexpr int64_t kBlock = 32;  // int8 weights per scale
constexpr int64_t kChunk = 64;  // weights per VNNI step: two blocks
constexpr int64_t kGroup = 4;  // activations per scale: the 4 bytes one VNNI lane sums

// Activation rows x [M, K] -> two int8 parts per activation and a float32 step d / 256 per group of 4
// (the 4 bytes one VNNI lane sums), x ~ d * (hi + lo / 256): hi = round(x / d) with
// d = max |x| over the group / 127, lo = 2 * round(128 * (x / d - hi)), even and within +-126.
// Each activation is then off by at most d / 128 (1/16256 of its group's max |x|; bf16 rounds to
// 1/512 of the value). c [M, Kp / 4] = -128 * (sum of hi) - (sum of lo) / 2 per group
// (see `Int8Tile`); the rows are padded with zeros to Kp = K rounded up to 64.
void QuantizeRow(const float* x, int64_t K, int64_t Kp, int8_t* hi, int8_t* lo, float* d, int32_t* c) {
  const __m512 inv127 = _mm512_set1_ps(1.0f / 127.0f), f127 = _mm512_set1_ps(127.0f);
  const __m512 per256 = _mm512_set1_ps(1.0f / 256.0f);
  const __m512 f128 = _mm512_set1_ps(128.0f), f63 = _mm512_set1_ps(63.0f), fm63 = _mm512_set1_ps(-63.0f);
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  const __m512i m128 = _mm512_set1_epi32(-128);
  for (int64_t k = 0; k < Kp; k += 16) {
    const __m512 v = k < K ? _mm512_loadu_ps(x + k) : _mm512_setzero_ps();
    __m512 a = _mm512_abs_ps(v);
    a = _mm512_max_ps(a, _mm512_permute_ps(a, 0xB1));
    a = _mm512_max_ps(a, _mm512_permute_ps(a, 0x4E));  // each lane: its group's max |x|
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_OQ), f127, a);
    const __m512 t = _mm512_mul_ps(v, inv);
    const __m512 h = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_min_ps(f63, _mm512_max_ps(fm63, _mm512_roundscale_ps(
        _mm512_mul_ps(_mm512_sub_ps(t, h), f128), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512i hq = _mm512_cvtps_epi32(h), lq = _mm512_slli_epi32(_mm512_cvtps_epi32(r), 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtsepi32_epi8(hq));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtsepi32_epi8(lq));
    // per lane: -128 * hq - lq / 2 = -128 * hq - r, summed over the group
    __m512i s = _mm512_sub_epi32(_mm512_mullo_epi32(hq, m128), _mm512_cvtps_epi32(r));
    s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0xB1));
    s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0x4E));
    const __m512 step = _mm512_mul_ps(_mm512_mul_ps(a, inv127), per256);
    _mm_storeu_ps(d + k / kGroup, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, step)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + k / kGroup),
                     _mm512_castsi512_si128(_mm512_permutexvar_epi32(firsts, s)));
  }
}

struct QuantizedRows {
  int64_t Kp;
  std::vector<int8_t> hi, lo;
  std::vector<float> d;
  std::vector<int32_t> c;
};

// Rows [m, m + TM) of the quantized activations against weight rows [n, n + TN). Each 64 weights
// of a row are flipped to unsigned (w ^ 0x80 = w + 128) for vpdpbusd, whose 16 lanes each add 4
// products to what they hold: t = c + sum (w + 128) hi, then 256 t + sum (w + 128) lo, in which
// c cancels every 128 and leaves 256 sum w hi + sum w lo exactly (int32: |.| < 2^25). To float32,
// times the group's d / 256 and the block's scale. Missing rows add zeros; a K ending in half a
// chunk reads half.
template <int TM, int TN>
inline void Int8Tile(const QuantizedRows& xq, const int8_t* w, const float* scale, float* out, int64_t m, int64_t n,
                     int64_t N, int64_t K, const int8_t* ahead) {
  const int64_t blocks = K / kBlock, Kp = xq.Kp;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kChunk) {
    if (ahead)
      for (int j = 0; j < kTileN; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + k), _MM_HINT_T1);
    const bool full = k + kChunk <= K;
    __m512i wv[TN];
    __m512 ws[TN];
    for (int j = 0; j < TN; ++j) {
      const int8_t* row = w + (n + j) * K + k;
      const float* s = scale + (n + j) * blocks + k / kBlock;
      wv[j] = _mm512_xor_si512(full ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row), flip);
      ws[j] = _mm512_permutexvar_ps(pick, _mm512_maskz_loadu_ps(full ? 0x3 : 0x1, s));
    }
    for (int i = 0; i < TM; ++i) {
      const int64_t row = m + i;
      const __m512i hv = _mm512_loadu_si512(xq.hi.data() + row * Kp + k);
      const __m512i lv = _mm512_loadu_si512(xq.lo.data() + row * Kp + k);
      const __m512i cv = _mm512_loadu_si512(xq.c.data() + (row * Kp + k) / kGroup);
      const __m512 dv = _mm512_loadu_ps(xq.d.data() + (row * Kp + k) / kGroup);
      for (int j = 0; j < TN; ++j) {
        const __m512i t = _mm512_slli_epi32(_mm512_dpbusd_epi32(cv, wv[j], hv), 8);
        acc[i * 4 + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(t, wv[j], lv)),
                                         _mm512_mul_ps(dv, ws[j]), acc[i * 4 + j]);
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, SumLanes16(acc));
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) out[(m + i) * N + n + j] = sums[j * 4 + i];
}

template <int TN>
void Int8Rows(const QuantizedRows& xq, const int8_t* w, const float* scale, float* out, int64_t M, int64_t n,
              int64_t N, int64_t K) {
  const int64_t next = n + kPrefetchTiles * kTileN;
  const int8_t* ahead = next + kTileN <= N ? w + next * K : nullptr;
  int64_t m = 0;
  for (; m + kTileM <= M; m += kTileM, ahead = nullptr) Int8Tile<kTileM, TN>(xq, w, scale, out, m, n, N, K, ahead);
  switch (M - m) {
    case 3: Int8Tile<3, TN>(xq, w, scale, out, m, n, N, K, ahead); break;
    case 2: Int8Tile<2, TN>(xq, w, scale, out, m, n, N, K, ahead); break;
    case 1: Int8Tile<1, TN>(xq, w, scale, out, m, n, N, K, ahead); break;
  }
}

void Int8Span(const QuantizedRows& xq, const int8_t* w, const float* scale, float* out, int64_t M, int64_t N,
              int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) Int8Rows<4>(xq, w, scale, out, M, n, N, K);
  switch (n1 - n) {
    case 3: Int8Rows<3>(xq, w, scale, out, M, n, N, K); break;
    case 2: Int8Rows<2>(xq, w, scale, out, M, n, N, K); break;
    case 1: Int8Rows<1>(xq, w, scale, out, M, n, N, K); break;
  }
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || sd.size() != 2 || sd[0] != wd[0] ||
      sd[1] * kBlock != wd[1])
    return ffi::Error::InvalidArgument("jaxgen_int8_matmul: expected x [M, K], w [N, K] and scale [N, K / 32]");
  const int64_t M = xd[0], N = wd[0], K = xd[1];
  const float* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* op = out->typed_data();
  QuantizedRows xq;
  xq.Kp = (K + kChunk - 1) / kChunk * kChunk;
  xq.hi.resize(M * xq.Kp);
  xq.lo.resize(M * xq.Kp);
  xq.d.resize(M * xq.Kp / kGroup);
  xq.c.resize(M * xq.Kp / kGroup);
  const int64_t Kp = xq.Kp;
  auto quantize = [&](int64_t i) {
    QuantizeRow(xp + i * K, K, Kp, xq.hi.data() + i * Kp, xq.lo.data() + i * Kp, xq.d.data() + i * Kp / kGroup,
                xq.c.data() + i * Kp / kGroup);
  };
  if (M >= 16) ParallelFor(pool, M, quantize);
  else for (int64_t i = 0; i < M; ++i) quantize(i);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t target = std::max<int64_t>(kTileN, N / (16 * threads));
  const int64_t chunk = (target + kTileN - 1) / kTileN * kTileN;
  const QuantizedRows* xqp = &xq;
  ParallelFor(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    Int8Span(*xqp, wp, sp, op, M, N, K, c * chunk, std::min(N, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

//===----------------------------------------------------------------------===//
// Attention over a cache block
//===----------------------------------------------------------------------===//

constexpr int64_t kKeyBlock = 16;  // keys scored before their values are folded in

inline float Dot(const float* a, const float* b, int64_t h) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// acc[0, h) = acc * scale + sum_j p[j] * v[j * h + ...]
inline void ScaleAdd(float* acc, float scale, const float* p, const float* v, int64_t n, int64_t h) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < h; i += 16) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + i), s);
    for (int64_t j = 0; j < n; ++j)
      if (p[j] != 0.0f) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * h + i), a);
    _mm512_storeu_ps(acc + i, a);
  }
}

// One (batch row, kv head): R query rows against keys [0, limit) of S, state updated in place.
// Visibility is `layers.attention_mask`: key position kp >= 0, kp <= qp, and qp - kp < window.
void AttendPair(const float* q, const float* k, const float* v, const int32_t* kpos, const int32_t* qpos,
                int64_t R, int64_t H, int64_t limit, int64_t window, float softcap, float* m, float* l,
                float* acc) {
  std::vector<float> s(R * kKeyBlock);
  std::vector<float> p(kKeyBlock);
  for (int64_t s0 = 0; s0 < limit; s0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, limit - s0);
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + (s0 + j) * H;
      for (int64_t r = 0; r < R; ++r) s[r * kKeyBlock + j] = Dot(q + r * H, kj, H);
    }
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.data() + r * kKeyBlock;
      float top = m[r];
      bool any = false;
      for (int64_t j = 0; j < n; ++j) {
        const int32_t kp = kpos[s0 + j], qp = qpos[r];
        const bool visible = kp >= 0 && kp <= qp && (window <= 0 || qp - kp < window);
        if (!visible) {
          p[j] = -INFINITY;
          continue;
        }
        float x = sr[j];
        if (softcap > 0.0f) x = std::tanh(x / softcap) * softcap;
        p[j] = x;
        top = std::max(top, x);
        any = true;
      }
      if (!any) continue;
      const float scale = std::exp(m[r] - top);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = p[j] == -INFINITY ? 0.0f : std::exp(p[j] - top);
        sum += p[j];
      }
      m[r] = top;
      l[r] = l[r] * scale + sum;
      ScaleAdd(acc + r * H, scale, p.data(), v + s0 * H, n, H);
    }
  }
}

// q [B, K, R, H] (scaled), k and v [B', K, S, H] of which the first B rows are read (a decode step
// over the lowest rows of a larger cache), key positions [B, S], query positions [B, R],
// limit [] (no key at index >= limit is read), running state m, l [B, K, R] and acc [B, K, R, H]
// -> the state with keys [0, limit) folded in.
ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> kpos, ffi::Buffer<ffi::S32> qpos,
                              ffi::Buffer<ffi::S32> limit, ffi::Buffer<ffi::F32> m_in, ffi::Buffer<ffi::F32> l_in,
                              ffi::Buffer<ffi::F32> acc_in, int64_t window, float softcap,
                              ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> l_out,
                              ffi::ResultBuffer<ffi::F32> acc_out) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] > kd[0] || qd[1] != kd[1] || qd[3] != kd[3] || qd[3] % 16)
    return ffi::Error::InvalidArgument(
        "jaxgen_cache_attention: expected q [B, K, R, H], k [B' >= B, K, S, H], H % 16 == 0");
  const int64_t B = qd[0], KH = qd[1], R = qd[2], H = qd[3], S = kd[2];
  const int64_t lim = std::clamp<int64_t>(limit.typed_data()[0], 0, S);
  std::memcpy(m_out->typed_data(), m_in.typed_data(), m_in.size_bytes());
  std::memcpy(l_out->typed_data(), l_in.typed_data(), l_in.size_bytes());
  std::memcpy(acc_out->typed_data(), acc_in.typed_data(), acc_in.size_bytes());
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t *kpp = kpos.typed_data(), *qpp = qpos.typed_data();
  float *mp = m_out->typed_data(), *lp = l_out->typed_data(), *ap = acc_out->typed_data();
  ParallelFor(pool, B * KH, [=](int64_t i) {
    const int64_t b = i / KH;
    AttendPair(qp + i * R * H, kp + i * S * H, vp + i * S * H, kpp + b * S, qpp + b * R, R, H, lim, window,
               softcap, mp + i * R, lp + i * R, ap + i * R * H);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // key positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // limit
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // l
                                  .Arg<ffi::Buffer<ffi::F32>>()  // acc
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 when this CPU can run the kernels (AVX-512 F/BW, BF16 and VNNI), checked at run time.
extern "C" int jaxgen_bf16_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
}
