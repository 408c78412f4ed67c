// Short depthwise causal conv1d + SiLU for decode, over the slot-indexed
// conv state (KDA's q/k/v short convolutions).
//
// Per sequence b and channel c, with the slot's state [c, 0 .. W-2] = the last
// W-1 raw inputs (oldest first) and weight [c, 0 .. W-1]:
//
//   window = [state[c, :], x_t]                   (W values)
//   y      = silu(round(sum_w weight[c, w] * window[w]))   fp32 sum, rounded
//                                                  to the model dtype as torch's
//                                                  conv1d output is, then SiLU
//   state  = window[1:]
//
// Slots as in kda.cu: read state_slots[b], write the final state to
// out_slots[b] or, per_token, the state after token t to out_slots[b] + t;
// state_slots[b] < 0 is a padding row (zero output).
// One thread per (sequence, channel); the state row of a channel is W-1
// contiguous elements, so a warp touches one contiguous run of memory.
#include "kernel_common.h"

namespace atom {
namespace {

struct ConvParams {
  const void* x;
  void* state;
  int64_t slot_stride;
  const void* weight;
  const int64_t* in_slots;
  const int64_t* out_slots;
  bool per_token;
  const uint8_t* has_initial_state;
  void* out;
  int tokens;
  int64_t channels;
};

constexpr int kThreads = 256;

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) conv1d_update_kernel(ConvParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t b = blockIdx.y;
  if (c >= p.channels) return;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  // the per-sequence values are loaded together, not one after another's use
  const int64_t slot0 = p.in_slots[b], out_base = p.out_slots[b];
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[b] != 0;
  if (slot0 < 0) {
    for (int t = 0; t < p.tokens; ++t) out[(b * p.tokens + t) * p.channels + c] = from_float<T>(0.f);
    return;
  }
  T* state = static_cast<T*>(p.state);

  float win[W - 1], wt[W];
  const T* src = state + slot0 * p.slot_stride + c * (W - 1);
#pragma unroll
  for (int w = 0; w < W - 1; ++w) win[w] = init ? to_float(src[w]) : 0.f;
  const T* weight = static_cast<const T*>(p.weight) + c * W;
#pragma unroll
  for (int w = 0; w < W; ++w) wt[w] = to_float(weight[w]);

  for (int t = 0; t < p.tokens; ++t) {
    const int64_t i = (b * p.tokens + t) * p.channels + c;
    const float xt = to_float(x[i]);
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < W - 1; ++w) acc = fmaf(wt[w], win[w], acc);
    acc = fmaf(wt[W - 1], xt, acc);
    const float y = round_to<T>(acc);
    out[i] = from_float<T>(y / (1.f + expf(-y)));
#pragma unroll
    for (int w = 0; w + 1 < W - 1; ++w) win[w] = win[w + 1];
    win[W - 2] = xt;
    if (p.per_token || t == p.tokens - 1) {
      const int64_t dst_slot = out_base + (p.per_token ? t : 0);
      if (out_base >= 0) {
        T* dst = state + dst_slot * p.slot_stride + c * (W - 1);
#pragma unroll
        for (int w = 0; w < W - 1; ++w) dst[w] = from_float<T>(win[w]);
      }
    }
  }
}

template <typename T, int W>
const char* launch(const ConvParams& p, int64_t batch, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.channels, kThreads)), static_cast<unsigned>(batch));
  conv1d_update_kernel<T, W><<<grid, kThreads, 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace

const char* conv1d_update(uintptr_t x, uintptr_t conv_state, int64_t slot_stride, uintptr_t weight,
                          uintptr_t state_slots, uintptr_t out_slots, bool per_token, uintptr_t has_initial_state,
                          uintptr_t out,
                          int64_t batch, int64_t tokens, int64_t channels, int64_t width, int dtype,
                          uintptr_t stream) {
  if (batch < 0 || tokens < 1 || channels < 1) return "conv1d_update: needs batch >= 0, tokens >= 1, channels >= 1";
  if (batch > 65535 || tokens > INT32_MAX) return "conv1d_update: batch must be <= 65535";
  if (batch == 0) return nullptr;
  ConvParams p{reinterpret_cast<const void*>(x),
               reinterpret_cast<void*>(conv_state),
               slot_stride,
               reinterpret_cast<const void*>(weight),
               reinterpret_cast<const int64_t*>(state_slots),
               reinterpret_cast<const int64_t*>(out_slots),
               per_token,
               reinterpret_cast<const uint8_t*>(has_initial_state),
               reinterpret_cast<void*>(out),
               static_cast<int>(tokens),
               channels};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "conv1d_update", [&]() -> const char* {
    switch (width) {
      case 2:
        return launch<scalar_t, 2>(p, batch, st);
      case 3:
        return launch<scalar_t, 3>(p, batch, st);
      case 4:
        return launch<scalar_t, 4>(p, batch, st);
      case 5:
        return launch<scalar_t, 5>(p, batch, st);
      default:
        return "conv1d_update: kernel width must be 2..5";
    }
  });
}

}  // namespace atom
