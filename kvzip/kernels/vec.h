// Small helpers the kernels share: a CPU register's worth of floats as one value (GCC vector extension: sixteen on
// AVX-512, eight elsewhere), loads and stores that never assume alignment, and pairwise horizontal sums. With the
// vectors per head (NV = d / kLanes) known at compile time, a loop over a head's channels keeps its operands in
// registers. The width follows the machine the kernels are built for (-march=native): a sixteen-float vector on an
// AVX2-only CPU is two registers that GCC moves through the stack in halves (stores then wider loads that the CPU
// cannot forward), which made the coded-attention kernel 2.5x slower than the PyTorch path there (docs/decisions.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvzip_vec {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename scalar_t>
inline vf load_as_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return load(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // a bf16 is a float's top half: widen and shift
    typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));
    typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));
    vh h;
    std::memcpy(&h, p, sizeof(h));
    const vu bits = __builtin_convertvector(h, vu) << 16;
    vf v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {  // by the CPU's own conversion, a register at a time
    vf v;
#if defined(__AVX512F__)
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&v, &x, sizeof(v));
#else
    for (int64_t i = 0; i < kLanes; i += 8) {
      const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      std::memcpy(reinterpret_cast<float*>(&v) + i, &x, sizeof(x));
    }
#endif
    return v;
#endif
  } else {
    float tmp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
    return load(tmp);
  }
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(vf v) {  // pairwise, halving the vector until four lanes are left
  typedef float v4 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  typedef float v8 __attribute__((vector_size(32)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf a = v;
#endif
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// kLanes horizontal sums at once: lane i of the result is the sum of x[i]'s lanes. Each level adds the two halves of
// pairs of vectors' partial sums (sixteen lanes: 15 adds and 30 shuffles where sixteen `hsum`s take 64 of each).
inline vf transpose_sum(const vf* x) {
#if defined(__AVX512F__)
  vf s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: x[2i]'s eight partial sums, 8-15: x[2i + 1]'s
    s1[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1],
                                    0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(x[2 * i], x[2 * i + 1],
                                    8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // four partial sums each of x[4i .. 4i + 3]
    s2[i] = __builtin_shufflevector(s1[2 * i], s1[2 * i + 1],
                                    0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(s1[2 * i], s1[2 * i + 1],
                                    4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // two each of x[8i .. 8i + 7]
    s3[i] = __builtin_shufflevector(s2[2 * i], s2[2 * i + 1],
                                    0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(s2[2 * i], s2[2 * i + 1],
                                    2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(s3[0], s3[1],
                                    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(s3[0], s3[1],
                                    1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf s1[4], s2[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: x[2i]'s four partial sums, 4-7: x[2i + 1]'s
    s1[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // two partial sums each of x[4i .. 4i + 3]
    s2[i] = __builtin_shufflevector(s1[2 * i], s1[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(s1[2 * i], s1[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(s2[0], s2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(s2[0], s2[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// the dot product of two rows of nv vectors
inline float dot_rows(const float* a, const float* b, int64_t nv) {
  vf acc = load(a) * load(b);
  for (int64_t v = 1; v < nv; ++v) acc += load(a + v * kLanes) * load(b + v * kLanes);
  return hsum(acc);
}

// e^r on |r| <= ln2 / 2 by its degree-7 Taylor polynomial, for a float or a vector of them
template <typename T>
inline T exp_series(T r) {
  T p = T{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

// exp(x) for x <= 0 (scores minus their maximum), -inf and anything below -87 giving 0: 2^n times a degree-7
// polynomial on |r| <= ln2 / 2 (relative error ~2e-7), branch-free; not std::exp, whose vector form in glibc needs
// -ffast-math, which would drop -inf from the scores.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  const float p = exp_series(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.f ? 0.f : p * scale;
}

// The same on kLanes values at once (rounding to an integer by adding and taking away 1.5 * 2^23).
inline vf exp_nonpositive(vf x) {
  typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
  const vf lowest = vf{} - 87.f, magic = vf{} + 12582912.f;
  x = x < lowest ? lowest : x;
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  const vf p = exp_series(r);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= lowest ? vf{} : p * scale;
}

}  // namespace kvzip_vec
