// GPT-2 small's matrix products (1,024 tokens: batch 4 x 256) on oneDNN's bfloat16 matmul, each in
// the three ways a training step asks for it, with the weight operand laid out three ways: how much
// of AMX's rate the row-major weights dtrain hands over cost, against weights packed in the layout
// the kernel asks for (format_tag::any, as benchdnn times it) and against the transposed weight the
// input gradient reads. Operands already bfloat16, float32 out; the packing itself is not timed (a
// weight changes once a step; packing it costs about 1/(2 M) of the product). Not built by CMake:
//
//   g++ -O2 -std=c++17 bench/micro/bf16_matmul_layouts.cc -o /tmp/mm_layouts -ldnnl
//   OMP_NUM_THREADS=1 taskset -c 0 /tmp/mm_layouts 5      # rounds (the layouts alternate)
//
// GFLOP/s, the fastest call of each round, the median over rounds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

using namespace dnnl;
using dt = memory::data_type;

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Case {
  std::string name;
  int64_t m, k, n;
  bool ta, tb;  // A stored [k, m], B stored [n, k]
  bool pack_b;  // B in the kernel's own layout (format_tag::any)
};

struct Prim {
  matmul prim;
  memory a, b, c;
};

Prim make(const engine& eng, const Case& c) {
  const memory::desc a({c.m, c.k}, dt::bf16, c.ta ? memory::dims{1, c.m} : memory::dims{c.k, 1});
  const memory::desc b =
      c.pack_b
          ? memory::desc({c.k, c.n}, dt::bf16, memory::format_tag::any)
          : memory::desc({c.k, c.n}, dt::bf16, c.tb ? memory::dims{1, c.k} : memory::dims{c.n, 1});
  const memory::desc out({c.m, c.n}, dt::f32, memory::dims{c.n, 1});
  const matmul::primitive_desc pd(matmul::desc(a, b, out), eng);
  Prim p{matmul(pd), memory(pd.src_desc(), eng), memory(pd.weights_desc(), eng),
         memory(pd.dst_desc(), eng)};
  for (memory* mm : {&p.a, &p.b})  // small values: no denormals, no NaN
    std::fill_n(static_cast<uint16_t*>(mm->get_data_handle()), mm->get_desc().get_size() / 2,
                uint16_t{0x3c00});
  std::printf("  %-34s %s\n", c.name.c_str(), pd.impl_info_str());
  return p;
}
}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const engine eng(engine::kind::cpu, 0);
  stream s(eng);
  struct Shape {
    const char* what;
    int64_t k, n;  // the weight: [k, n] (x @ W), M = 1024 tokens
  };
  const int64_t m = 1024;
  std::vector<Case> cases;
  for (const Shape sh :
       {Shape{"qkv", 768, 2304}, Shape{"attn proj", 768, 768}, Shape{"mlp fc", 768, 3072},
        Shape{"mlp proj", 3072, 768}, Shape{"lm head", 768, 50257}}) {
    const std::string w = sh.what;
    // forward y = x W: B = W row-major, or packed
    cases.push_back({w + " fwd, W row-major", m, sh.k, sh.n, false, false, false});
    cases.push_back({w + " fwd, W packed", m, sh.k, sh.n, false, false, true});
    // input gradient dx = dy W^T: B = W^T read as it lies, or a packed W^T
    cases.push_back({w + " dx, W^T as it lies", m, sh.n, sh.k, false, true, false});
    cases.push_back({w + " dx, W^T packed", m, sh.n, sh.k, false, false, true});
    // weight gradient dW = x^T dy: A transposed, B = dy row-major
    cases.push_back({w + " dW, x^T as it lies", sh.k, m, sh.n, true, false, false});
  }
  std::printf("primitives:\n");
  std::vector<Prim> prims;
  for (const Case& c : cases) prims.push_back(make(eng, c));
  std::vector<std::vector<double>> rates(cases.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < cases.size(); ++i) {
      Prim& p = prims[i];
      double best = 1e30;
      for (int rep = 0; rep < 4; ++rep) {
        const double t0 = now();
        p.prim.execute(s, {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}});
        s.wait();
        if (rep > 0) best = std::min(best, now() - t0);
      }
      const Case& c = cases[i];
      rates[i].push_back(2.0 * c.m * c.k * c.n / best / 1e9);
    }
  std::printf("\nGFLOP/s, median over %d rounds of the fastest of 3 calls (rounds: min-max)\n",
              rounds);
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<double> v = rates[i];
    std::sort(v.begin(), v.end());
    std::printf("  %-34s %7.0f  (%4.0f-%4.0f)", cases[i].name.c_str(), v[v.size() / 2], v.front(),
                v.back());
    // A packed case after its unpacked one: the ratio within each round (this is what compares on
    // a VM whose speed moves between rounds), median over rounds.
    if (cases[i].pack_b && i > 0) {
      std::vector<double> q;
      for (int r = 0; r < rounds; ++r) q.push_back(rates[i][r] / rates[i - 1][r]);
      std::sort(q.begin(), q.end());
      std::printf("  packed / as it lies: %.2fx (rounds %.2f-%.2f)", q[q.size() / 2], q.front(),
                  q.back());
    }
    std::printf("\n");
  }
}
