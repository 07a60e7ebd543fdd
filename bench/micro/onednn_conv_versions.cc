// ResNet-50's convolutions (batch 32, channels-last) timed through one oneDNN, forward and both
// backward passes, as dtrain's CPU device asks for them: NHWC activations and gradients in bfloat16
// (or float32), weights in the layout oneDNN chooses, float32 outputs and filter gradients. Built
// once against each oneDNN to compare their kernels on one CPU (the implementation each chose is
// printed). Not built by CMake:
//
//   g++ -O2 -std=c++17 bench/micro/onednn_conv_versions.cc -o /tmp/conv26 -ldnnl    # Debian's 2.6
//   pip download --no-deps onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0 -d /tmp/w
//   (cd /tmp/w && for f in *.whl; do unzip -qo $f -d x; done)                           #
//   oneDNN 3.2 D=/tmp/w/x/onednn_devel_cpu_gomp-2023.2.0.data/data
//   L=/tmp/w/x/onednn_cpu_gomp-2023.2.0.data/data/lib
//   g++ -O2 -std=c++17 -I$D/include bench/micro/onednn_conv_versions.cc -o /tmp/conv32 \
//       -L$L -l:libdnnl.so.3 -Wl,-rpath,$L
//   OMP_NUM_THREADS=1 taskset -c 0 /tmp/conv26 bf16 8     # precision (bf16|f32), repetitions
//
// Each figure is the fastest of the repetitions after one untimed call.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>

using namespace dnnl;
using dt = memory::data_type;
using tag = memory::format_tag;

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double fastest(F f, int reps) {
  f();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    f();
    const double t = now() - t0;
    if (t < best) best = t;
  }
  return best;
}

void fill(memory& m) {
  auto* p = static_cast<unsigned char*>(m.get_data_handle());
  for (size_t i = 0; i < m.get_desc().get_size(); ++i)
    p[i] = static_cast<unsigned char>(i * 7 % 13 + 50);
}

struct Layer {
  int n, hw, cin, cout, k, stride;
};
}  // namespace

int main(int argc, char** argv) {
  const bool bf16 = argc < 2 || std::strcmp(argv[1], "f32") != 0;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 8;
  const dt in = bf16 ? dt::bf16 : dt::f32;
  engine eng(engine::kind::cpu, 0);
  stream st(eng);
  const Layer layers[] = {{32, 56, 64, 64, 3, 1},   {32, 28, 128, 128, 3, 1},
                          {32, 14, 256, 256, 3, 1}, {32, 7, 512, 512, 3, 1},
                          {32, 56, 64, 256, 1, 1},  {32, 14, 1024, 256, 1, 1}};
  std::printf("oneDNN %d.%d, %s operands, fastest of %d\n", dnnl_version()->major,
              dnnl_version()->minor, bf16 ? "bfloat16" : "float32", reps);
  for (const Layer& c : layers) {
    const int pad = c.k / 2, out = c.hw / c.stride;
    const memory::dims src{c.n, c.cin, c.hw, c.hw}, wei{c.cout, c.cin, c.k, c.k}, bias{c.cout},
        dst{c.n, c.cout, out, out}, strides{c.stride, c.stride}, pads{pad, pad};
    const memory::desc s_md(src, in, tag::nhwc), d_md(dst, in, tag::nhwc), w_any(wei, in, tag::any),
        dw_any(wei, dt::f32, tag::any), b_md(bias, dt::f32, tag::a),
        dst_f32(dst, dt::f32, tag::nhwc), src_f32(src, dt::f32, tag::nhwc);
    const auto a = algorithm::convolution_direct;
#if DNNL_VERSION_MAJOR >= 3
    convolution_forward::primitive_desc fpd(eng, prop_kind::forward_training, a, s_md, w_any, b_md,
                                            dst_f32, strides, pads, pads);
    convolution_backward_data::primitive_desc dpd(eng, a, src_f32, w_any, d_md, strides, pads, pads,
                                                  fpd);
    convolution_backward_weights::primitive_desc wpd(eng, a, s_md, dw_any, b_md, d_md, strides,
                                                     pads, pads, fpd);
#else
    convolution_forward::primitive_desc fpd(
        {prop_kind::forward_training, a, s_md, w_any, b_md, dst_f32, strides, pads, pads}, eng);
    convolution_backward_data::primitive_desc dpd({a, src_f32, w_any, d_md, strides, pads, pads},
                                                  eng, fpd);
    convolution_backward_weights::primitive_desc wpd(
        {a, s_md, dw_any, b_md, d_md, strides, pads, pads}, eng, fpd);
#endif
    memory S(s_md, eng), D(d_md, eng), W(fpd.weights_desc(), eng), B(b_md, eng), Y(dst_f32, eng),
        DX(src_f32, eng), WD(dpd.weights_desc(), eng), DW(wpd.diff_weights_desc(), eng),
        DB(b_md, eng);
    fill(S);
    fill(D);
    fill(W);
    fill(WD);
    fill(B);
    convolution_forward fwd(fpd);
    convolution_backward_data bwd_data(dpd);
    convolution_backward_weights bwd_weights(wpd);
    const double flop = 2.0 * c.n * c.cout * out * out * c.cin * c.k * c.k;
    const double tf = fastest(
        [&] {
          fwd.execute(
              st,
              {{DNNL_ARG_SRC, S}, {DNNL_ARG_WEIGHTS, W}, {DNNL_ARG_BIAS, B}, {DNNL_ARG_DST, Y}});
          st.wait();
        },
        reps);
    const double td = fastest(
        [&] {
          bwd_data.execute(
              st, {{DNNL_ARG_DIFF_DST, D}, {DNNL_ARG_WEIGHTS, WD}, {DNNL_ARG_DIFF_SRC, DX}});
          st.wait();
        },
        reps);
    const double tw = fastest(
        [&] {
          bwd_weights.execute(st, {{DNNL_ARG_SRC, S},
                                   {DNNL_ARG_DIFF_DST, D},
                                   {DNNL_ARG_DIFF_WEIGHTS, DW},
                                   {DNNL_ARG_DIFF_BIAS, DB}});
          st.wait();
        },
        reps);
    std::printf(
        "%2dx%-2d %4d->%-4d %dx%d: forward %6.1f ms %5.0f GFLOP/s (%s) | backward data %6.1f ms "
        "%5.0f (%s) | "
        "filter gradient %6.1f ms %5.0f (%s)\n",
        c.hw, c.hw, c.cin, c.cout, c.k, c.k, tf * 1e3, flop / tf / 1e9, fpd.impl_info_str(),
        td * 1e3, flop / td / 1e9, dpd.impl_info_str(), tw * 1e3, flop / tw / 1e9,
        wpd.impl_info_str());
  }
  return 0;
}
