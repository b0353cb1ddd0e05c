// Decode attention on dictionary-coded keys and values (fadkv, lexico), fused: one pass per (row, KV head).
//
// A coded token t of one KV head is s atom numbers idx[t, j] and s coefficients c[t, j] (int8 with one fp16 scale
// per vector, or fp16): k_t = sum_j c[t, j] D[idx[t, j]]. For each (row b, KV head h) this computes the attention
// of its G query rows (the query heads of the KV head, one new token) over the coded tokens and the dense tier
// (sinks and the recent buffer) without ever writing a (B, H, T, d) tensor:
// - pre-RoPE keys (`rope_cs` given): each coded key is rebuilt in registers from its s atoms, the key mean added, and
//   turned by RoPE at its position (atoms, mean and query in the model's channel order, so a turn is two vector
//   halves times cos and sin), then dotted with the G queries: T (s d + 2 d + G d) multiply-adds;
// - post-RoPE keys: q.D is computed once per query row over the row's atoms, then gathered by code: G N d + T G s;
// - values stay in atom space: each coded token's weight times its coefficients is added to the weight its atoms
//   received, and one product with the value atoms closes it: T G s + G N d.
// Each (row, KV head) is one task of at::parallel_for. Atom a of row b is found by offsets[b, a]: an element offset
// into the shared dictionary when >= 0, else row -1 - offsets[b, a] of `extra` (the row's own replaced atoms, fixed-size
// adaptation), as kvzip.sparse.atoms.atom_offsets lays them out.
//
// Registered as torch.ops.kvzip.coded_decode_attention; kvzip/kernels/__init__.py builds and loads it, and
// tests/test_kernels.py holds it to the PyTorch reference path of kvzip/methods/fadkv.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using at::Tensor;

struct Args {
  int64_t B, H, G, d, T, S, s_k, s_v, k_ntot, v_ntot, rope_dim;
  const float* q;                              // (B, H, G, d) scaled, model channel order
  const void *k_idx, *k_coef, *v_idx, *v_coef;  // (B, H, T, s), a token's s entries contiguous
  const at::Half *k_scale, *v_scale;           // (B, H, T) or null
  int64_t kc_b, kc_h, ks_b, ks_h, vc_b, vc_h, vs_b, vs_h, cp_b;  // row and head strides: codes, scales, coded_pos
  const float *k_shared, *v_shared;            // the shared atoms, rows of d found by offset
  const float *k_extra, *v_extra;              // (E, d) the zero row and every row's own atoms
  const int64_t *k_offsets, *v_offsets;        // (B, Ntot) where each atom number is (atom_offsets)
  const float* key_mean;                       // (H, d) or null
  const float* rope_cs;                        // (P, 2, rope_dim / 2) scaled cos, then sin, by position, or null
  const int64_t* coded_pos;                    // (B, T), row stride cp_b
  const void *dense_k, *dense_v;               // (B, H, S, d), channels contiguous, strides below
  int64_t ds_b, ds_h, ds_s;                    // the dense tier's strides (a view of spare room, not compact)
  const bool* allowed;                         // (B, T + S), or null: then each row's tokens at positions >= first
  const int64_t* first;                        // (B,) each row's first real position (left padding before it)
  const int64_t* dense_pos;                    // (B, S) the dense tier's positions, row stride dp_b
  int64_t dp_b;
  float* out;                                  // (B, H, G, d)
};

using kvzip_vec::exp_nonpositive;
using kvzip_vec::hsum;
using kvzip_vec::kLanes;
using kvzip_vec::load;
using kvzip_vec::load_as_float;
using kvzip_vec::store;
using kvzip_vec::vf;
constexpr int64_t kMaxHead = 256;  // head sizes up to this, multiples of kLanes
constexpr int64_t kMaxGroup = 32;  // query heads per KV head

inline const float* atom_at(const float* shared, const float* extra, int64_t offset, int64_t d) {
  return offset >= 0 ? shared + offset : extra + (-1 - offset) * d;
}

// One (row, KV head). NV: vectors per head (d / kLanes) when known at compile time, else 0 (then a.d / kLanes).
template <typename idx_t, typename coef_t, typename dense_t, int64_t NV>
void attend_one(const Args& a, int64_t bh, std::vector<float>& scores, std::vector<float>& acc,
                std::vector<float>& qd, std::vector<char>& seen) {
  const int64_t nv = NV ? NV : a.d / kLanes, d = nv * kLanes, W = a.T + a.S, G = a.G;
  const int64_t b = bh / a.H, h = bh % a.H;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vf q[kMaxGroup][NV ? NV : kMaxHead / kLanes];  // the G query rows, in the model's channel order like every key
  for (int64_t g = 0; g < G; ++g)
    for (int64_t v = 0; v < nv; ++v) q[g][v] = load(a.q + (bh * G + g) * d + v * kLanes);
  const char* ok;  // which of the row's T + S tokens the query sees
  if (a.allowed) {
    ok = reinterpret_cast<const char*>(a.allowed + b * W);
  } else {  // every real token of the row: positions from its first real one on (holes are -1)
    const int64_t lo = a.first[b];
    for (int64_t t = 0; t < a.T; ++t) seen[t] = a.coded_pos[b * a.cp_b + t] >= lo;
    for (int64_t t = 0; t < a.S; ++t) seen[a.T + t] = a.dense_pos[b * a.dp_b + t] >= lo;
    ok = seen.data();
  }
  const idx_t* k_idx = static_cast<const idx_t*>(a.k_idx) + b * a.kc_b + h * a.kc_h;
  const coef_t* k_coef = static_cast<const coef_t*>(a.k_coef) + b * a.kc_b + h * a.kc_h;
  const at::Half* k_scale = a.k_scale ? a.k_scale + b * a.ks_b + h * a.ks_h : nullptr;
  const int64_t* k_offsets = a.k_offsets + b * a.k_ntot;
  const float* mean = a.key_mean ? a.key_mean + h * d : nullptr;

  // 1. Scores over the coded keys.
  if (a.rope_cs) {
    const int64_t half = a.rope_dim / 2;
    const bool whole = half % kLanes == 0;  // the turned halves are whole vectors (else turned channel by channel)
    for (int64_t t = 0; t < a.T; ++t) {
      if (!ok[t]) {
        for (int64_t g = 0; g < G; ++g) scores[g * W + t] = neg_inf;
        continue;
      }
      vf k[NV ? NV : kMaxHead / kLanes];
      for (int64_t v = 0; v < nv; ++v) k[v] = mean ? load(mean + v * kLanes) : vf{};
      const float unit = k_scale ? static_cast<float>(k_scale[t]) : 1.f;
      for (int64_t j = 0; j < a.s_k; ++j) {
        const float c = static_cast<float>(k_coef[t * a.s_k + j]) * unit;
        const float* atom = atom_at(a.k_shared, a.k_extra, k_offsets[k_idx[t * a.s_k + j]], d);
        for (int64_t v = 0; v < nv; ++v) k[v] += c * load(atom + v * kLanes);
      }
      const float* cos = a.rope_cs + a.coded_pos[b * a.cp_b + t] * 2 * half;  // RoPE at the token's position:
      const float* sin = cos + half;                                          // channel i turns with i + half
      if (whole) {
        for (int64_t v = 0; v < half / kLanes; ++v) {
          const vf x1 = k[v], x2 = k[v + half / kLanes], c = load(cos + v * kLanes), sn = load(sin + v * kLanes);
          k[v] = x1 * c - x2 * sn;
          k[v + half / kLanes] = x2 * c + x1 * sn;
        }
      } else {
        float flat[kMaxHead];
        for (int64_t v = 0; v < nv; ++v) store(flat + v * kLanes, k[v]);
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = flat[i], x2 = flat[i + half];
          flat[i] = x1 * cos[i] - x2 * sin[i];
          flat[i + half] = x2 * cos[i] + x1 * sin[i];
        }
        for (int64_t v = 0; v < nv; ++v) k[v] = load(flat + v * kLanes);
      }
      for (int64_t g = 0; g < G; ++g) {
        vf dot = q[g][0] * k[0];
        for (int64_t v = 1; v < nv; ++v) dot += q[g][v] * k[v];
        scores[g * W + t] = hsum(dot);
      }
    }
  } else {
    for (int64_t n = 0; n < a.k_ntot; ++n) {  // q.D once per query row, gathered by code below
      const float* atom = atom_at(a.k_shared, a.k_extra, k_offsets[n], d);
      for (int64_t g = 0; g < G; ++g) {
        vf dot = q[g][0] * load(atom);
        for (int64_t v = 1; v < nv; ++v) dot += q[g][v] * load(atom + v * kLanes);
        qd[g * a.k_ntot + n] = hsum(dot);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float base = 0.f;  // q.mean: the same for every token
      if (mean) {
        vf dot = q[g][0] * load(mean);
        for (int64_t v = 1; v < nv; ++v) dot += q[g][v] * load(mean + v * kLanes);
        base = hsum(dot);
      }
      const float* table = qd.data() + g * a.k_ntot;
      for (int64_t t = 0; t < a.T; ++t) {
        float sc = 0.f;
        for (int64_t j = 0; j < a.s_k; ++j)
          sc += static_cast<float>(k_coef[t * a.s_k + j]) * table[k_idx[t * a.s_k + j]];
        scores[g * W + t] = ok[t] ? base + sc * (k_scale ? static_cast<float>(k_scale[t]) : 1.f) : neg_inf;
      }
    }
  }

  // 2. Scores over the dense tier.
  const int64_t dense_at = b * a.ds_b + h * a.ds_h;
  const dense_t* dense_k = static_cast<const dense_t*>(a.dense_k) + dense_at;
  for (int64_t t = 0; t < a.S; ++t) {
    if (!ok[a.T + t]) {
      for (int64_t g = 0; g < G; ++g) scores[g * W + a.T + t] = neg_inf;
      continue;
    }
    vf k[NV ? NV : kMaxHead / kLanes];
    for (int64_t v = 0; v < nv; ++v) k[v] = load_as_float(dense_k + t * a.ds_s + v * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      vf dot = q[g][0] * k[0];
      for (int64_t v = 1; v < nv; ++v) dot += q[g][v] * k[v];
      scores[g * W + a.T + t] = hsum(dot);
    }
  }

  // 3. Softmax per query row; a row that sees nothing (left padding) gets zero weights and a zero output.
  for (int64_t g = 0; g < G; ++g) {
    float* w = scores.data() + g * W;
    float top = neg_inf;
    for (int64_t t = 0; t < W; ++t) top = w[t] > top ? w[t] : top;
    if (top == neg_inf) {
      std::fill(w, w + W, 0.f);
      continue;
    }
    vf sums = vf{};
    int64_t t = 0;
    for (; t + kLanes <= W; t += kLanes) {
      const vf e = exp_nonpositive(load(w + t) - top);
      store(w + t, e);
      sums += e;
    }
    float total = hsum(sums);
    for (; t < W; ++t) {
      w[t] = exp_nonpositive(w[t] - top);
      total += w[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < W; ++t) w[t] *= inv;
  }

  // 4. Values: the dense tier directly, the coded tokens through the weight each atom received.
  vf out[kMaxGroup][NV ? NV : kMaxHead / kLanes];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t v = 0; v < nv; ++v) out[g][v] = vf{};
  const dense_t* dense_v = static_cast<const dense_t*>(a.dense_v) + dense_at;
  for (int64_t t = 0; t < a.S; ++t) {
    if (!ok[a.T + t]) continue;
    vf x[NV ? NV : kMaxHead / kLanes];
    for (int64_t v = 0; v < nv; ++v) x[v] = load_as_float(dense_v + t * a.ds_s + v * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      const float wt = scores[g * W + a.T + t];
      for (int64_t v = 0; v < nv; ++v) out[g][v] += wt * x[v];
    }
  }
  const idx_t* v_idx = static_cast<const idx_t*>(a.v_idx) + b * a.vc_b + h * a.vc_h;
  const coef_t* v_coef = static_cast<const coef_t*>(a.v_coef) + b * a.vc_b + h * a.vc_h;
  const at::Half* v_scale = a.v_scale ? a.v_scale + b * a.vs_b + h * a.vs_h : nullptr;
  const int64_t* v_offsets = a.v_offsets + b * a.v_ntot;
  std::fill(acc.begin(), acc.begin() + G * a.v_ntot, 0.f);
  for (int64_t t = 0; t < a.T; ++t) {
    if (!ok[t]) continue;
    const float unit = v_scale ? static_cast<float>(v_scale[t]) : 1.f;
    for (int64_t j = 0; j < a.s_v; ++j) {
      const float c = static_cast<float>(v_coef[t * a.s_v + j]) * unit;
      const int64_t n = v_idx[t * a.s_v + j];
      for (int64_t g = 0; g < G; ++g) acc[g * a.v_ntot + n] += scores[g * W + t] * c;
    }
  }
  for (int64_t n = 0; n < a.v_ntot; ++n) {
    const float* atom = atom_at(a.v_shared, a.v_extra, v_offsets[n], d);
    vf x[NV ? NV : kMaxHead / kLanes];
    for (int64_t v = 0; v < nv; ++v) x[v] = load(atom + v * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      const float wn = acc[g * a.v_ntot + n];
      for (int64_t v = 0; v < nv; ++v) out[g][v] += wn * x[v];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t v = 0; v < nv; ++v) store(a.out + (bh * G + g) * d + v * kLanes, out[g][v]);
}

template <typename idx_t, typename coef_t, typename dense_t, int64_t NV>
void attend(const Args& a) {
  at::parallel_for(0, a.B * a.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(a.G * (a.T + a.S)), acc(a.G * a.v_ntot), qd(a.rope_cs ? 0 : a.G * a.k_ntot);
    std::vector<char> seen(a.allowed ? 0 : a.T + a.S);
    for (int64_t bh = begin; bh < end; ++bh) attend_one<idx_t, coef_t, dense_t, NV>(a, bh, scores, acc, qd, seen);
  });
}

template <typename idx_t, typename coef_t, typename dense_t>
void dispatch_size(const Args& a) {
  if (a.d == 64) return attend<idx_t, coef_t, dense_t, 64 / kLanes>(a);
  if (a.d == 128) return attend<idx_t, coef_t, dense_t, 128 / kLanes>(a);
  return attend<idx_t, coef_t, dense_t, 0>(a);
}

template <typename idx_t, typename coef_t>
void dispatch_dense(const Args& a, at::ScalarType dense) {
  switch (dense) {
    case at::kFloat: return dispatch_size<idx_t, coef_t, float>(a);
    case at::kBFloat16: return dispatch_size<idx_t, coef_t, at::BFloat16>(a);
    case at::kHalf: return dispatch_size<idx_t, coef_t, at::Half>(a);
    default: TORCH_CHECK(false, "coded_decode_attention: the dense tier must be float32, bfloat16 or float16");
  }
}

template <typename idx_t>
void dispatch_coef(const Args& a, at::ScalarType coef, at::ScalarType dense) {
  if (coef == at::kChar) return dispatch_dense<idx_t, int8_t>(a, dense);
  TORCH_CHECK(coef == at::kHalf, "coded_decode_attention: coefficients must be int8 (with scales) or float16");
  return dispatch_dense<idx_t, at::Half>(a, dense);
}

void check_codes(const Tensor& idx, const Tensor& coef, const std::optional<Tensor>& scale, const Tensor& shared,
                 const Tensor& extra, const Tensor& offsets, int64_t B, int64_t H, int64_t T, int64_t d,
                 const char* kind) {
  TORCH_CHECK(idx.dim() == 4 && idx.size(0) == B && idx.size(1) == H && idx.size(2) == T, kind,
              " codes must be (B, H, T, s)");
  TORCH_CHECK(coef.sizes() == idx.sizes() && coef.strides() == idx.strides() && idx.stride(3) == 1 &&
                  idx.stride(2) == idx.size(3),
              kind, " coefficients must match the codes in shape and strides, each token's entries contiguous");
  TORCH_CHECK(idx.scalar_type() == at::kShort || idx.scalar_type() == at::kInt, kind, " codes must be int16 or int32");
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->dim() == 4 && scale->size(0) == B &&
                    scale->size(1) == H && scale->size(2) == T && scale->size(3) == 1 && scale->stride(2) == 1,
                kind, " scales must be float16 (B, H, T, 1), tokens contiguous");
  } else {
    TORCH_CHECK(coef.scalar_type() == at::kHalf, kind, " int8 coefficients need their scales");
  }
  TORCH_CHECK(shared.scalar_type() == at::kFloat && shared.size(-1) == d && shared.stride(-1) == 1, kind,
              " shared atoms must be float32 rows of d");
  TORCH_CHECK(extra.dim() == 2 && extra.size(1) == d && extra.scalar_type() == at::kFloat && extra.is_contiguous(),
              kind, " extra atoms must be (E, d) float32, contiguous");
  TORCH_CHECK(offsets.dim() == 2 && offsets.size(0) == B && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(),
              kind, " offsets must be (B, Ntot) int64, contiguous");
}

Tensor coded_decode_attention(const Tensor& q, const Tensor& k_idx, const Tensor& k_coef,
                              const std::optional<Tensor>& k_scale, const Tensor& k_shared, const Tensor& k_extra,
                              const Tensor& k_offsets, const Tensor& v_idx, const Tensor& v_coef,
                              const std::optional<Tensor>& v_scale, const Tensor& v_shared, const Tensor& v_extra,
                              const Tensor& v_offsets, const std::optional<Tensor>& key_mean,
                              const std::optional<Tensor>& rope_cs, const Tensor& coded_pos, const Tensor& dense_k,
                              const Tensor& dense_v, const std::optional<Tensor>& allowed,
                              const std::optional<Tensor>& first, const std::optional<Tensor>& dense_pos) {
  TORCH_CHECK(q.device().is_cpu(), "coded_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be (B, H, G, d) float32");
  TORCH_CHECK(q.size(3) <= kMaxHead && q.size(3) % kLanes == 0 && q.size(2) <= kMaxGroup,
              "coded_decode_attention: head sizes up to ", kMaxHead, " in multiples of ", kLanes, ", up to ",
              kMaxGroup, " query heads per KV head");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), d = q.size(3), T = k_idx.size(2);
  check_codes(k_idx, k_coef, k_scale, k_shared, k_extra, k_offsets, B, H, T, d, "key");
  check_codes(v_idx, v_coef, v_scale, v_shared, v_extra, v_offsets, B, H, T, d, "value");
  TORCH_CHECK(k_idx.scalar_type() == v_idx.scalar_type() && k_coef.scalar_type() == v_coef.scalar_type(),
              "keys and values must be coded alike");
  TORCH_CHECK(dense_k.dim() == 4 && dense_k.size(0) == B && dense_k.size(1) == H && dense_k.size(3) == d &&
                  dense_k.sizes() == dense_v.sizes() && dense_k.strides() == dense_v.strides() &&
                  dense_k.stride(3) == 1 && dense_k.scalar_type() == dense_v.scalar_type(),
              "dense keys and values must be (B, H, S, d) of one dtype and layout, channels contiguous");
  const int64_t S = dense_k.size(2);
  TORCH_CHECK(coded_pos.scalar_type() == at::kLong && coded_pos.dim() == 2 && coded_pos.size(0) == B &&
                  coded_pos.size(1) == T && coded_pos.stride(1) == 1,
              "coded_pos must be (B, T) int64, tokens contiguous");
  if (allowed.has_value()) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool && allowed->is_contiguous() && allowed->numel() == B * (T + S),
                "allowed must be (B, T + S) bool");
  } else {
    TORCH_CHECK(first.has_value() && first->scalar_type() == at::kLong && first->is_contiguous() &&
                    first->numel() == B,
                "without `allowed`, first must be (B,) int64");
    TORCH_CHECK(dense_pos.has_value() && dense_pos->scalar_type() == at::kLong && dense_pos->dim() == 2 &&
                    dense_pos->size(0) == B && dense_pos->size(1) == S && dense_pos->stride(1) == 1,
                "without `allowed`, dense_pos must be (B, S) int64, tokens contiguous");
  }
  int64_t rope_dim = 0;
  if (rope_cs.has_value()) {
    TORCH_CHECK(rope_cs->dim() == 3 && rope_cs->size(1) == 2 && rope_cs->scalar_type() == at::kFloat &&
                    rope_cs->is_contiguous() && 2 * rope_cs->size(2) <= d,
                "rope_cs must be (P, 2, dim / 2) float32");
    rope_dim = 2 * rope_cs->size(2);
    if (T) {
      const int64_t top = coded_pos.max().item<int64_t>();
      TORCH_CHECK(top < rope_cs->size(0), "rope_cs holds ", rope_cs->size(0), " positions; a coded token sits at ", top);
    }
  }
  if (key_mean.has_value())
    TORCH_CHECK(key_mean->scalar_type() == at::kFloat && key_mean->is_contiguous() && key_mean->numel() == H * d,
                "key_mean must be (H, d) float32");
  Tensor out = at::empty({B, H, G, d}, q.options());
  Args a{B, H, G, d, T, S, k_idx.size(3), v_idx.size(3), k_offsets.size(1), v_offsets.size(1), rope_dim,
         q.data_ptr<float>(), k_idx.data_ptr(), k_coef.data_ptr(), v_idx.data_ptr(), v_coef.data_ptr(),
         k_scale ? k_scale->data_ptr<at::Half>() : nullptr, v_scale ? v_scale->data_ptr<at::Half>() : nullptr,
         k_idx.stride(0), k_idx.stride(1), k_scale ? k_scale->stride(0) : 0, k_scale ? k_scale->stride(1) : 0,
         v_idx.stride(0), v_idx.stride(1), v_scale ? v_scale->stride(0) : 0, v_scale ? v_scale->stride(1) : 0,
         coded_pos.stride(0),
         k_shared.data_ptr<float>(), v_shared.data_ptr<float>(), k_extra.data_ptr<float>(), v_extra.data_ptr<float>(),
         k_offsets.data_ptr<int64_t>(), v_offsets.data_ptr<int64_t>(),
         key_mean ? key_mean->data_ptr<float>() : nullptr, rope_cs ? rope_cs->data_ptr<float>() : nullptr,
         coded_pos.data_ptr<int64_t>(), dense_k.data_ptr(), dense_v.data_ptr(), dense_k.stride(0), dense_k.stride(1),
         dense_k.stride(2), allowed ? allowed->data_ptr<bool>() : nullptr, first ? first->data_ptr<int64_t>() : nullptr,
         dense_pos ? dense_pos->data_ptr<int64_t>() : nullptr, dense_pos ? dense_pos->stride(0) : 0,
         out.data_ptr<float>()};
  if (k_idx.scalar_type() == at::kShort)
    dispatch_coef<int16_t>(a, k_coef.scalar_type(), dense_k.scalar_type());
  else
    dispatch_coef<int32_t>(a, k_coef.scalar_type(), dense_k.scalar_type());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvzip, m) {
  m.def("coded_decode_attention(Tensor q, Tensor k_idx, Tensor k_coef, Tensor? k_scale, Tensor k_shared, "
        "Tensor k_extra, Tensor k_offsets, Tensor v_idx, Tensor v_coef, Tensor? v_scale, Tensor v_shared, "
        "Tensor v_extra, Tensor v_offsets, "
        "Tensor? key_mean, Tensor? rope_cs, Tensor coded_pos, Tensor dense_k, Tensor dense_v, Tensor? allowed, "
        "Tensor? first, Tensor? dense_pos) "
        "-> Tensor");
  m.impl("coded_decode_attention", c10::DispatchKey::CPU, TORCH_FN(coded_decode_attention));
}
