// Decode attention over a paged KV pool, read in place (see native_attention.py for how it is built).
//
// For every decoding sequence b and KV head h (one work unit): the G query heads that share h are scored against
// each key of the sequence's context, walking its block table (slot = table[p / bs] * bs + p % bs):
//   s[j][p] = ((q[j] * scale) . K[h][slot]) * k_scale[h][slot]      (scale: 1/sqrt(d); k_scale: int8 pools only)
// then a two-pass softmax (maximum, then exp and sum), then
//   out[j] = sum_p exp(s[j][p] - max_j) * v_scale[h][slot] * V[h][slot] / sum_p exp(s[j][p] - max_j).
// The same arithmetic as the PyTorch path in model.py (scales multiply the score and the probability), except
// that no K/V is gathered or widened to fp32 in memory: each row (int8, bfloat16, float16 or float32) is widened
// in registers.
// Work units run on torch's own thread pool (at::parallel_for, one task per thread) and are handed out
// dynamically from an atomic counter, longest first, so ragged contexts balance across threads.
//
// Vectors are GCC vector extensions as wide as the target's registers (-march=native: 16 floats with AVX-512,
// 8 with AVX2), with intrinsics for the int8 widening and horizontal sums. exp is a Cephes-style polynomial
// (about 1 ulp on [-87, 0]).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int D = 64;  // head dimension this kernel is written for (SmolLM2's)

// One vector register of floats: 16 with AVX-512, 8 with AVX2, 4 otherwise (generic code; wider-than-hardware
// GCC vectors are lowered badly: 16-float vectors on AVX2 ran as slowly as the PyTorch path).
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX2__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
constexpr int C = D / W;  // vectors per head row

typedef float fvec __attribute__((vector_size(4 * W)));
typedef int32_t ivec __attribute__((vector_size(4 * W)));
typedef float fvec_u __attribute__((vector_size(4 * W), aligned(4)));

// W int8 -> W floats (GCC lowers __builtin_convertvector from int8 to byte-by-byte scalar code, hence intrinsics)
inline fvec load_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (fvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  fvec r;
  for (int i = 0; i < W; ++i) r[i] = p[i];
  return r;
#endif
}
inline fvec loadu(const float* p) { return *reinterpret_cast<const fvec_u*>(p); }

// W KV elements of the pool's type -> W floats
inline fvec load_kv(const int8_t* p) { return load_i8(p); }
inline fvec load_kv(const float* p) { return loadu(p); }
inline fvec load_kv(const c10::Half* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return (fvec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  fvec r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<float>(p[i]);
  return r;
#endif
}
inline fvec load_kv(const c10::BFloat16* p) {  // bfloat16 is the top half of a float
#if defined(__AVX512F__)
  return (fvec)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return (fvec)_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  fvec r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<float>(p[i]);
  return r;
#endif
}
inline void storeu(float* p, fvec v) { *reinterpret_cast<fvec_u*>(p) = v; }
inline fvec splat(float x) { return fvec{} + x; }

inline float hsum(fvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  const __m256 x = (__m256)v;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

inline fvec vexp(fvec x) {  // Cephes expf
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const fvec fx = x * 1.44269504088896341f + 0.5f;
  fvec fl = __builtin_convertvector(__builtin_convertvector(fx, ivec), fvec);
  fl = fl > fx ? fl - 1.0f : fl;  // floor (the conversion truncates toward zero)
  x = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  fvec y = splat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * (x * x) + x + 1.0f;
  const ivec e = (__builtin_convertvector(fl, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &e, sizeof e);
  return y * scale;
}

template <typename T>
struct Pool {
  const T* k;
  const T* v;
  const float* ks;  // int8 pools only (else null)
  const float* vs;
  int64_t slots;  // per head
  int64_t bs;
};

// One (sequence, KV head): q [G][D] (times `scale` here), out [G][D]; scores is scratch of at least G * (ctx + W) floats.
template <typename T, int G>
void attend_one(const Pool<T>& pool, int64_t h, const int32_t* table, int64_t ctx, const float* q, float scale,
                float* out, float* scores) {
  const int64_t stride = ctx + W;  // room for a vector's tail
  constexpr bool scaled = std::is_same_v<T, int8_t>;
  const T* kh = pool.k + h * pool.slots * D;
  const T* vh = pool.v + h * pool.slots * D;
  const float* ksh = scaled ? pool.ks + h * pool.slots : nullptr;
  const float* vsh = scaled ? pool.vs + h * pool.slots : nullptr;
  fvec qv[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) qv[j][c] = loadu(q + j * D + c * W) * scale;
  float mx[G];
  for (int j = 0; j < G; ++j) mx[j] = -INFINITY;
  // pass 1: scores, walking the block table
  for (int64_t p0 = 0, bi = 0; p0 < ctx; p0 += pool.bs, ++bi) {
    const int64_t slot0 = static_cast<int64_t>(table[bi]) * pool.bs;
    const int64_t n = std::min(pool.bs, ctx - p0);
    const T* kr = kh + slot0 * D;
    const float* ks = scaled ? ksh + slot0 : nullptr;
    for (int64_t t = 0; t < n; ++t, kr += D) {
      fvec kf[C];
      for (int c = 0; c < C; ++c) kf[c] = load_kv(kr + c * W);
      for (int j = 0; j < G; ++j) {
        fvec acc = qv[j][0] * kf[0];
        for (int c = 1; c < C; ++c) acc += qv[j][c] * kf[c];
        float s = hsum(acc);
        if constexpr (scaled) s *= ks[t];
        scores[j * stride + p0 + t] = s;
        mx[j] = std::max(mx[j], s);
      }
    }
  }
  // pass 2: probabilities (unnormalised) and their sums
  float sum[G];
  for (int j = 0; j < G; ++j) {
    float* s = scores + j * stride;
    const fvec m = splat(mx[j]);
    fvec acc{};
    int64_t p = 0;
    for (; p + W <= ctx; p += W) {
      const fvec e = vexp(loadu(s + p) - m);
      storeu(s + p, e);
      acc += e;
    }
    float total = hsum(acc);
    for (; p < ctx; ++p) {
      s[p] = std::exp(s[p] - mx[j]);
      total += s[p];
    }
    sum[j] = total;
  }
  // pass 3: probability- and scale-weighted values
  fvec acc[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = fvec{};
  for (int64_t p0 = 0, bi = 0; p0 < ctx; p0 += pool.bs, ++bi) {
    const int64_t slot0 = static_cast<int64_t>(table[bi]) * pool.bs;
    const int64_t n = std::min(pool.bs, ctx - p0);
    const T* vr = vh + slot0 * D;
    const float* vs = scaled ? vsh + slot0 : nullptr;
    for (int64_t t = 0; t < n; ++t, vr += D) {
      fvec vf[C];
      for (int c = 0; c < C; ++c) vf[c] = load_kv(vr + c * W);
      for (int j = 0; j < G; ++j) {
        float pw = scores[j * stride + p0 + t];
        if constexpr (scaled) pw *= vs[t];
        const fvec w = splat(pw);
        for (int c = 0; c < C; ++c) acc[j][c] += w * vf[c];
      }
    }
  }
  for (int j = 0; j < G; ++j) {
    const float inv = 1.0f / sum[j];
    for (int c = 0; c < C; ++c) storeu(out + j * D + c * W, acc[j][c] * inv);
  }
}

template <typename T>
using AttendFn = void (*)(const Pool<T>&, int64_t, const int32_t*, int64_t, const float*, float, float*, float*);

template <typename T>
AttendFn<T> pick(int64_t g) {
  switch (g) {
    case 1: return attend_one<T, 1>;
    case 2: return attend_one<T, 2>;
    case 3: return attend_one<T, 3>;
    case 4: return attend_one<T, 4>;
    default: return nullptr;
  }
}

template <typename T>
at::Tensor decode_typed(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_scale,
                        const at::Tensor& v, const std::optional<at::Tensor>& v_scale, const at::Tensor& tables,
                        const at::Tensor& lens, int64_t block_size, double scale) {
  const int64_t b = q.size(0), kv = q.size(1), g = q.size(2);
  AttendFn<T> fn = pick<T>(g);
  TORCH_CHECK(fn != nullptr, "query heads per KV head must be 1..4");
  const at::Tensor qs = q.contiguous();
  const at::Tensor ln = lens.contiguous();
  at::Tensor out = at::empty({b, kv, g, D}, q.options());
  const int64_t width = tables.size(1), slots = k.size(1);
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* lp = ln.data_ptr<int32_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lp[i] > 0 && lp[i] <= width * block_size, "a context length does not fit its block table");
    for (int64_t blk = 0; blk < (lp[i] + block_size - 1) / block_size; ++blk)
      TORCH_CHECK(tb[i * width + blk] >= 0 && (tb[i * width + blk] + 1) * block_size <= slots,
                  "a block id is outside the pool");
    longest = std::max<int64_t>(longest, lp[i]);
  }
  const Pool<T> pool{k.data_ptr<T>(), v.data_ptr<T>(), k_scale ? k_scale->data_ptr<float>() : nullptr,
                     v_scale ? v_scale->data_ptr<float>() : nullptr, slots, block_size};
  // units (sequence, head), longest contexts first
  std::vector<int64_t> order(b);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return lp[x] > lp[y]; });
  const int64_t units = b * kv;
  std::atomic<int64_t> next{0};
  const float* qp = qs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tasks = std::min<int64_t>(units, at::get_num_threads());
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(static_cast<size_t>(g * (longest + W)));
    for (int64_t u = next++; u < units; u = next++) {
      const int64_t i = order[u / kv], h = u % kv;
      const int64_t row = (i * kv + h) * g * D;
      fn(pool, h, tb + i * width, lp[i], qp + row, static_cast<float>(scale), op + row, scratch.data());
    }
  });
  return out;
}

// q [B, kv, g, D] fp32; k, v [kv, slots, D] int8, bfloat16, float16 or float32; k_scale, v_scale [kv, slots] fp32
// for int8 (else None); tables [B, width] int32 (physical blocks); lens [B] int32 (context lengths, each <= width *
// block_size). Returns [B, kv, g, D].
at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_scale,
                  const at::Tensor& v, const std::optional<at::Tensor>& v_scale, const at::Tensor& tables,
                  const at::Tensor& lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(3) == D && q.scalar_type() == at::kFloat, "q must be float32 [B, kv, g, 64]");
  TORCH_CHECK(k.dim() == 3 && k.size(2) == D && k.is_contiguous(), "k must be contiguous [kv, slots, 64]");
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.is_contiguous(), "v must match k");
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k_scale.has_value() == int8 && v_scale.has_value() == int8, "scales come with int8 K/V only");
  if (int8) {
    TORCH_CHECK(k_scale->dim() == 2 && k_scale->size(0) == k.size(0) && k_scale->size(1) == k.size(1) &&
                k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous(),
                "k_scale must be float32 [kv, slots]");
    TORCH_CHECK(v_scale->sizes() == k_scale->sizes() && v_scale->scalar_type() == at::kFloat &&
                v_scale->is_contiguous(), "v_scale must match k_scale");
  }
  TORCH_CHECK(q.size(1) == k.size(0), "q and k disagree on KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.scalar_type() == at::kInt &&
              tables.is_contiguous(), "tables must be contiguous int32 [B, width]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == q.size(0) && lens.scalar_type() == at::kInt,
              "lens must be int32 [B]");
  switch (k.scalar_type()) {
    case at::kChar: return decode_typed<int8_t>(q, k, k_scale, v, v_scale, tables, lens, block_size, scale);
    case at::kFloat: return decode_typed<float>(q, k, k_scale, v, v_scale, tables, lens, block_size, scale);
    case at::kHalf: return decode_typed<c10::Half>(q, k, k_scale, v, v_scale, tables, lens, block_size, scale);
    case at::kBFloat16:
      return decode_typed<c10::BFloat16>(q, k, k_scale, v, v_scale, tables, lens, block_size, scale);
    default: TORCH_CHECK(false, "K/V must be int8, float32, float16 or bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(chatmesh_local, m) {
  m.def("decode(Tensor q, Tensor k, Tensor? k_scale, Tensor v, Tensor? v_scale, Tensor tables, Tensor lens, "
        "int block_size, float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
}
