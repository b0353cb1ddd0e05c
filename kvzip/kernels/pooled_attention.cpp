// Decode attention over a token pool (zoomr, sumr): one pass per (row, KV head).
//
// A thought cache keeps each layer's dense tokens in one pool shared by the rows of the batch, (H, N, d) keys and
// values, and per row the list of pool slots it holds, (B, W) with -1 where a shorter row has nothing. Rows then cost
// the pool only what they hold, not the batch's widest row. For each (row b, KV head h) this computes the attention of
// the G query rows of the KV head (one new token each) over the row's slots: a slot counts when it is >= 0 and its
// position is at least first[b] (the row's first real position: left padding before it). Scores and weights are fp32
// whatever the pool's dtype, as in torch's SDPA; a row that sees nothing gets a zero output.
//
// Registered as torch.ops.kvzip.pooled_decode_attention; kvzip/kernels/__init__.py builds and loads it, and
// tests/test_kernels.py holds it to the PyTorch reference (the rows gathered into a rectangle, then SDPA).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using at::Tensor;
using kvzip_vec::exp_nonpositive;
using kvzip_vec::kLanes;
using kvzip_vec::load_as_float;
using kvzip_vec::store;
using kvzip_vec::transpose_sum;
using kvzip_vec::vf;
constexpr int64_t kMaxHead = 256;  // head sizes up to this, multiples of kLanes
constexpr int64_t kMaxGroup = 32;  // query heads per KV head

struct Args {
  int64_t B, H, G, d, W, N;
  const float* q;             // (B, H, G, d), scaled
  const void *keys, *values;  // (H, N, d) pools, strides below
  int64_t p_h, p_n;
  const int64_t* slots;      // (B, W), row stride s_b
  const int64_t* positions;  // (B, W), row stride ps_b
  int64_t s_b, ps_b;
  const int64_t* first;      // (B,)
  float* out;                // (B, H, G, d)
};

// The work is split by KV head and by runs of the pool's slots, so that each task streams its part of the pool once,
// front to back, whichever rows its slots belong to (a row's tokens are spread over the pool, a step's new tokens
// side by side). Pass 1 scores every visible slot against its row's queries and keeps each row's maximum per task;
// pass 2 turns scores into weights and adds weighted values into each row's partial sums; the partial sums of a
// head's tasks are then added and divided by the weights' total.
template <typename scalar_t, int64_t NV>
void attend(const Args& a) {
  const int64_t B = a.B, H = a.H, G = a.G, d = a.d, N = a.N, nv = NV ? NV : d / kLanes;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int32_t> owner(N, -1);  // the row that sees each slot, or -1
  for (int64_t b = 0; b < B; ++b)
    for (int64_t w = 0; w < a.W; ++w) {
      const int64_t s = a.slots[b * a.s_b + w];
      if (s < 0) continue;
      TORCH_CHECK(s < N, "a slot (", s, ") lies outside the pool of ", N, " tokens");
      if (a.positions[b * a.ps_b + w] < a.first[b]) continue;
      TORCH_CHECK(owner[s] < 0, "pooled_decode_attention: slot ", s, " is held twice");
      owner[s] = static_cast<int32_t>(b);
    }
  const int64_t threads = at::get_num_threads();
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>((4 * threads + H - 1) / H, (N + 63) / 64));
  const int64_t run_len = (N + runs - 1) / runs, tasks = H * runs;
  std::vector<float> scores(H * G * N);                       // [h][g][slot]
  std::vector<float> top(tasks * B * G, neg_inf);             // [task][row][g]
  std::vector<float> total(tasks * B * G, 0.f);               // [task][row][g]
  std::vector<float> partial(tasks * B * G * d, 0.f);         // [task][row][g][d]
  const scalar_t* keys = static_cast<const scalar_t*>(a.keys);
  const scalar_t* values = static_cast<const scalar_t*>(a.values);

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {  // pass 1: scores and their maxima
    std::vector<vf> dots(G * kLanes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / runs, lo = task % runs * run_len, hi = std::min(N, lo + run_len);
      float* row_top = top.data() + task * B * G;
      for (int64_t s0 = lo; s0 < hi; s0 += kLanes) {  // kLanes slots at a time: their sums across lanes at once
        const int64_t m = std::min<int64_t>(kLanes, hi - s0);
        bool any = false;
        for (int64_t i = 0; i < kLanes; ++i) {
          const int32_t b = i < m ? owner[s0 + i] : -1;
          if (b < 0) {
            for (int64_t g = 0; g < G; ++g) dots[g * kLanes + i] = vf{};
            continue;
          }
          any = true;
          vf k[NV ? NV : kMaxHead / kLanes];
          for (int64_t v = 0; v < nv; ++v) k[v] = load_as_float(keys + h * a.p_h + (s0 + i) * a.p_n + v * kLanes);
          const float* q = a.q + (b * H + h) * G * d;
          for (int64_t g = 0; g < G; ++g) {
            vf dot = kvzip_vec::load(q + g * d) * k[0];
            for (int64_t v = 1; v < nv; ++v) dot += kvzip_vec::load(q + g * d + v * kLanes) * k[v];
            dots[g * kLanes + i] = dot;
          }
        }
        if (!any) continue;
        for (int64_t g = 0; g < G; ++g) {
          float sums[kLanes];
          store(sums, transpose_sum(dots.data() + g * kLanes));
          float* sc = scores.data() + (h * G + g) * N + s0;
          for (int64_t i = 0; i < m; ++i) {
            const int32_t b = owner[s0 + i];
            if (b < 0) continue;
            sc[i] = sums[i];
            float& t = row_top[b * G + g];
            t = sums[i] > t ? sums[i] : t;
          }
        }
      }
    }
  });

  std::vector<float> row_max(H * B * G, neg_inf);  // [h][row][g] over the head's runs
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t i = 0; i < B * G; ++i) {
      float& t = row_max[task / runs * B * G + i];
      t = std::max(t, top[task * B * G + i]);
    }

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {  // pass 2: weights and weighted values
    std::vector<float> mx(kLanes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / runs, lo = task % runs * run_len, hi = std::min(N, lo + run_len);
      float* sums = total.data() + task * B * G;
      float* acc = partial.data() + task * B * G * d;
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + (h * G + g) * N;
        const float* gmax = row_max.data() + h * B * G + g;
        for (int64_t s = lo; s < hi; ++s) {
          const int32_t b = owner[s];
          sc[s] = b < 0 ? 0.f : exp_nonpositive(sc[s] - gmax[b * G]);
        }
      }
      for (int64_t s = lo; s < hi; ++s) {
        const int32_t b = owner[s];
        if (b < 0) continue;
        vf x[NV ? NV : kMaxHead / kLanes];
        for (int64_t v = 0; v < nv; ++v) x[v] = load_as_float(values + h * a.p_h + s * a.p_n + v * kLanes);
        for (int64_t g = 0; g < G; ++g) {
          const float wt = scores[(h * G + g) * N + s];
          sums[b * G + g] += wt;
          float* o = acc + (b * G + g) * d;
          for (int64_t v = 0; v < nv; ++v) store(o + v * kLanes, kvzip_vec::load(o + v * kLanes) + wt * x[v]);
        }
      }
    }
  });

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {  // the runs of each head added, then divided
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t g = 0; g < G; ++g) {
        float weight = 0.f;
        vf o[NV ? NV : kMaxHead / kLanes];
        for (int64_t v = 0; v < nv; ++v) o[v] = vf{};
        for (int64_t r = 0; r < runs; ++r) {
          const int64_t task = h * runs + r;
          weight += total[(task * B + b) * G + g];
          const float* p = partial.data() + ((task * B + b) * G + g) * d;
          for (int64_t v = 0; v < nv; ++v) o[v] += kvzip_vec::load(p + v * kLanes);
        }
        const float inv = weight > 0.f ? 1.f / weight : 0.f;  // a row that sees nothing: zeros
        for (int64_t v = 0; v < nv; ++v) store(a.out + (bh * G + g) * d + v * kLanes, o[v] * inv);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_size(const Args& a) {
  if (a.d == 64) return attend<scalar_t, 64 / kLanes>(a);
  if (a.d == 128) return attend<scalar_t, 128 / kLanes>(a);
  return attend<scalar_t, 0>(a);
}

Tensor pooled_decode_attention(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& slots,
                               const Tensor& positions, const Tensor& first) {
  TORCH_CHECK(q.device().is_cpu(), "pooled_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be (B, H, G, d) float32");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), d = q.size(3);
  TORCH_CHECK(d <= kMaxHead && d % kLanes == 0 && G <= kMaxGroup, "pooled_decode_attention: head sizes up to ",
              kMaxHead, " in multiples of ", kLanes, ", up to ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == H && keys.size(2) == d && keys.sizes() == values.sizes() &&
                  keys.strides() == values.strides() && keys.stride(2) == 1 &&
                  keys.scalar_type() == values.scalar_type(),
              "keys and values must be (H, N, d) pools of one dtype and layout, channels contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == B && slots.stride(1) == 1,
              "slots must be (B, W) int64, slots contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == slots.sizes() && positions.stride(1) == 1,
              "positions must be (B, W) int64 like slots");
  TORCH_CHECK(first.scalar_type() == at::kLong && first.is_contiguous() && first.numel() == B,
              "first must be (B,) int64");
  const int64_t W = slots.size(1);  // each slot is checked against the pool's size as its owner is recorded
  Tensor out = at::empty({B, H, G, d}, q.options());
  Args a{B, H, G, d, W, keys.size(1), q.data_ptr<float>(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
         keys.stride(1),
         slots.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), slots.stride(0), positions.stride(0),
         first.data_ptr<int64_t>(), out.data_ptr<float>()};
  switch (keys.scalar_type()) {
    case at::kFloat: dispatch_size<float>(a); break;
    case at::kBFloat16: dispatch_size<at::BFloat16>(a); break;
    case at::kHalf: dispatch_size<at::Half>(a); break;
    default: TORCH_CHECK(false, "pooled_decode_attention: the pool must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvzip, m) {
  m.def("pooled_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor positions, Tensor first) "
        "-> Tensor");
  m.impl("pooled_decode_attention", c10::DispatchKey::CPU, TORCH_FN(pooled_decode_attention));
}
