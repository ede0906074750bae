// Paged decode attention on CPU: one query token per sequence, K/V read in place from the
// block-paged cache (no gather, no padding). Parallel over (sequence, kv head) with OpenMP;
// each task scores its G = num_heads / kv_heads query heads against every visible key
// (shared K/V reads for the whole GQA group), then a softmax and a weighted sum of V.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <int DC>
void decode_impl(const float* q, const float* kc, const float* vc, const int* bt,
                 const int* lens, const int64_t* rows, float* out, int B, int H, int KVH,
                 int D, int BS, int MAXBLK, float scale) {
  const int G = H / KVH;
  const int d = DC > 0 ? DC : D;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < KVH; ++h) {
      const int L = lens[b];
      float* o = out + (rows[b] * H + (int64_t)h * G) * d;
      std::fill(o, o + (int64_t)G * d, 0.0f);
      if (L <= 0) continue;
      const float* qh = q + (rows[b] * H + (int64_t)h * G) * d;
      std::vector<float> s((size_t)G * L);
      const int* table = bt + (int64_t)b * MAXBLK;
      for (int j = 0; j < L; ++j) {
        const int64_t slot = (int64_t)table[j / BS] * BS + j % BS;
        const float* kj = kc + (slot * KVH + h) * d;
        for (int g = 0; g < G; ++g) {
          const float* qg = qh + (int64_t)g * d;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int x = 0; x < d; ++x) acc += qg[x] * kj[x];
          s[(size_t)g * L + j] = acc * scale;
        }
      }
      std::vector<float> inv(G);
      for (int g = 0; g < G; ++g) {
        float* sg = s.data() + (size_t)g * L;
        float m = sg[0];
        for (int j = 1; j < L; ++j) m = std::max(m, sg[j]);
        float sum = 0.0f;
        for (int j = 0; j < L; ++j) {
          sg[j] = std::exp(sg[j] - m);
          sum += sg[j];
        }
        inv[g] = 1.0f / sum;
      }
      for (int j = 0; j < L; ++j) {
        const int64_t slot = (int64_t)table[j / BS] * BS + j % BS;
        const float* vj = vc + (slot * KVH + h) * d;
        for (int g = 0; g < G; ++g) {
          const float p = s[(size_t)g * L + j];
          float* og = o + (int64_t)g * d;
#pragma omp simd
          for (int x = 0; x < d; ++x) og[x] += p * vj[x];
        }
      }
      for (int g = 0; g < G; ++g) {
        float* og = o + (int64_t)g * d;
        for (int x = 0; x < d; ++x) og[x] *= inv[g];
      }
    }
  }
}

}  // namespace

// q, out: [T, H, D] float32; k_cache, v_cache: [NB, BS, KVH, D] float32 contiguous;
// block_table: [B, MAXBLK] int32; seq_lens: [B] int32; rows: [B] int64 (q row of each seq).
void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor rows,
                  double scale, torch::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous() && rows.is_contiguous(),
              "metadata must be contiguous");
  const int B = seq_lens.size(0), H = q.size(1), D = q.size(2);
  const int BS = k_cache.size(1), KVH = k_cache.size(2), MAXBLK = block_table.size(1);
  auto args = std::make_tuple(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                              v_cache.data_ptr<float>(), block_table.data_ptr<int>(),
                              seq_lens.data_ptr<int>(), rows.data_ptr<int64_t>(),
                              out.data_ptr<float>());
  auto run = [&](auto impl) {
    std::apply([&](auto... p) { impl(p..., B, H, KVH, D, BS, MAXBLK, (float)scale); }, args);
  };
  if (D == 32) run(decode_impl<32>);
  else if (D == 64) run(decode_impl<64>);
  else if (D == 128) run(decode_impl<128>);
  else run(decode_impl<0>);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
