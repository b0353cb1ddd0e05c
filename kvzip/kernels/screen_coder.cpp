// FAD-KV's screening coder, the pursuit part, fused: one pass per vector over its candidate pool.
//
// kvzip.sparse.screen codes a vector x with s atoms in one or two shots. Each shot screens a candidate pool out of
// the correlations of the current residual with every atom (the only O(N d) work: given to `screen_pursue` as one
// batched matrix product made in PyTorch; computed by `screen_two_shots` itself, a block of vectors at a time), then
// runs orthogonal matching pursuit on the pool only. The PyTorch reference runs
// the pursuit in the correlation domain over a batch of vectors, a few dozen tensor ops per step; here each vector
// runs it alone with an explicit residual: a step picks the pool atom most correlated with the residual, adds it to
// the Cholesky factor of the chosen atoms' Gram matrix, solves the least squares for all chosen atoms and forms the
// new residual, O(P d + k d + k^2) per step for a pool of P.
//
// `screen_pursue(x, corr, shared, extra, offsets, per, chosen, pool, steps, top) -> (idx, coef, residual)`:
//   x (M, d) fp32 vectors, group-major: vector v is coded with group v / per's atoms, atom a being found by
//   offsets[v / per, a]: an element offset into the shared atoms when >= 0, else row -1 - offset of `extra` (the
//   rows' own atoms; kvzip.sparse.atoms.atom_offsets); corr (M, Ntot) the residual's correlations with every atom
//   (float32, or bfloat16 where the model computes in it: they only screen the pool and rank its first pick); chosen
//   (M, k0) atoms a first shot already picked (k0 may be 0), kept out of the pool; pool: candidates to screen;
//   steps: atoms in the code when done. The pool is `champions` (the largest |corr| of each of `pool` contiguous
//   groups of atoms, compared as screen.champions packs them) unless `top` (the exact `pool` largest). Returns the
//   atom numbers (M, steps) int64, their least-squares coefficients (M, steps) fp32 (0 for an atom linearly
//   dependent on the ones before it) and the residual (M, d).
//
// Registered as torch.ops.kvzip.screen_pursue (and screen_two_shots, below); tests/test_kernels.py holds both to
// kvzip.sparse.screen.screen.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using at::Tensor;

using kvzip_vec::dot_rows;
using kvzip_vec::hsum;
using kvzip_vec::kLanes;
using kvzip_vec::load;
using kvzip_vec::store;
using kvzip_vec::vf;
constexpr int64_t kMaxSparsity = 64;
constexpr int64_t kMaxHead = 256;
constexpr int64_t kBlock = 128;  // at most this many of a group's vectors have their correlations computed together
constexpr float kDependent = 1e-6f;  // as kvzip.sparse.omp: a squared distance to the span below this adds nothing

// |c| as screen.pack_abs orders it: the float's bits with the low `low` bits replaced by the column, so that an
// integer max picks the largest |c| and, on a near-tie, the higher column.
inline int32_t packed(float c, int32_t column, int32_t low) {
  return (std::bit_cast<int32_t>(c) & 0x7FFFFFFF & ~low) | column;
}

inline int32_t low_bits(int64_t columns) {  // (1 << bit_length(columns - 1)) - 1, at least 1
  int32_t n = 0;
  for (int64_t v = columns - 1; v > 0; v >>= 1) ++n;
  return (1 << std::max(n, 1)) - 1;
}

// What every vector's pursuit reads: the vectors (M, d), group-major with `per` of each group, and the atoms.
struct Pursuit {
  int64_t d, ntot, per;
  bool top;
  const float* x;
  const float *shared, *extra;
  const int64_t* offsets;
};

// One shot on one vector: its correlations c (Ntot), the atoms already chosen (k0 of them), the pool to screen, the
// atoms in the code when done, and where the atom numbers, coefficients and residual go.
template <typename corr_t>
struct Shot {
  const corr_t* c;
  const int64_t* chosen;
  int64_t k0, pool, steps;
  int64_t* idx;
  float *coef, *r;
};

// Per-thread room: the pool's atom numbers, their correlations, the pool's atom vectors copied side by side (read at
// every step, so they come from L1 rather than from the dictionary), the chosen atoms' vectors, a sort order.
struct Room {
  std::vector<int64_t> pool;
  std::vector<float> pc, atoms, chosen;
  std::vector<int32_t> order;
  std::vector<char> used;
};

// A correlation's value, and its float bits (a bfloat16 is a float's upper half).
inline float corr_value(float c) { return c; }
inline float corr_value(at::BFloat16 c) { return static_cast<float>(c); }
inline int32_t corr_bits(float c) { return std::bit_cast<int32_t>(c); }
inline int32_t corr_bits(at::BFloat16 c) { return static_cast<int32_t>(c.x) << 16; }

// One vector. NV: vectors of kLanes channels per atom when known at compile time (d = 64: 64 / kLanes), else 0
// (then d / kLanes).
template <int64_t NV, typename corr_t>
void pursue_one(const Pursuit& p, int64_t v, const Shot<corr_t>& shot, Room& room) {
  const int64_t d = p.d, s = shot.steps, nv = NV ? NV : d / kLanes;
  const float* x = p.x + v * d;
  const corr_t* c = shot.c;
  const int64_t* offsets = p.offsets + (v / p.per) * p.ntot;
  auto atom = [&](int64_t a) {
    const int64_t o = offsets[a];
    return o >= 0 ? p.shared + o : p.extra + (-1 - o) * d;
  };
  int64_t* idx = shot.idx;
  float* coef = shot.coef;
  float* r = shot.r;
  int64_t* pool = room.pool.data();

  // the candidate pool, screened from the correlations
  const int64_t n = std::min(shot.pool, p.ntot);
  if (!p.top && p.ntot % n == 0 && p.ntot / n >= 2) {  // screen.champions
    const int32_t low = low_bits(p.ntot);
    const int64_t width = p.ntot / n;
    const int32_t keep = 0x7FFFFFFF & ~low;
    for (int64_t g = 0; g < n; ++g) {
      int32_t best = 0;
      const int32_t first = static_cast<int32_t>(g * width);
#pragma omp simd reduction(max : best)
      for (int32_t a = first; a < first + static_cast<int32_t>(width); ++a) {
        const int32_t q = (corr_bits(c[a]) & keep) | a;
        best = q > best ? q : best;
      }
      pool[g] = best & low;
    }
  } else {  // the exact n largest |c|
    std::iota(room.order.begin(), room.order.begin() + p.ntot, 0);
    std::partial_sort(room.order.begin(), room.order.begin() + n, room.order.begin() + p.ntot,
                      [&](int32_t a, int32_t b) { return std::fabs(corr_value(c[a])) > std::fabs(corr_value(c[b])); });
    for (int64_t i = 0; i < n; ++i) pool[i] = room.order[i];
  }
  // the pool's atoms are scattered rows of the dictionary, mostly not in L1: ask for all of them before the first
  // copy waits on one (measured: the copies were most of a shot's fixed cost)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t e = 0; e < d; e += 16) __builtin_prefetch(atom(pool[i]) + e);
  float* pool_atoms = room.atoms.data();  // (n, d)
  for (int64_t i = 0; i < n; ++i) std::memcpy(pool_atoms + i * d, atom(pool[i]), d * sizeof(float));

  // the chosen atoms' Cholesky factor L (L L^T = their Gram matrix) row by row with its diagonal's reciprocals, b =
  // their dots with x, and y = L^-1 b (a new atom adds one entry to each; the earlier ones stay)
  float L[kMaxSparsity][kMaxSparsity], inv[kMaxSparsity], b[kMaxSparsity], y[kMaxSparsity], a[kMaxSparsity];
  bool live[kMaxSparsity];
  float* chosen = room.chosen.data();  // (s, d) the chosen atoms' vectors
  int64_t k = 0;
  auto add = [&](int64_t number, const float* u) {  // one more atom: its row of L, or dead when it adds nothing
    std::memcpy(chosen + k * d, u, d * sizeof(float));
    u = chosen + k * d;
    float d2 = dot_rows(u, u, nv);
    for (int64_t i = 0; i < k; ++i) {
      float g = live[i] ? dot_rows(chosen + i * d, u, nv) : 0.f;
      for (int64_t j = 0; j < i; ++j) g -= L[i][j] * L[k][j];
      L[k][i] = g * inv[i];
      d2 -= L[k][i] * L[k][i];
    }
    live[k] = d2 > kDependent;
    L[k][k] = live[k] ? std::sqrt(d2) : 1.f;
    inv[k] = live[k] ? 1.f / L[k][k] : 0.f;
    if (!live[k])
      for (int64_t i = 0; i < k; ++i) L[k][i] = 0.f;
    b[k] = live[k] ? dot_rows(u, x, nv) : 0.f;
    float t = b[k];
    for (int64_t j = 0; j < k; ++j) t -= L[k][j] * y[j];
    y[k] = t * inv[k];
    idx[k] = number;
    ++k;
  };
  vf res[NV ? NV : kMaxHead / kLanes];  // the residual, in registers when NV is known
  auto solve = [&]() {  // least squares over the chosen atoms (L^T a = y), then the residual r = x - D a
    for (int64_t i = k - 1; i >= 0; --i) {
      float t = y[i];
      for (int64_t j = i + 1; j < k; ++j) t -= L[j][i] * a[j];
      a[i] = t * inv[i];
    }
    for (int64_t e = 0; e < nv; ++e) res[e] = load(x + e * kLanes);
    for (int64_t i = 0; i < k; ++i)
      if (a[i] != 0.f)
        for (int64_t e = 0; e < nv; ++e) res[e] -= a[i] * load(chosen + i * d + e * kLanes);
  };
  for (int64_t i = 0; i < shot.k0; ++i) add(shot.chosen[i], atom(shot.chosen[i]));

  // the pursuit on the pool: correlations with the residual, the largest (packed as screen's pursuit does) wins
  float* pc = room.pc.data();
  char* used = room.used.data();
  std::fill(used, used + n, 0);
  const int32_t plow = low_bits(n);
  auto correlate = [&]() {  // the pool's correlations with the residual
    for (int64_t i = 0; i < n; ++i) {
      const float* u = pool_atoms + i * d;
      vf acc = load(u) * res[0];
      for (int64_t e = 1; e < nv; ++e) acc += load(u + e * kLanes) * res[e];
      pc[i] = hsum(acc);
    }
  };
  if (std::is_same_v<corr_t, float>) {  // fp32 correlations are exact: the pool's are read from them
    for (int64_t i = 0; i < n; ++i) pc[i] = corr_value(c[pool[i]]);
    if (k == s) solve();
  } else {  // bfloat16 ones only screened the pool: its correlations are computed from the residual in fp32
    solve();
    correlate();
  }
  while (k < s) {
    int32_t best = -1;
    int64_t at = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t q = used[i] ? -1 : packed(pc[i], static_cast<int32_t>(i), plow);
      if (q > best) {
        best = q;
        at = i;
      }
    }
    used[at] = 1;
    add(pool[at], pool_atoms + at * d);
    solve();
    if (k < s) correlate();
  }
  for (int64_t e = 0; e < nv; ++e) store(r + e * kLanes, res[e]);
  for (int64_t i = 0; i < s; ++i) coef[i] = live[i] ? a[i] : 0.f;
}

// What both ops read: vectors, their correlations (none where the op computes them), the atoms and where each group
// finds them.
void check_inputs(const Tensor& x, const Tensor* corr, const Tensor& shared, const Tensor& extra,
                  const Tensor& offsets, int64_t per) {
  TORCH_CHECK(x.device().is_cpu(), "the screening kernels run on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, d) float32");
  const int64_t M = x.size(0), d = x.size(1);
  TORCH_CHECK(d % kLanes == 0 && d <= kMaxHead, "screen kernels: vectors of up to ", kMaxHead, " channels in multiples of ",
              kLanes);
  TORCH_CHECK(offsets.dim() == 2 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "offsets must be (groups, Ntot) int64");
  const int64_t ntot = offsets.size(1);
  if (corr != nullptr) {
    const bool half = corr->scalar_type() == at::kBFloat16;
    TORCH_CHECK(corr->dim() == 2 && corr->size(0) == M && corr->size(1) == ntot &&
                    (half || corr->scalar_type() == at::kFloat) && corr->is_contiguous(),
                "corr must be (M, Ntot) float32 or bfloat16");
  }
  TORCH_CHECK(shared.scalar_type() == at::kFloat && shared.size(-1) == d && shared.stride(-1) == 1,
              "shared atoms must be float32 rows of d");
  TORCH_CHECK(extra.dim() == 2 && extra.size(1) == d && extra.scalar_type() == at::kFloat && extra.is_contiguous(),
              "extra atoms must be (E, d) float32");
  TORCH_CHECK(per >= 1 && M == offsets.size(0) * per, "x holds `per` vectors of each group, group-major");
}

// One pursuit's inputs, as every vector's reads them.
Pursuit pursuit(const Tensor& x, const Tensor& shared, const Tensor& extra, const Tensor& offsets, int64_t per,
                bool top) {
  return {x.size(1), offsets.size(1), per, top, x.data_ptr<float>(), shared.data_ptr<float>(), extra.data_ptr<float>(),
          offsets.data_ptr<int64_t>()};
}

// The codes of M vectors x (M, d): atom numbers and coefficients (M, steps), residuals (M, d), and where each starts.
struct Codes {
  Tensor idx, coef, res;
  int64_t* idx_out;
  float *coef_out, *res_out;
  Codes(const Tensor& x, int64_t steps)
      : idx(at::empty({x.size(0), steps}, x.options().dtype(at::kLong))),
        coef(at::empty({x.size(0), steps}, x.options())),
        res(at::empty_like(x)),
        idx_out(idx.data_ptr<int64_t>()),
        coef_out(coef.data_ptr<float>()),
        res_out(res.data_ptr<float>()) {}
};

std::tuple<Tensor, Tensor, Tensor> screen_pursue(const Tensor& x, const Tensor& corr, const Tensor& shared,
                                                 const Tensor& extra, const Tensor& offsets, int64_t per,
                                                 const Tensor& chosen, int64_t pool, int64_t steps, bool top) {
  check_inputs(x, &corr, shared, extra, offsets, per);
  const int64_t M = x.size(0), d = x.size(1), ntot = corr.size(1);
  const bool half = corr.scalar_type() == at::kBFloat16;
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == M && chosen.scalar_type() == at::kLong && chosen.is_contiguous(),
              "chosen must be (M, k0) int64");
  const int64_t k0 = chosen.size(1);
  TORCH_CHECK(steps >= 1 && steps <= kMaxSparsity && k0 <= steps && pool >= 1 && k0 + std::min(pool, ntot) >= steps,
              "screen_pursue: 1 <= steps <= ", kMaxSparsity, ", and the pool must hold the steps after the chosen");
  const Pursuit p = pursuit(x, shared, extra, offsets, per, top);
  Codes out(x, steps);
  int64_t* idx_out = out.idx_out;
  float *coef_out = out.coef_out, *res_out = out.res_out;
  const int64_t* chosen_all = chosen.data_ptr<int64_t>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    const int64_t n = std::min(pool, ntot);
    Room room{std::vector<int64_t>(n), std::vector<float>(n), std::vector<float>(n * d), std::vector<float>(steps * d),
              std::vector<int32_t>(ntot), std::vector<char>(n)};
    for (int64_t v = begin; v < end; ++v) {
      const int64_t* chosen = chosen_all + v * k0;
      if (half) {
        Shot<at::BFloat16> shot{corr.data_ptr<at::BFloat16>() + v * ntot, chosen, k0, pool, steps,
                                idx_out + v * steps, coef_out + v * steps, res_out + v * d};
        d == 64 ? pursue_one<64 / kLanes>(p, v, shot, room) : pursue_one<0>(p, v, shot, room);
      } else {
        Shot<float> shot{corr.data_ptr<float>() + v * ntot, chosen, k0, pool, steps, idx_out + v * steps,
                         coef_out + v * steps, res_out + v * d};
        d == 64 ? pursue_one<64 / kLanes>(p, v, shot, room) : pursue_one<0>(p, v, shot, room);
      }
    }
  });
  return {out.idx, out.coef, out.res};
}

// The correlations of vectors v .. v + b - 1 of group g (x rows, consecutive) with every atom the group sees, into c
// (b, Ntot): the shared columns as one product with the group's shared atoms (N, d) (a small matrix product per
// block, so that the block's correlations stay in the thread's cache between here and the pursuit), then a dot
// product for each of the group's own columns (`own`: overlay atoms, or the zero row past N).
void correlate_block(const Pursuit& p, int64_t N, const std::vector<int64_t>& own, int64_t g, int64_t v, int64_t b,
                     float* c) {
  const int64_t d = p.d, ntot = p.ntot;
  const int64_t* off = p.offsets + g * ntot;
  const float* x = p.x + v * d;
  int64_t j0 = 0;  // any shared column: the group's shared atoms start at its offset less j0 rows
  while (j0 < N && off[j0] < 0) ++j0;
  if (j0 < N) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const Tensor xs = at::from_blob(const_cast<float*>(x), {b, d}, f32);
    const Tensor atoms = at::from_blob(const_cast<float*>(p.shared + off[j0] - j0 * d), {N, d}, f32);
    Tensor out = at::from_blob(c, {b, N}, {ntot, 1}, f32);
    at::mm_out(out, xs, atoms.t());
  }
  for (int64_t j : own) {  // every column, when none is shared
    const float* u = p.extra + (-1 - off[j]) * d;
    for (int64_t i = 0; i < b; ++i) c[i * ntot + j] = dot_rows(x + i * d, u, d / kLanes);
  }
}

// `screen_two_shots(x, shared, extra, offsets, grams, gram_at, per, pool, pool2, steps, top)`: both shots of
// screen.screen(shots=2) in one pass per block of vectors, the correlations with every atom included
// (`correlate_block`, in float32). The first shot pursues steps / 2 atoms on a pool of `pool`. The second shot's
// correlations are the residual's, D r = D x - sum_i a_i D d_i: the first's less the first atoms' Gram rows (grams,
// flat; group g's N x N block starts at gram_at[g]) weighted by their coefficients, k0 N multiply-adds instead of a
// product with all N d entries of the dictionary. Only the atoms a group shares have Gram rows: a column whose atom
// is the row's own (an overlay, offsets < 0) is a dot product with the residual, and so is every column when a first
// atom is the row's own. The residual's correlations stay in the thread's room (never written to memory), the first
// atoms are zeroed there (they are orthogonal to the residual), and the second shot pursues on a pool of `pool2`.
std::tuple<Tensor, Tensor, Tensor> screen_two_shots(const Tensor& x, const Tensor& shared, const Tensor& extra,
                                                    const Tensor& offsets, const Tensor& grams, const Tensor& gram_at,
                                                    int64_t per, int64_t pool, int64_t pool2, int64_t steps, bool top) {
  TORCH_CHECK(steps >= 2, "screen_two_shots: two shots need two steps at least");
  TORCH_CHECK(shared.dim() >= 2 && grams.dim() == 1 && grams.scalar_type() == at::kFloat && grams.is_contiguous(),
              "shared atoms must be (N, d) or (L, N, d) and grams flat float32");
  TORCH_CHECK(gram_at.dim() == 1 && gram_at.scalar_type() == at::kLong && gram_at.size(0) == offsets.size(0) &&
                  gram_at.is_contiguous(),
              "gram_at must be (groups,) int64");
  check_inputs(x, nullptr, shared, extra, offsets, per);
  const int64_t M = x.size(0), d = x.size(1), ntot = offsets.size(1), N = shared.size(-2), k = steps / 2;
  TORCH_CHECK(steps <= kMaxSparsity && pool >= 1 && std::min(pool, ntot) >= k && k + std::min(pool2, ntot) >= steps,
              "screen_two_shots: steps <= ", kMaxSparsity, ", and each pool must hold its shot's steps");
  TORCH_CHECK(N <= ntot && grams.numel() >= N * N, "screen_two_shots: grams must hold N x N blocks");
  TORCH_CHECK(shared.dim() == 2 || shared.stride(-2) == d, "shared atoms: rows of d, contiguous within a layer");
  const Pursuit p = pursuit(x, shared, extra, offsets, per, top);
  Codes out(x, steps);
  int64_t* idx_out = out.idx_out;
  float *coef_out = out.coef_out, *res_out = out.res_out;
  const float* G = grams.data_ptr<float>();
  const int64_t* at_g = gram_at.data_ptr<int64_t>();
  at::parallel_for(0, M, kBlock, [&](int64_t begin, int64_t end) {
    const int64_t n = std::max(std::min(pool, ntot), std::min(pool2, ntot));
    Room room{std::vector<int64_t>(n), std::vector<float>(n), std::vector<float>(n * d), std::vector<float>(steps * d),
              std::vector<int32_t>(ntot), std::vector<char>(n)};
    std::vector<int64_t> first(k), own;
    std::vector<float> a(k), r(d), c1(ntot), block(kBlock * ntot);
    int64_t own_group = -1;
    for (int64_t v0 = begin; v0 < end;) {
      const int64_t g = v0 / per, b = std::min({end, (g + 1) * per, v0 + kBlock}) - v0;
      const int64_t* off = p.offsets + g * ntot;
      auto atom = [&](int64_t j) { return off[j] >= 0 ? p.shared + off[j] : p.extra + (-1 - off[j]) * d; };
      if (g != own_group) {  // the group's own columns, found once per group (its vectors are consecutive)
        own.clear();
        for (int64_t j = 0; j < ntot; ++j)
          if (off[j] < 0) own.push_back(j);
        own_group = g;
      }
      correlate_block(p, N, own, g, v0, b, block.data());
      for (int64_t v = v0; v < v0 + b; ++v) {
        const float* c0 = block.data() + (v - v0) * ntot;
        Shot<float> one{c0, nullptr, 0, pool, k, first.data(), a.data(), r.data()};
        d == 64 ? pursue_one<64 / kLanes>(p, v, one, room) : pursue_one<0>(p, v, one, room);
        bool shared_first = true;
        for (int64_t i = 0; i < k; ++i) shared_first &= first[i] < N && off[first[i]] >= 0;
        float* c = c1.data();
        if (shared_first) {
          std::memcpy(c, c0, N * sizeof(float));
          for (int64_t i = 0; i < k; ++i) {
            if (a[i] == 0.f) continue;
            const float* row = G + at_g[g] + first[i] * N;
            const float ai = a[i];
#pragma omp simd
            for (int64_t j = 0; j < N; ++j) c[j] -= ai * row[j];
          }
          for (int64_t j : own) c[j] = dot_rows(r.data(), atom(j), d / kLanes);
        } else {
          for (int64_t j = 0; j < ntot; ++j) c[j] = dot_rows(r.data(), atom(j), d / kLanes);
        }
        for (int64_t i = 0; i < k; ++i) c[first[i]] = 0.f;
        Shot<float> two{c, first.data(), k, pool2, steps, idx_out + v * steps, coef_out + v * steps, res_out + v * d};
        d == 64 ? pursue_one<64 / kLanes>(p, v, two, room) : pursue_one<0>(p, v, two, room);
      }
      v0 += b;
    }
  });
  return {out.idx, out.coef, out.res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvzip, m) {
  m.def("screen_pursue(Tensor x, Tensor corr, Tensor shared, Tensor extra, Tensor offsets, int per, Tensor chosen, "
        "int pool, int steps, bool top) -> (Tensor, Tensor, Tensor)");
  m.impl("screen_pursue", c10::DispatchKey::CPU, TORCH_FN(screen_pursue));
  m.def("screen_two_shots(Tensor x, Tensor shared, Tensor extra, Tensor offsets, Tensor grams, "
        "Tensor gram_at, int per, int pool, int pool2, int steps, bool top) -> (Tensor, Tensor, Tensor)");
  m.impl("screen_two_shots", c10::DispatchKey::CPU, TORCH_FN(screen_two_shots));
}
