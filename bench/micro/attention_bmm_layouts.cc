// GPT-2 small's attention products (4 windows x 12 heads of 256 tokens, 64 wide) on oneDNN 2.6's
// bfloat16 batched matmul, from float32 operands as dtrain's CPU kernels get them: the scores
// Q K^T (and dO V^T in the backward pass), whose second operand is a transpose, with that operand's
// bfloat16 copy made as it lies (a strided B, dtrain's way) or transposed by the same copy (a
// row-major B); the copies timed. Not built by CMake:
//
//   g++ -O2 -std=c++17 bench/micro/attention_bmm_layouts.cc -o /tmp/attention_bmm -ldnnl
//   OMP_NUM_THREADS=1 taskset -c 0 /tmp/attention_bmm 7      # rounds (the variants alternate)
//
// GFLOP/s of the product (2 B M K N over the fastest of 5 calls, the copies included), the median
// over rounds, and the transposed copy's ratio to the strided one within each round.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <vector>

using namespace dnnl;
using dt = memory::data_type;

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
const int64_t B = 48, M = 256, K = 64, N = 256;
}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 7;
  engine eng(engine::kind::cpu, 0);
  stream s(eng);
  // Q [B, M, K] and K [B, N, K] (so B^T: the scores' second operand [B, K, N] read with strides
  // {K N, 1, K}), float32, and their bfloat16 copies.
  std::vector<float> q(B * M * K, 0.5f), kk(B * N * K, 0.25f), c(B * M * N);
  std::vector<uint16_t> q16(q.size()), k16(kk.size());
  const memory::desc q32d({B, M, K}, dt::f32, {M * K, K, 1}),
      q16d({B, M, K}, dt::bf16, {M * K, K, 1});
  const memory::desc kt32d({B, K, N}, dt::f32, {K * N, 1, K});
  const memory::desc kt16_strided({B, K, N}, dt::bf16, {K * N, 1, K});
  const memory::desc kt16_rows({B, K, N}, dt::bf16, {K * N, N, 1});
  const memory::desc cd({B, M, N}, dt::f32, {M * N, N, 1});
  reorder cast_q(reorder::primitive_desc(eng, q32d, eng, q16d));
  reorder cast_k_strided(reorder::primitive_desc(eng, kt32d, eng, kt16_strided));
  reorder cast_k_rows(reorder::primitive_desc(eng, kt32d, eng, kt16_rows));
  matmul::primitive_desc pd_strided(matmul::desc(q16d, kt16_strided, cd), eng);
  matmul::primitive_desc pd_rows(matmul::desc(q16d, kt16_rows, cd), eng);
  printf("strided B: %s\nrow-major B: %s\n", pd_strided.impl_info_str(), pd_rows.impl_info_str());
  matmul mm_strided(pd_strided), mm_rows(pd_rows);
  memory qm(q32d, eng, q.data()), q16m(q16d, eng, q16.data()), km(kt32d, eng, kk.data());
  memory ks(kt16_strided, eng, k16.data()), kr(kt16_rows, eng, k16.data()), cm(cd, eng, c.data());
  std::vector<double> strided, rows, ratio;
  for (int r = 0; r < rounds; ++r) {
    double best[2] = {1e30, 1e30};
    for (int v = 0; v < 2; ++v)
      for (int rep = 0; rep < 6; ++rep) {
        const double t0 = now();
        cast_q.execute(s, qm, q16m);
        if (v == 0) {
          cast_k_strided.execute(s, km, ks);
          mm_strided.execute(s, {{DNNL_ARG_SRC, q16m}, {DNNL_ARG_WEIGHTS, ks}, {DNNL_ARG_DST, cm}});
        } else {
          cast_k_rows.execute(s, km, kr);
          mm_rows.execute(s, {{DNNL_ARG_SRC, q16m}, {DNNL_ARG_WEIGHTS, kr}, {DNNL_ARG_DST, cm}});
        }
        s.wait();
        if (rep) best[v] = std::min(best[v], now() - t0);
      }
    const double flop = 2.0 * B * M * K * N;
    strided.push_back(flop / best[0] / 1e9);
    rows.push_back(flop / best[1] / 1e9);
    ratio.push_back(best[0] / best[1]);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  printf("strided B (as it lies)   %6.1f GFLOP/s\n", median(strided));
  printf("row-major B (transposed) %6.1f GFLOP/s, %.2fx the strided (rounds %.2f-%.2f)\n",
         median(rows), median(ratio), *std::min_element(ratio.begin(), ratio.end()),
         *std::max_element(ratio.begin(), ratio.end()));
}
