// Small helpers both kernels share: sixteen floats as one value (GCC vector extension: one AVX-512 register, two
// AVX2 ones), loads and stores that never assume alignment, and a pairwise horizontal sum. With the vectors per
// head (NV = d / 16) known at compile time, a loop over a head's channels keeps its operands in registers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvzip_vec {

typedef float vf __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename scalar_t>
inline vf load_as_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return load(p);
  } else {
    float tmp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
    return load(tmp);
  }
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(vf v) {  // pairwise, in four shuffles and adds
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// the dot product of two rows of nv vectors
inline float dot_rows(const float* a, const float* b, int64_t nv) {
  vf acc = load(a) * load(b);
  for (int64_t v = 1; v < nv; ++v) acc += load(a + v * kLanes) * load(b + v * kLanes);
  return hsum(acc);
}

}  // namespace kvzip_vec
