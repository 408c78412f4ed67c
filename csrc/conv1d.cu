// Short depthwise causal conv1d + SiLU over the slot-indexed conv state (KDA's
// q/k/v short convolutions): conv1d_update for decode (a few tokens a sequence,
// token by token), conv1d_prefill for prefill (packed sequences of any length).
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
  int64_t x_stride;  // between token rows of x (b * tokens + t); out's rows are channels apart
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
  pdl_enter();
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
    const int64_t row = b * p.tokens + t;
    const float xt = to_float(x[row * p.x_stride + c]);
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < W - 1; ++w) acc = fmaf(wt[w], win[w], acc);
    acc = fmaf(wt[W - 1], xt, acc);
    const float y = round_to<T>(acc);
    out[row * p.channels + c] = from_float<T>(y / (1.f + expf(-y)));
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
  launch_kernel(conv1d_update_kernel<T, W>, grid, kThreads, 0, stream, p);
  return last_launch_error();
}

// Prefill: sequence b owns packed rows [cu[b], cu[b + 1]) of x and out. Output row t of b sums the
// W inputs ending at t in the same order and rounding as conv1d_update_kernel, taking the inputs before
// the sequence's first row from its slot's state (zeros without one). A thread computes one channel of
// kPrefillRows consecutive rows (or, where the layout allows, two channels of half as many rows), sliding its
// window along them as conv1d_update_kernel does, and starting a new window where a new sequence starts.
constexpr int kPrefillRows = 16;

struct ConvPrefillParams {
  const void* x;
  int64_t x_stride;
  const int64_t* cu_seqlens;
  int num_seqs;
  int64_t rows;
  void* state;
  int64_t slot_stride;
  const void* weight;
  const int64_t* in_slots;
  const uint8_t* has_initial_state;
  void* out;
  int64_t channels;
};

// The sequence that packed row t belongs to: the last b with cu[b] <= t (empty sequences skipped).
__device__ __forceinline__ int seq_of_row(const int64_t* cu, int num_seqs, int64_t t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Channel c's input j of a sequence whose rows start at x_first (j < 0: from the slot's state row, or zero).
template <typename T, int W>
__device__ __forceinline__ float prefill_input(const T* x_first, int64_t x_stride, int64_t j, const T* state_row) {
  if (j >= 0) return to_float(x_first[j * x_stride]);
  return state_row != nullptr ? to_float(state_row[(W - 1) + j]) : 0.f;
}

// Where sequence b's inputs come from, for channel c: its first row of x, and its state row (null: zeros).
template <typename T, int W>
__device__ __forceinline__ const T* state_row_of(const ConvPrefillParams& p, int b, int64_t c) {
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[b] != 0;
  return init ? static_cast<const T*>(p.state) + p.in_slots[b] * p.slot_stride + c * (W - 1) : nullptr;
}

// kN > 1: a thread takes kN adjacent channels (one kN-element load and store a row; channels, x's row stride
// and the pointers allow it) over kRows rows; kN = 1 is the general form.
template <typename T, int W, int kN, int kRows>
__global__ void __launch_bounds__(kThreads, 1) conv1d_prefill_kernel(ConvPrefillParams p) {
  pdl_enter();
  using V = Pack<T, kN>;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * kN;
  if (c >= p.channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t t1 = min(t0 + kRows, p.rows);
  const T* x = static_cast<const T*>(p.x) + c;
  T* out = static_cast<T*>(p.out) + c;
  float wt[kN][W];
#pragma unroll
  for (int k = 0; k < kN; ++k) {
#pragma unroll
    for (int w = 0; w < W; ++w) wt[k][w] = to_float(static_cast<const T*>(p.weight)[(c + k) * W + w]);
  }

  // every row's input first, as independent loads (one at a time, each row waited for its load)
  V xs[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) xs[i] = *reinterpret_cast<const V*>(x + min(t0 + i, t1 - 1) * p.x_stride);
  int b = seq_of_row(p.cu_seqlens, p.num_seqs, t0);
  int64_t end = p.cu_seqlens[b + 1];
  bool padding = false;
  float win[kN][W - 1];
  const int n = static_cast<int>(t1 - t0);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if (i >= n) continue;
    const int64_t t = t0 + i;
    if (i == 0 || t == end) {  // a window for row t: its sequence's W-1 inputs before it
      while (p.cu_seqlens[b + 1] <= t) ++b;
      const int64_t first = p.cu_seqlens[b];
      end = p.cu_seqlens[b + 1];
      padding = p.in_slots[b] < 0;
      const T* state_row = padding ? nullptr : state_row_of<T, W>(p, b, c);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const T* x_first = x + k + first * p.x_stride;
        const T* state_k = state_row != nullptr ? state_row + k * (W - 1) : nullptr;
#pragma unroll
        for (int w = 0; w < W - 1; ++w) {
          win[k][w] = prefill_input<T, W>(x_first, p.x_stride, t - first - (W - 1) + w, state_k);
        }
      }
    }
    V o;
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float xt = to_float(xs[i].v[k]);
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < W - 1; ++w) acc = fmaf(wt[k][w], win[k][w], acc);
      acc = fmaf(wt[k][W - 1], xt, acc);
      const float y = round_to<T>(acc);
      o.v[k] = from_float<T>(padding ? 0.f : y / (1.f + expf(-y)));  // a padding sequence: zeros
#pragma unroll
      for (int w = 0; w + 1 < W - 1; ++w) win[k][w] = win[k][w + 1];
      win[k][W - 2] = xt;
    }
    *reinterpret_cast<V*>(out + t * p.channels) = o;
  }
}

// Each sequence's state after its last row: its last W-1 inputs. A separate launch, after every output
// row has read the old states (a slot may be both read and written).
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) conv1d_prefill_state_kernel(ConvPrefillParams p, const int64_t* out_slots) {
  pdl_enter();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int b = blockIdx.y;
  if (c >= p.channels || p.in_slots[b] < 0 || out_slots[b] < 0) return;
  const int64_t first = p.cu_seqlens[b], length = p.cu_seqlens[b + 1] - first;
  const T* x_first = static_cast<const T*>(p.x) + first * p.x_stride + c;
  const T* state_row = state_row_of<T, W>(p, b, c);
  float win[W - 1];
#pragma unroll
  for (int w = 0; w < W - 1; ++w) win[w] = prefill_input<T, W>(x_first, p.x_stride, length - (W - 1) + w, state_row);
  T* dst = static_cast<T*>(p.state) + out_slots[b] * p.slot_stride + c * (W - 1);
#pragma unroll
  for (int w = 0; w < W - 1; ++w) dst[w] = from_float<T>(win[w]);  // every read above before any write
}

template <typename T, int W>
const char* launch_prefill(const ConvPrefillParams& p, const int64_t* out_slots, int64_t rows, cudaStream_t stream) {
  const int64_t channel_blocks = ceil_div(p.channels, kThreads);
  if (rows > 0) {
    // Two channels a thread (one 4-byte load a row in bf16), 8 rows: 1.13x the one-channel form at 1 x 4000
    // and 32 x 250 rows on an H200 (GPU_NOTES.md, session 19); four or eight channels a thread, or other row
    // counts, were slower.
    constexpr int kN = 2, kRowsVec = kPrefillRows / 2;
    const bool vec = reinterpret_cast<uintptr_t>(p.x) % (kN * sizeof(T)) == 0 &&
                     reinterpret_cast<uintptr_t>(p.out) % (kN * sizeof(T)) == 0 && p.channels % kN == 0 &&
                     p.x_stride % kN == 0;
    if (vec) {
      const dim3 grid(static_cast<unsigned>(ceil_div(rows, kRowsVec)),
                      static_cast<unsigned>(ceil_div(p.channels, kThreads * kN)));
      launch_kernel(conv1d_prefill_kernel<T, W, kN, kRowsVec>, grid, kThreads, 0, stream, p);
    } else {
      const dim3 grid(static_cast<unsigned>(ceil_div(rows, kPrefillRows)), static_cast<unsigned>(channel_blocks));
      launch_kernel(conv1d_prefill_kernel<T, W, 1, kPrefillRows>, grid, kThreads, 0, stream, p);
    }
    if (const char* err = last_launch_error()) return err;
  }
  launch_kernel(conv1d_prefill_state_kernel<T, W>,
                dim3(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(p.num_seqs)), kThreads, 0, stream, p,
                out_slots);
  return last_launch_error();
}

}  // namespace

const char* conv1d_update(uintptr_t x, int64_t x_stride, uintptr_t conv_state, int64_t slot_stride,
                          uintptr_t weight, uintptr_t state_slots, uintptr_t out_slots, bool per_token,
                          uintptr_t has_initial_state, uintptr_t out, int64_t batch, int64_t tokens,
                          int64_t channels, int64_t width, int dtype, uintptr_t stream) {
  if (batch < 0 || tokens < 1 || channels < 1) return "conv1d_update: needs batch >= 0, tokens >= 1, channels >= 1";
  if (batch > 65535 || tokens > INT32_MAX) return "conv1d_update: batch must be <= 65535";
  if (batch == 0) return nullptr;
  if (x_stride < channels) return "conv1d_update: x's rows must be at least channels apart";
  ConvParams p{reinterpret_cast<const void*>(x),
               x_stride,
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


const char* conv1d_prefill(uintptr_t x, int64_t x_stride, uintptr_t cu_seqlens, int64_t num_seqs, int64_t rows,
                           uintptr_t conv_state, int64_t slot_stride, uintptr_t weight, uintptr_t state_slots,
                           uintptr_t out_slots, uintptr_t has_initial_state, uintptr_t out, int64_t channels,
                           int64_t width, int dtype, uintptr_t stream) {
  if (num_seqs < 0 || rows < 0 || channels < 1 || x_stride < channels) {
    return "conv1d_prefill: needs num_seqs, rows >= 0, channels >= 1 and x_stride >= channels";
  }
  if (num_seqs > 65535 || rows > INT32_MAX || ceil_div(channels, kThreads) > 65535) {
    return "conv1d_prefill: at most 65535 sequences, 2^31 - 1 rows and 65535 * 256 channels";
  }
  if (num_seqs == 0) return nullptr;
  ConvPrefillParams p{reinterpret_cast<const void*>(x),
                      x_stride,
                      reinterpret_cast<const int64_t*>(cu_seqlens),
                      static_cast<int>(num_seqs),
                      rows,
                      reinterpret_cast<void*>(conv_state),
                      slot_stride,
                      reinterpret_cast<const void*>(weight),
                      reinterpret_cast<const int64_t*>(state_slots),
                      reinterpret_cast<const uint8_t*>(has_initial_state),
                      reinterpret_cast<void*>(out),
                      channels};
  const auto* outs = reinterpret_cast<const int64_t*>(out_slots);
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "conv1d_prefill", [&]() -> const char* {
    switch (width) {
      case 2:
        return launch_prefill<scalar_t, 2>(p, outs, rows, st);
      case 3:
        return launch_prefill<scalar_t, 3>(p, outs, rows, st);
      case 4:
        return launch_prefill<scalar_t, 4>(p, outs, rows, st);
      case 5:
        return launch_prefill<scalar_t, 5>(p, outs, rows, st);
      default:
        return "conv1d_prefill: kernel width must be 2..5";
    }
  });
}

}  // namespace atom
