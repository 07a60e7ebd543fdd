// GPT-2 small's tied output layer on oneDNN 2.6's bfloat16 matmul, in the layouts dtrain's CPU
// kernels hand it (1,024 tokens, E the [50257 x 768] embedding, row-major): the forward product
// x E^T, the input gradient g E and the embedding's gradient g^T x, each whole (what dtrain runs)
// and in blocks through dense temporaries (oneDNN 2.6 runs a strided block on its older jit GEMM,
// not the AMX brgemm kernel, so a block goes through a dense copy). Operands bfloat16, float32
// out. Not built by CMake:
//
//   g++ -O2 -std=c++17 bench/micro/lm_head_blocks.cc -o /tmp/lm_head_blocks -ldnnl
//   OMP_NUM_THREADS=1 taskset -c 0 /tmp/lm_head_blocks 5      # rounds (the variants alternate)
//
// The last two rows start from the float32 gradient, as dtrain's matmul does: its bfloat16 copy as
// it lies (dtrain's way), or transposed by the same copy, so that A is row-major; the copy timed.
// The last row's ratio ("vs whole") is against the row above it.
//
// GFLOP/s (2 M K N over the fastest of 2 timed calls, copies included), the median over rounds,
// and each blocked variant's ratio to the whole product within each round, median over rounds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>
using namespace dnnl;
using dt = memory::data_type;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
const int64_t M = 1024, H = 768, V = 50257;
engine eng(engine::kind::cpu, 0);
std::map<std::string, matmul> cache;
// The primitive for an m x k x n product with those element strides of A, B and C (accumulating
// into C with `sum`), made once and kept; its implementation is printed when made.
matmul& product(int64_t m, int64_t k, int64_t n, memory::dims as, memory::dims bs, memory::dims cs,
                bool sum) {
  std::string key = std::to_string(m) + "," + std::to_string(k) + "," + std::to_string(n) + "," +
                    std::to_string(as[0]) + "," + std::to_string(as[1]) + "," +
                    std::to_string(bs[0]) + "," + std::to_string(bs[1]) + "," +
                    std::to_string(cs[0]) + (sum ? "s" : "");
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  primitive_attr attr;
  if (sum) {
    post_ops po;
    po.append_sum(1.f);
    attr.set_post_ops(po);
  }
  auto pd = matmul::primitive_desc(
      matmul::desc(memory::desc({m, k}, dt::bf16, as), memory::desc({k, n}, dt::bf16, bs),
                   memory::desc({m, n}, dt::f32, cs)),
      attr, eng);
  printf("  [%s] %s\n", key.c_str(), pd.impl_info_str());
  return cache.emplace(key, matmul(pd)).first->second;
}
void execute(stream& s, matmul& p, int64_t m, int64_t k, int64_t n, memory::dims as,
             memory::dims bs, memory::dims cs, const void* a, const void* b, void* c) {
  memory am(memory::desc({m, k}, dt::bf16, as), eng, (void*)a),
      bm(memory::desc({k, n}, dt::bf16, bs), eng, (void*)b),
      cm(memory::desc({m, n}, dt::f32, cs), eng, c);
  p.execute(s, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
}
std::vector<uint16_t> x(M*H, 0x3c00), e(V*H, 0x3c00), g(M*V, 0x3c00), tmpA(8192 * 1024);
std::vector<float> logits(M*V), dx(M*H), de(V*H), tmpC(1024 * 8192), g32(M*V, 1.f);
std::vector<uint16_t> g16(g.size());
// The float32 gradient g [M x V] to bfloat16, read as A = g^T [V x M] (strides {1, V}) and
// written with strides `to`: {1, V} keeps g's layout (what dtrain's matmul does), {M, 1}
// transposes.
void to_bf16(stream& s, memory::dims to) {
  static std::map<std::string, reorder> rs;
  const std::string key = std::to_string(to[0]);
  memory::desc src({V, M}, dt::f32, {1, V}), dst({V, M}, dt::bf16, to);
  auto it = rs.find(key);
  if (it == rs.end())
    it = rs.emplace(key, reorder(reorder::primitive_desc(eng, src, eng, dst))).first;
  memory a(src, eng, g32.data()), b(dst, eng, g16.data());
  it->second.execute(s, a, b);
  s.wait();
}
int main(int argc, char** argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  stream s(eng);
  struct C {
    const char* name;
    int kind;     // 0 x E^T whole, 1 in column blocks, 2 g E whole, 3 in inner blocks, 4 g^T x
                  // whole, 5 in row blocks, 6 g^T x from float32 g, 7 the same cast transposed
    int64_t blk;  // block width (0: whole; nonzero: a ratio against the last whole row above)
  };
  std::vector<C> cs = {{"fwd whole", 0, 0},
                       {"fwd N blocks 1024 via dense temp", 1, 1024},
                       {"fwd N blocks 2048 via dense temp", 1, 2048},
                       {"fwd N blocks 4096 via dense temp", 1, 4096},
                       {"dx whole", 2, 0},
                       {"dx K blocks 2048, A copied dense", 3, 2048},
                       {"dx K blocks 4096, A copied dense", 3, 4096},
                       {"dE whole", 4, 0},
                       {"dE M blocks 2048, A^T copied dense", 5, 2048},
                       {"dE M blocks 4096, A^T copied dense", 5, 4096},
                       {"dE from float32 g, cast as it lies", 6, 0},
                       {"dE from float32 g, cast transposed", 7, 1}};
  std::vector<std::vector<double>> r(cs.size());
  for (int rd = 0; rd < rounds; ++rd)
    for (size_t i = 0; i < cs.size(); ++i) {
      const C& c = cs[i];
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        double t0 = now();
        if (c.kind == 0)
          execute(s, product(M, H, V, {H, 1}, {1, H}, {V, 1}, false), M, H, V, {H, 1}, {1, H},
                  {V, 1}, x.data(), e.data(), logits.data());
        else if (c.kind == 1)
          for (int64_t j = 0; j < V; j += c.blk) {
            int64_t nb = std::min(c.blk, V - j);
            execute(s, product(M, H, nb, {H, 1}, {1, H}, {nb, 1}, false), M, H, nb, {H, 1}, {1, H},
                    {nb, 1}, x.data(), e.data() + j * H, tmpC.data());
            s.wait();
            for (int64_t i2 = 0; i2 < M; ++i2)
              std::memcpy(logits.data() + i2 * V + j, tmpC.data() + i2 * nb, nb * 4);
          }
        else if (c.kind == 2)
          execute(s, product(M, V, H, {V, 1}, {H, 1}, {H, 1}, false), M, V, H, {V, 1}, {H, 1},
                  {H, 1}, g.data(), e.data(), dx.data());
        else if (c.kind == 3)
          for (int64_t p = 0; p < V; p += c.blk) {
            int64_t kb = std::min(c.blk, V - p);
            for (int64_t i2 = 0; i2 < M; ++i2)
              std::memcpy(tmpA.data() + i2 * kb, g.data() + i2 * V + p, kb * 2);
            execute(s, product(M, kb, H, {kb, 1}, {H, 1}, {H, 1}, p > 0), M, kb, H, {kb, 1}, {H, 1},
                    {H, 1}, tmpA.data(), e.data() + p * H, dx.data());
            s.wait();
          }
        else if (c.kind == 4)
          execute(s, product(V, M, H, {1, V}, {H, 1}, {H, 1}, false), V, M, H, {1, V}, {H, 1},
                  {H, 1}, g.data(), x.data(), de.data());
        else if (c.kind == 6) {
          to_bf16(s, {1, V});
          execute(s, product(V, M, H, {1, V}, {H, 1}, {H, 1}, false), V, M, H, {1, V}, {H, 1},
                  {H, 1}, g16.data(), x.data(), de.data());
        } else if (c.kind == 7) {
          to_bf16(s, {M, 1});
          execute(s, product(V, M, H, {M, 1}, {H, 1}, {H, 1}, false), V, M, H, {M, 1}, {H, 1},
                  {H, 1}, g16.data(), x.data(), de.data());
        } else
          for (int64_t i2 = 0; i2 < V; i2 += c.blk) {
            int64_t mb = std::min(c.blk, V - i2);
            for (int64_t t = 0; t < M; ++t)
              std::memcpy(tmpA.data() + t * mb, g.data() + t * V + i2,
                          mb * 2);  // A^T block [mb x M] stored [M x mb]: strides {1, mb}
            execute(s, product(mb, M, H, {1, mb}, {H, 1}, {H, 1}, false), mb, M, H, {1, mb}, {H, 1},
                    {H, 1}, tmpA.data(), x.data(), de.data() + i2 * H);
            s.wait();
          }
        s.wait();
        if (rep) best = std::min(best, now() - t0);
      }
      r[i].push_back(2.0 * M * H * V / best / 1e9);
    }
  for (size_t i = 0; i < cs.size(); ++i) {
    auto v = r[i];
    std::sort(v.begin(), v.end());
    printf("%-36s %6.0f GFLOP/s (%4.0f-%4.0f)", cs[i].name, v[v.size() / 2], v.front(), v.back());
    if (cs[i].blk) {
      int base = i;
      while (cs[base].blk) --base;
      std::vector<double> q;
      for (int rd = 0; rd < rounds; ++rd) q.push_back(r[i][rd] / r[base][rd]);
      std::sort(q.begin(), q.end());
      printf("  vs whole %.2fx (%.2f-%.2f)", q[q.size() / 2], q.front(), q.back());
    }
    printf("\n");
  }
}
