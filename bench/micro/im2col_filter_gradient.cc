// A 3x3, stride-1, padding-1 convolution's filter gradient at batch 32 in bfloat16, two ways, on
// one core: oneDNN 2.6's convolution backward_weights primitive (plus the reorder to HWIO that
// dtrain does after it), against im2col (the 9 x Cin values each output position reads, as rows)
// and one matrix product dW[9 Cin, Cout] = cols^T dy, which gives HWIO as it is. Prints medians and
// minimums of the repetitions and the largest difference between the two results. Not built by
// CMake:
//
//   g++ -O2 -std=c++17 bench/micro/im2col_filter_gradient.cc -o /tmp/im2col -ldnnl
//   OMP_NUM_THREADS=1 taskset -c 0 /tmp/im2col 6      # repetitions
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <vector>
using namespace dnnl;
using dt = memory::data_type;
using tag = memory::format_tag;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 6;
  engine eng(engine::kind::cpu, 0);
  stream st(eng);
  struct L {
    int n, h, c, k;
  } ls[] = {{32, 7, 512, 512}, {32, 14, 256, 256}, {32, 28, 128, 128}};
  for (auto l : ls) {
    memory::dims src{l.n, l.c, l.h, l.h}, wei{l.k, l.c, 3, 3}, dst{l.n, l.k, l.h, l.h}, b{l.k};
    memory::desc s_md(src, dt::bf16, tag::nhwc), d_md(dst, dt::bf16, tag::nhwc),
        dw_any(wei, dt::f32, tag::any), b_md(b, dt::f32, tag::a);
    convolution_forward::primitive_desc fpd({prop_kind::forward_training,
                                             algorithm::convolution_direct,
                                             s_md,
                                             memory::desc(wei, dt::bf16, tag::any),
                                             b_md,
                                             memory::desc(dst, dt::f32, tag::nhwc),
                                             {1, 1},
                                             {1, 1},
                                             {1, 1}},
                                            eng);
    convolution_backward_weights::primitive_desc wpd(
        {algorithm::convolution_direct, s_md, dw_any, b_md, d_md, {1, 1}, {1, 1}, {1, 1}}, eng,
        fpd);
    memory S(s_md, eng), D(d_md, eng), DW(wpd.diff_weights_desc(), eng), DB(b_md, eng);
    memory DWh(memory::desc(wei, dt::f32, tag::hwio), eng);
    auto* sp = (uint16_t*)S.get_data_handle();
    auto* dp = (uint16_t*)D.get_data_handle();
    for (size_t i = 0; i < s_md.get_size() / 2; ++i) sp[i] = 0x3f80 + (i * 7 % 13);
    for (size_t i = 0; i < d_md.get_size() / 2; ++i) dp[i] = 0x3f80 + (i * 5 % 11);
    convolution_backward_weights bw(wpd);
    reorder to_hwio(DW, DWh);
    // im2col: rows = N*H*W, cols = 9*C
    const int64_t M = (int64_t)l.n * l.h * l.h, K9 = 9LL * l.c;
    std::vector<uint16_t> cols(M * K9);
    memory::desc a_md({K9, M}, dt::bf16, tag::ba);  // A = cols^T, stored as cols [M, K9]
    memory::desc bmat({M, l.k}, dt::bf16, tag::ab), cmat({K9, l.k}, dt::f32, tag::ab);
    matmul::primitive_desc mpd({a_md, bmat, cmat}, eng);
    matmul mm(mpd);
    memory A(a_md, eng, cols.data()), B(bmat, eng, dp), C(cmat, eng);
    auto im2col = [&] {
      const size_t row = l.c * 2;
      for (int n = 0; n < l.n; ++n)
        for (int y = 0; y < l.h; ++y)
          for (int x = 0; x < l.h; ++x) {
            char* out = (char*)&cols[(((int64_t)n * l.h + y) * l.h + x) * K9];
            for (int ky = 0; ky < 3; ++ky) {
              int iy = y + ky - 1;
              for (int kx = 0; kx < 3; ++kx, out += row) {
                int ix = x + kx - 1;
                if (iy < 0 || iy >= l.h || ix < 0 || ix >= l.h)
                  std::memset(out, 0, row);
                else
                  std::memcpy(out, (char*)sp + (((int64_t)n * l.h + iy) * l.h + ix) * row, row);
              }
            }
          }
    };
    std::vector<double> tc, tg, ti;
    for (int r = 0; r < reps + 1; ++r) {
      double t0 = now();
      bw.execute(st, {{DNNL_ARG_SRC, S},
                      {DNNL_ARG_DIFF_DST, D},
                      {DNNL_ARG_DIFF_WEIGHTS, DW},
                      {DNNL_ARG_DIFF_BIAS, DB}});
      to_hwio.execute(st, DW, DWh);
      st.wait();
      double t1 = now();
      im2col();
      double t2 = now();
      mm.execute(st, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}});
      st.wait();
      double t3 = now();
      if (r) {
        tc.push_back(t1 - t0);
        ti.push_back(t2 - t1);
        tg.push_back(t3 - t2);
      }
    }
    // check
    const float* a = (const float*)DWh.get_data_handle();
    const float* c = (const float*)C.get_data_handle();
    double md = 0, mx = 0;
    for (int64_t i = 0; i < K9 * l.k; ++i) {
      md = std::max(md, (double)std::abs(a[i] - c[i]));
      mx = std::max(mx, (double)std::abs(a[i]));
    }
    auto med = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2] * 1e3;
    };
    auto mn = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()) * 1e3; };
    double flop = 2.0 * M * K9 * l.k;
    std::printf(
        "%2dx%-2d %3d->%-3d: conv bwd_w+reorder median %6.1f ms (min %5.1f, %4.0f GF/s) | im2col "
        "%5.1f + matmul %6.1f ms median (min %5.1f, %4.0f GF/s) [%s] | max|diff| %.3g of %.3g\n",
        l.h, l.h, l.c, l.k, med(tc), mn(tc), flop / mn(tc) / 1e6, med(ti), med(tg), mn(tg),
        flop / mn(tg) / 1e6, mpd.impl_info_str(), md, mx);
  }
}
