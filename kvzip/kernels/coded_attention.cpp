// Decode attention on dictionary-coded keys and values (fadkv, lexico), fused: no (B, H, T, d) tensor is written.
//
// A coded token t of one KV head is s atom numbers idx[t, j] (int16, int32, or packed in ten bits) and s
// coefficients c[t, j] (int8 or int4 with one fp16 scale per vector, or fp16): k_t = sum_j c[t, j] D[idx[t, j]].
// Atoms are read in fp16 (dictionaries are fp16 files, so exactly) and widened in registers.
// For each row b this computes the attention of the G query rows of each KV head (one new token) over the coded
// tokens and the dense tier (sinks and the recent buffer):
// - pre-RoPE keys (`rope_cs` given): kLanes coded keys at a time are rebuilt from their s atoms into a tile in L1, the
//   key mean added, turned by RoPE at their positions (atoms, mean and query in the model's channel order, so a turn
//   is two vector halves times cos and sin), and scored against each query row at once: T (s d + 2 d + G d)
//   multiply-adds;
// - post-RoPE keys: q.D is computed once per query row over the row's atoms, then gathered by code: G N d + T G s;
// - values stay in atom space: each coded token's weight times its coefficients is added to the weight its atoms
//   received, and one product with the value atoms closes it: T G s + G N d.
// Work is split as flash-decoding splits it: a task is one row's chunk of coded tokens for all KV heads (a row is
// one chunk unless there are fewer rows than twice the threads), leaving per query row its largest score, its sum of
// weights, its weighted dense values and its atom weights; a second pass per (row, KV head) brings the chunks to
// one largest score, multiplies the atom weights out and divides by the total. Atom a of row b is found by
// offsets[b, a]: an element offset into the shared dictionary when >= 0, else row -1 - offsets[b, a] of `extra` (the
// row's own replaced atoms, fixed-size adaptation), as kvzip.sparse.atoms.atom_offsets lays them out.
//
// Registered as torch.ops.kvzip.coded_decode_attention; kvzip/kernels/__init__.py builds and loads it, and
// tests/test_kernels.py holds it to the PyTorch reference path of kvzip/methods/fadkv.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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
  const void *k_idx, *k_coef, *v_idx, *v_coef;  // (B, H, T, width), a token's entries contiguous (token_width)
  const at::Half *k_scale, *v_scale;           // (B, H, T) or null
  int64_t ki_b, ki_h, kc_b, kc_h, ks_b, ks_h;  // row and head strides: key numbers, coefficients, scales
  int64_t vi_b, vi_h, vc_b, vc_h, vs_b, vs_h, cp_b;  // the same for values; coded_pos
  const at::Half *k_shared, *v_shared;         // the shared atoms in fp16, rows of d found by offset
  const at::Half *k_extra, *v_extra;           // (E, d) the zero row and every row's own atoms, fp16
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

using kvzip_vec::dot_rows;
using kvzip_vec::exp_nonpositive;
using kvzip_vec::hsum;
using kvzip_vec::kLanes;
using kvzip_vec::load;
using kvzip_vec::load_as_float;
using kvzip_vec::store;
using kvzip_vec::transpose_sum;
using kvzip_vec::vf;
constexpr int64_t kMaxHead = 256;  // head sizes up to this, multiples of kLanes
constexpr int64_t kMaxGroup = 32;  // query heads per KV head
constexpr int64_t kMaxSparsity = 64;  // atoms per coded vector
constexpr int64_t kMaxChunks = 8;     // chunks a row's coded tokens are split into
constexpr int64_t kMinChunk = 256;    // coded tokens per chunk, at least

// One task's scratch, reused over the tasks of a thread.
struct Work {
  std::vector<float> scores;        // (H, G, L + S): a chunk's scores, then its weights
  std::vector<float> qd;            // (G, k_ntot) q.D per atom (post-RoPE keys)
  std::vector<float> tile;          // (kLanes, d) rebuilt keys (pre-RoPE keys)
  std::vector<const at::Half*> atoms;  // (k_ntot) where each key atom's row is (pre-RoPE keys)
  std::vector<char> seen;           // (L + S) which tokens the query sees
};

// What a chunk of a row's tokens leaves for the merge (flash-decoding): per KV head and query row the largest score
// and the sum of its weights, the dense tier's weighted values, and the weight each value atom received, all
// relative to that chunk's own largest score.
struct Partials {
  int64_t C, Gp;  // chunks per row; query rows rounded up to four (the atom weights' inner size)
  float *top, *total, *out, *acc;  // (B, C, H, G), (B, C, H, G), (B, C, H, G, d), (B, C, H, v_ntot, Gp)
};

template <typename T>
inline const T* typed(const void* base, int64_t offset) { return static_cast<const T*>(base) + offset; }

// Atom numbers packed in ten bits (kvzip.sparse.coded_attention.pack_indices): a token's s low bytes, then the two
// high bits of numbers 4i..4i+3 in byte i of a ceil(s / 4)-byte tail, number 4i in its lowest bits.
struct Packed10 {
  uint8_t byte;
};
// Coefficients in four bits, two a byte, the low nibble first, stored with 8 added (coded_attention.quantize).
struct Nibbles {
  uint8_t byte;
};

// Entries a token's s numbers or coefficients take.
template <typename T> inline int64_t token_width(int64_t s) { return s; }
template <> inline int64_t token_width<Packed10>(int64_t s) { return s + (s + 3) / 4; }
template <> inline int64_t token_width<Nibbles>(int64_t s) { return s / 2; }

// Number j of a token's s atom numbers, `tok` its codes.
template <typename idx_t>
inline int32_t number_at(const idx_t* tok, int64_t s, int64_t j) { return static_cast<int32_t>(tok[j]); }
template <>
inline int32_t number_at<Packed10>(const Packed10* tok, int64_t s, int64_t j) {
  const uint8_t* bytes = &tok->byte;
  return bytes[j] | (((bytes[s + j / 4] >> (2 * (j % 4))) & 3) << 8);
}

// Token t's s atom numbers, from the codes of one row and KV head.
template <typename idx_t>
inline void read_numbers(const idx_t* codes, int64_t t, int64_t s, int32_t* out) {
  const idx_t* tok = codes + t * token_width<idx_t>(s);
  for (int64_t j = 0; j < s; ++j) out[j] = number_at(tok, s, j);
}

// Token t's s atoms' rows, looked up as each number is read: a vector gather of the rows from numbers just stored
// to the stack stalled on the stores (perf: the gather's next instruction held 7% of the kernel's time).
template <typename idx_t>
inline void read_atoms(const idx_t* codes, int64_t t, int64_t s, const at::Half* const* rows, const at::Half** out) {
  const idx_t* tok = codes + t * token_width<idx_t>(s);
  for (int64_t j = 0; j < s; ++j) out[j] = rows[number_at(tok, s, j)];
}

// Token t's s coefficients times `unit` (its scale, or 1), from the coefficients of one row and KV head.
template <typename coef_t>
inline void read_coefs(const coef_t* coefs, int64_t t, int64_t s, float unit, float* out) {
  const coef_t* tok = coefs + t * s;
  for (int64_t j = 0; j < s; ++j) out[j] = static_cast<float>(tok[j]) * unit;
}
template <>
inline void read_coefs<Nibbles>(const Nibbles* coefs, int64_t t, int64_t s, float unit, float* out) {
  const uint8_t* tok = &coefs[t * (s / 2)].byte;
  for (int64_t i = 0; i < s / 2; ++i) {
    out[2 * i] = static_cast<float>((tok[i] & 15) - 8) * unit;
    out[2 * i + 1] = static_cast<float>((tok[i] >> 4) - 8) * unit;
  }
}

inline const at::Half* atom_at(const at::Half* shared, const at::Half* extra, int64_t offset, int64_t d) {
  return offset >= 0 ? shared + offset : extra + (-1 - offset) * d;
}

// out[g][v] += sum over r < rows of w[r * wr + g * wg] * row(r)[v], for the GB query rows from g0 and the VB vectors
// from v0: the GB x VB sums stay in registers over all rows (GB * VB <= 12 of AVX2's sixteen), each row's vectors
// are read once per block. With the G x nv sums in one loop they spilled to the stack, a load and a store per
// multiply-add. A row given as null is skipped.
template <int64_t GB, int64_t VB, typename RowFn>
inline void accumulate_block(float* out, int64_t d, int64_t g0, int64_t v0, int64_t rows, const float* w,
                             int64_t wr, int64_t wg, RowFn row) {
  vf acc[GB][VB];
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t v = 0; v < VB; ++v) acc[g][v] = load(out + (g0 + g) * d + (v0 + v) * kLanes);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* x = row(r);
    if (!x) continue;
    float wt[GB];
    for (int64_t g = 0; g < GB; ++g) wt[g] = w[r * wr + (g0 + g) * wg];
    for (int64_t v = 0; v < VB; ++v) {
      const vf xv = load_as_float(x + (v0 + v) * kLanes);
      for (int64_t g = 0; g < GB; ++g) acc[g][v] += wt[g] * xv;
    }
  }
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t v = 0; v < VB; ++v) store(out + (g0 + g) * d + (v0 + v) * kLanes, acc[g][v]);
}

// accumulate_block over all G query rows of out (G, d) and its nv vectors, in blocks of up to three query rows and
// four vectors
template <typename RowFn>
inline void accumulate(float* out, int64_t G, int64_t nv, int64_t rows, const float* w, int64_t wr, int64_t wg,
                       RowFn row) {
  const int64_t d = nv * kLanes;
  for (int64_t v0 = 0; v0 < nv; v0 += 4) {
    if (nv - v0 < 4) {  // the last vectors of a head that is not a multiple of four: one at a time
      for (int64_t v = v0; v < nv; ++v)
        for (int64_t g = 0; g < G; ++g) accumulate_block<1, 1>(out, d, g, v, rows, w, wr, wg, row);
      break;
    }
    int64_t g0 = 0;
    for (; g0 + 3 <= G; g0 += 3) accumulate_block<3, 4>(out, d, g0, v0, rows, w, wr, wg, row);
    if (G - g0 == 2) accumulate_block<2, 4>(out, d, g0, v0, rows, w, wr, wg, row);
    if (G - g0 == 1) accumulate_block<1, 4>(out, d, g0, v0, rows, w, wr, wg, row);
  }
}

inline float dot_vf(const float* q, const vf* k, int64_t nv) {
  vf acc = load(q) * k[0];
  for (int64_t v = 1; v < nv; ++v) acc += load(q + v * kLanes) * k[v];
  return hsum(acc);
}

// Chunk c of row b: the coded tokens [lo, hi) (and the dense tier when `dense`) of every KV head, scored, turned into
// weights relative to the chunk's largest score, and summed into its partials. All heads in one task: a pre-RoPE
// token's cos and sin rows are read from memory once for all of them.
template <typename idx_t, typename coef_t, typename dense_t, int64_t NV>
void attend_chunk(const Args& a, const Partials& p, int64_t b, int64_t c, int64_t lo, int64_t hi, bool dense,
                  Work& work) {
  const int64_t nv = NV ? NV : a.d / kLanes, d = nv * kLanes, G = a.G, H = a.H;
  const int64_t L = hi - lo, S = dense ? a.S : 0, WL = L + S;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* scores = work.scores.data();
  char* ok = work.seen.data();  // which of the chunk's L + S tokens the query sees
  if (a.allowed) {
    const bool* row = a.allowed + b * (a.T + a.S);
    for (int64_t t = 0; t < L; ++t) ok[t] = row[lo + t];
    for (int64_t t = 0; t < S; ++t) ok[L + t] = row[a.T + t];
  } else {  // every real token of the row: positions from its first real one on (holes are -1)
    const int64_t first = a.first[b];
    for (int64_t t = 0; t < L; ++t) ok[t] = a.coded_pos[b * a.cp_b + lo + t] >= first;
    for (int64_t t = 0; t < S; ++t) ok[L + t] = a.dense_pos[b * a.dp_b + t] >= first;
  }
  const int64_t* k_offsets = a.k_offsets + b * a.k_ntot;
  auto key_scale = [&](int64_t h) { return a.k_scale ? a.k_scale + b * a.ks_b + h * a.ks_h : nullptr; };

  // 1. Scores over the coded keys.
  if (a.rope_cs) {  // kLanes keys at a time rebuilt into a tile in L1, then scored against each query row at once
    const int64_t half = a.rope_dim / 2;
    const bool whole = half % kLanes == 0;  // the turned halves are whole vectors (else turned channel by channel)
    float* tile = work.tile.data();
    const at::Half** k_atoms = work.atoms.data();  // atom number -> its row, for this row of the batch
    for (int64_t n = 0; n < a.k_ntot; ++n) k_atoms[n] = atom_at(a.k_shared, a.k_extra, k_offsets[n], d);
    for (int64_t t0 = lo; t0 < hi; t0 += kLanes) {
      const int64_t n = std::min(kLanes, hi - t0);
      for (int64_t h = 0; h < H; ++h) {
        const idx_t* k_idx = typed<idx_t>(a.k_idx, b * a.ki_b + h * a.ki_h);
        const coef_t* k_coef = typed<coef_t>(a.k_coef, b * a.kc_b + h * a.kc_h);
        const at::Half* k_scale = key_scale(h);
        const float* mean = a.key_mean ? a.key_mean + h * d : nullptr;
        for (int64_t i = 0; i < kLanes; ++i) {
          const int64_t t = t0 + i;
          if (i >= n || !ok[t - lo]) {  // past the end, a hole or a masked column: a zero key, its score set below
            for (int64_t v = 0; v < nv; ++v) store(tile + i * d + v * kLanes, vf{});
            continue;
          }
          const float unit = k_scale ? static_cast<float>(k_scale[t]) : 1.f;
          float cf[kMaxSparsity];  // the token's coefficients and atoms first, so the sums below wait on loads alone
          const at::Half* atoms[kMaxSparsity];
          read_coefs(k_coef, t, a.s_k, unit, cf);
          read_atoms(k_idx, t, a.s_k, k_atoms, atoms);
          vf k[NV ? NV : kMaxHead / kLanes];
          for (int64_t v = 0; v < nv; ++v) k[v] = mean ? load(mean + v * kLanes) : vf{};
          for (int64_t j = 0; j < a.s_k; ++j)
            for (int64_t v = 0; v < nv; ++v) k[v] += cf[j] * load_as_float(atoms[j] + v * kLanes);
          const float* cos = a.rope_cs + a.coded_pos[b * a.cp_b + t] * 2 * half;  // RoPE at the token's position:
          const float* sin = cos + half;                                          // channel i turns with i + half
          if (whole) {
            for (int64_t v = 0; v < half / kLanes; ++v) {
              const vf x1 = k[v], x2 = k[v + half / kLanes], cs = load(cos + v * kLanes), sn = load(sin + v * kLanes);
              k[v] = x1 * cs - x2 * sn;
              k[v + half / kLanes] = x2 * cs + x1 * sn;
            }
          } else {
            float flat[kMaxHead];
            for (int64_t v = 0; v < nv; ++v) store(flat + v * kLanes, k[v]);
            for (int64_t ch = 0; ch < half; ++ch) {
              const float x1 = flat[ch], x2 = flat[ch + half];
              flat[ch] = x1 * cos[ch] - x2 * sin[ch];
              flat[ch + half] = x2 * cos[ch] + x1 * sin[ch];
            }
            for (int64_t v = 0; v < nv; ++v) k[v] = load(flat + v * kLanes);
          }
          for (int64_t v = 0; v < nv; ++v) store(tile + i * d + v * kLanes, k[v]);
        }
        for (int64_t g = 0; g < G; ++g) {  // kLanes dot products side by side, summed across by one transpose
          const float* q = a.q + ((b * H + h) * G + g) * d;
          vf dots[kLanes];
          const vf q0 = load(q);
          for (int64_t i = 0; i < kLanes; ++i) dots[i] = q0 * load(tile + i * d);
          for (int64_t v = 1; v < nv; ++v) {
            const vf qv = load(q + v * kLanes);
            for (int64_t i = 0; i < kLanes; ++i) dots[i] += qv * load(tile + i * d + v * kLanes);
          }
          float sums[kLanes];
          store(sums, transpose_sum(dots));
          float* row = scores + (h * G + g) * WL + (t0 - lo);
          for (int64_t i = 0; i < n; ++i) row[i] = ok[t0 - lo + i] ? sums[i] : neg_inf;
        }
      }
    }
  } else {
    std::vector<float>& qd = work.qd;
    for (int64_t h = 0; h < H; ++h) {
      const idx_t* k_idx = typed<idx_t>(a.k_idx, b * a.ki_b + h * a.ki_h);
      const coef_t* k_coef = typed<coef_t>(a.k_coef, b * a.kc_b + h * a.kc_h);
      const at::Half* k_scale = key_scale(h);
      for (int64_t n = 0; n < a.k_ntot; ++n) {  // q.D once per query row, gathered by code below
        const at::Half* atom = atom_at(a.k_shared, a.k_extra, k_offsets[n], d);
        vf k[NV ? NV : kMaxHead / kLanes];
        for (int64_t v = 0; v < nv; ++v) k[v] = load_as_float(atom + v * kLanes);
        for (int64_t g = 0; g < G; ++g) qd[g * a.k_ntot + n] = dot_vf(a.q + ((b * H + h) * G + g) * d, k, nv);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* q = a.q + ((b * H + h) * G + g) * d;
        const float base = a.key_mean ? dot_rows(q, a.key_mean + h * d, nv) : 0.f;  // q.mean: the same for every token
        const float* table = qd.data() + g * a.k_ntot;
        float* row = scores + (h * G + g) * WL;
        for (int64_t t = lo; t < hi; ++t) {
          float cf[kMaxSparsity], sc = 0.f;
          int32_t num[kMaxSparsity];
          read_coefs(k_coef, t, a.s_k, 1.f, cf);
          read_numbers(k_idx, t, a.s_k, num);
          for (int64_t j = 0; j < a.s_k; ++j) sc += cf[j] * table[num[j]];
          row[t - lo] = ok[t - lo] ? base + sc * (k_scale ? static_cast<float>(k_scale[t]) : 1.f) : neg_inf;
        }
      }
    }
  }

  // 2. Scores over the dense tier (the last chunk's).
  const dense_t* dense_k = static_cast<const dense_t*>(a.dense_k) + b * a.ds_b;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < S; ++t) {
      vf k[NV ? NV : kMaxHead / kLanes];
      if (ok[L + t])
        for (int64_t v = 0; v < nv; ++v) k[v] = load_as_float(dense_k + h * a.ds_h + t * a.ds_s + v * kLanes);
      for (int64_t g = 0; g < G; ++g)
        scores[(h * G + g) * WL + L + t] = ok[L + t] ? dot_vf(a.q + ((b * H + h) * G + g) * d, k, nv) : neg_inf;
    }

  // 3. Weights relative to the chunk's largest score per query row; a row that sees nothing keeps zero weights.
  const int64_t part = (b * p.C + c) * H;  // this chunk's first (KV head) entry in the partials
  for (int64_t hg = 0; hg < H * G; ++hg) {
    float* w = scores + hg * WL;
    vf tops = vf{} + neg_inf;  // the largest score, kLanes running maxima at a time (a scalar one waits on each)
    int64_t t0 = 0;
    for (; t0 + kLanes <= WL; t0 += kLanes) {
      const vf x = load(w + t0);
      tops = x > tops ? x : tops;
    }
    float top = neg_inf;
    for (int64_t i = 0; i < kLanes; ++i) top = tops[i] > top ? tops[i] : top;
    for (; t0 < WL; ++t0) top = w[t0] > top ? w[t0] : top;
    float total = 0.f;
    if (top == neg_inf) {
      std::fill(w, w + WL, 0.f);
    } else {
      vf sums = vf{};
      int64_t t = 0;
      for (; t + kLanes <= WL; t += kLanes) {
        const vf e = exp_nonpositive(load(w + t) - top);
        store(w + t, e);
        sums += e;
      }
      total = hsum(sums);
      for (; t < WL; ++t) {
        w[t] = exp_nonpositive(w[t] - top);
        total += w[t];
      }
    }
    p.top[part * G + hg] = top;
    p.total[part * G + hg] = total;
  }

  // 4. Values: the dense tier directly; the coded tokens' weights times their coefficients onto their atoms.
  typedef float v4 __attribute__((vector_size(16)));
  const int64_t quads = p.Gp / 4;
  for (int64_t h = 0; h < H; ++h) {
    float* out = p.out + (part + h) * G * d;
    std::fill(out, out + G * d, 0.f);
    const dense_t* dense_v = static_cast<const dense_t*>(a.dense_v) + b * a.ds_b + h * a.ds_h;
    accumulate(out, G, nv, S, scores + h * G * WL + L, 1, WL,
               [&](int64_t t) { return ok[L + t] ? dense_v + t * a.ds_s : nullptr; });
    const idx_t* v_idx = typed<idx_t>(a.v_idx, b * a.vi_b + h * a.vi_h);
    const coef_t* v_coef = typed<coef_t>(a.v_coef, b * a.vc_b + h * a.vc_h);
    const at::Half* v_scale = a.v_scale ? a.v_scale + b * a.vs_b + h * a.vs_h : nullptr;
    float* acc = p.acc + (part + h) * a.v_ntot * p.Gp;  // (v_ntot, Gp): an atom's weights for all query rows together
    std::fill(acc, acc + a.v_ntot * p.Gp, 0.f);
    for (int64_t t = lo; t < hi; ++t) {
      if (!ok[t - lo]) continue;
      v4 wt[kMaxGroup / 4];
      for (int64_t u = 0; u < quads; ++u) {
        float w[4];
        for (int64_t i = 0; i < 4; ++i) w[i] = u * 4 + i < G ? scores[(h * G + u * 4 + i) * WL + t - lo] : 0.f;
        wt[u] = v4{w[0], w[1], w[2], w[3]};
      }
      float cf[kMaxSparsity];
      int32_t num[kMaxSparsity];
      read_coefs(v_coef, t, a.s_v, v_scale ? static_cast<float>(v_scale[t]) : 1.f, cf);
      read_numbers(v_idx, t, a.s_v, num);
      for (int64_t j = 0; j < a.s_v; ++j) {
        const float cv = cf[j];
        float* into = acc + num[j] * p.Gp;
        for (int64_t u = 0; u < quads; ++u) {
          v4 x;
          std::memcpy(&x, into + u * 4, sizeof(x));
          x += wt[u] * cv;
          std::memcpy(into + u * 4, &x, sizeof(x));
        }
      }
    }
  }
}

// (row b, KV head h): its chunks' partials brought to one largest score, summed, the atom weights multiplied out
// against the value atoms, and divided by the weights' total.
void merge_head(const Args& a, const Partials& p, int64_t b, int64_t h, std::vector<float>& merged) {
  const int64_t G = a.G, d = a.d, nv = d / kLanes, C = p.C;
  float* out = a.out + (b * a.H + h) * G * d;
  float scale[kMaxChunks][kMaxGroup], total[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < C; ++c) top = std::max(top, p.top[((b * C + c) * a.H + h) * G + g]);
    total[g] = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t at = ((b * C + c) * a.H + h) * G + g;
      scale[c][g] = p.top[at] == top ? 1.f : exp_nonpositive(p.top[at] - top);  // -inf against -inf: a zero chunk
      total[g] += scale[c][g] * p.total[at];
    }
  }
  const float* acc = p.acc + (b * C * a.H + h) * a.v_ntot * p.Gp;
  std::copy(p.out + (b * C * a.H + h) * G * d, p.out + (b * C * a.H + h + 1) * G * d, out);
  if (C > 1) {
    std::fill(merged.begin(), merged.begin() + a.v_ntot * p.Gp, 0.f);
    std::fill(out, out + G * d, 0.f);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t at = (b * C + c) * a.H + h;
      float sc[kMaxGroup + 4] = {};
      for (int64_t g = 0; g < G; ++g) sc[g] = scale[c][g];
      const float* from = p.acc + at * a.v_ntot * p.Gp;
      for (int64_t n = 0; n < a.v_ntot; ++n)
        for (int64_t g = 0; g < p.Gp; ++g) merged[n * p.Gp + g] += sc[g] * from[n * p.Gp + g];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < d; ++i) out[g * d + i] += sc[g] * p.out[(at * G + g) * d + i];
    }
    acc = merged.data();
  }
  const int64_t* v_offsets = a.v_offsets + b * a.v_ntot;
  accumulate(out, G, nv, a.v_ntot, acc, p.Gp, 1,
             [&](int64_t n) { return atom_at(a.v_shared, a.v_extra, v_offsets[n], d); });
  for (int64_t g = 0; g < G; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;  // a query row that sees nothing: zeros
    for (int64_t i = 0; i < d; ++i) out[g * d + i] *= inv;
  }
}

template <typename idx_t, typename coef_t, typename dense_t, int64_t NV>
void attend(const Args& a) {
  // Rows split into chunks of their coded tokens when there are fewer rows than twice the threads (one stream of 8k
  // tokens: four chunks on two threads rather than three heads), at least kMinChunk tokens each.
  const int64_t threads = at::get_num_threads();
  const int64_t C = std::max<int64_t>(1, std::min({(2 * threads + a.B - 1) / a.B, a.T / kMinChunk, kMaxChunks}));
  const int64_t Gp = (a.G + 3) / 4 * 4, H = a.H, G = a.G;
  Tensor buf = at::empty({a.B * C * H * (2 * G + G * a.d + a.v_ntot * Gp)}, at::kFloat);
  float* base = buf.data_ptr<float>();
  const int64_t n = a.B * C * H;
  Partials p{C, Gp, base, base + n * G, base + 2 * n * G, base + n * (2 * G + G * a.d)};
  const int64_t longest = (a.T + C - 1) / C + a.S;
  at::parallel_for(0, a.B * C, 1, [&](int64_t begin, int64_t end) {
    Work work{std::vector<float>(H * G * longest), std::vector<float>(a.rope_cs ? 0 : G * a.k_ntot),
              std::vector<float>(a.rope_cs ? kLanes * a.d : 0),
              std::vector<const at::Half*>(a.rope_cs ? a.k_ntot : 0),
              std::vector<char>(longest)};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / C, c = task % C;
      attend_chunk<idx_t, coef_t, dense_t, NV>(a, p, b, c, a.T * c / C, a.T * (c + 1) / C, c == C - 1, work);
    }
  });
  at::parallel_for(0, a.B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(C > 1 ? a.v_ntot * Gp : 0);
    for (int64_t bh = begin; bh < end; ++bh) merge_head(a, p, bh / H, bh % H, merged);
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
  if (coef == at::kByte) return dispatch_dense<idx_t, Nibbles>(a, dense);
  TORCH_CHECK(coef == at::kHalf, "coded_decode_attention: coefficients must be int8 or int4 (with scales) or float16");
  return dispatch_dense<idx_t, at::Half>(a, dense);
}

// Atoms a token's codes hold: their width, or the width packed ten-bit numbers of s atoms take (s + ceil(s / 4)).
int64_t sparsity_of(const Tensor& idx) {
  const int64_t n = idx.size(3);
  return idx.scalar_type() == at::kByte ? n - (n + 4) / 5 : n;
}

void check_codes(const Tensor& idx, const Tensor& coef, const std::optional<Tensor>& scale, const Tensor& shared,
                 const Tensor& extra, const Tensor& offsets, int64_t B, int64_t H, int64_t T, int64_t d,
                 const char* kind) {
  TORCH_CHECK(idx.dim() == 4 && idx.size(0) == B && idx.size(1) == H && idx.size(2) == T, kind,
              " codes must be (B, H, T, width)");
  TORCH_CHECK(idx.scalar_type() == at::kShort || idx.scalar_type() == at::kInt || idx.scalar_type() == at::kByte,
              kind, " codes must be int16, int32 or ten-bit numbers packed in uint8");
  const int64_t s = sparsity_of(idx);
  const int64_t width = coef.scalar_type() == at::kByte ? token_width<Nibbles>(s) : s;
  TORCH_CHECK(coef.dim() == 4 && coef.size(0) == B && coef.size(1) == H && coef.size(2) == T &&
                  coef.size(3) == width && (coef.scalar_type() != at::kByte || s % 2 == 0),
              kind, " coefficients must be (B, H, T, s), or (B, H, T, s / 2) for int4 (s even)");
  TORCH_CHECK(idx.stride(3) == 1 && idx.stride(2) == idx.size(3) && coef.stride(3) == 1 && coef.stride(2) == width,
              kind, " codes and coefficients must keep each token's entries contiguous");
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->dim() == 4 && scale->size(0) == B &&
                    scale->size(1) == H && scale->size(2) == T && scale->size(3) == 1 && scale->stride(2) == 1,
                kind, " scales must be float16 (B, H, T, 1), tokens contiguous");
  } else {
    TORCH_CHECK(coef.scalar_type() == at::kHalf, kind, " int8 coefficients need their scales");
  }
  TORCH_CHECK(shared.scalar_type() == at::kHalf && shared.size(-1) == d && shared.stride(-1) == 1, kind,
              " shared atoms must be float16 rows of d");
  TORCH_CHECK(extra.dim() == 2 && extra.size(1) == d && extra.scalar_type() == at::kHalf && extra.is_contiguous(),
              kind, " extra atoms must be (E, d) float16, contiguous");
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
  const int64_t s_k = sparsity_of(k_idx), s_v = sparsity_of(v_idx);
  TORCH_CHECK(std::max(s_k, s_v) <= kMaxSparsity, "coded_decode_attention: up to ", kMaxSparsity, " atoms a vector");
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
  Args a{B, H, G, d, T, S, s_k, s_v, k_offsets.size(1), v_offsets.size(1), rope_dim,
         q.data_ptr<float>(), k_idx.data_ptr(), k_coef.data_ptr(), v_idx.data_ptr(), v_coef.data_ptr(),
         k_scale ? k_scale->data_ptr<at::Half>() : nullptr, v_scale ? v_scale->data_ptr<at::Half>() : nullptr,
         k_idx.stride(0), k_idx.stride(1), k_coef.stride(0), k_coef.stride(1),
         k_scale ? k_scale->stride(0) : 0, k_scale ? k_scale->stride(1) : 0,
         v_idx.stride(0), v_idx.stride(1), v_coef.stride(0), v_coef.stride(1),
         v_scale ? v_scale->stride(0) : 0, v_scale ? v_scale->stride(1) : 0, coded_pos.stride(0),
         k_shared.data_ptr<at::Half>(), v_shared.data_ptr<at::Half>(), k_extra.data_ptr<at::Half>(),
         v_extra.data_ptr<at::Half>(),
         k_offsets.data_ptr<int64_t>(), v_offsets.data_ptr<int64_t>(),
         key_mean ? key_mean->data_ptr<float>() : nullptr, rope_cs ? rope_cs->data_ptr<float>() : nullptr,
         coded_pos.data_ptr<int64_t>(), dense_k.data_ptr(), dense_v.data_ptr(), dense_k.stride(0), dense_k.stride(1),
         dense_k.stride(2), allowed ? allowed->data_ptr<bool>() : nullptr, first ? first->data_ptr<int64_t>() : nullptr,
         dense_pos ? dense_pos->data_ptr<int64_t>() : nullptr, dense_pos ? dense_pos->stride(0) : 0,
         out.data_ptr<float>()};
  if (k_idx.scalar_type() == at::kShort)
    dispatch_coef<int16_t>(a, k_coef.scalar_type(), dense_k.scalar_type());
  else if (k_idx.scalar_type() == at::kByte)
    dispatch_coef<Packed10>(a, k_coef.scalar_type(), dense_k.scalar_type());
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
