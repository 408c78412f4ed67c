// Token sampling, one logits row per block: temperature, top-k, top-p, min-p
// and the exponential race in one launch, in place of the dozen torch ops
// (and a sort) of atom.ops.sampling.sample_ref.
//
// Per row, with s = logits / temperature and w = exp(s - max s):
//   - greedy rows (temperature 0 or top_k 1): argmax of the logits;
//   - every token gets a 64-bit key that orders it as a stable descending sort
//     does: the float's order-preserving bits, then the inverted index (ties go
//     to the lower index);
//   - top-k keeps the k largest keys, found by radix select on counts;
//   - top-p keeps the shortest prefix of the rest whose mass reaches top_p,
//     found by radix select on mass. Mass is w in 32.32 fixed point, summed
//     with integer atomics: exact, so the result never depends on the order in
//     which threads add (two runs of one row always agree);
//   - min-p drops tokens with w < min_p (min_p times the top token's weight);
//   - the race: argmax over kept tokens of w / max(draw, 1e-10), draw ~ Exp(1)
//     from the caller, ties to the lower index.
// With a draft token per row (the verification of speculative drafts), the row
// also gives that token's probability, w(draft) over the kept tokens' sum of w
// (a greedy row: 1 if the draft is its argmax, else 0), and the race leaves the
// draft out: a token from the residual distribution, drawn where the draft was
// rejected. Where the draft was the only token kept, the row's token is the draft.
// The reference's probabilities are normalised and summed in floats, so the
// two can differ only where a boundary sits within rounding of a threshold.
// keyed_draws fills seeded requests' rows of the draws, each from its key alone.
#include <algorithm>

#include "kernel_common.h"

namespace atom {
namespace {

constexpr int kThreads = 1024;
constexpr int kGroups = kThreads / kGroup;
constexpr int kUnroll = 4;  // loads in flight per thread in a pass over the row
constexpr int kBins = 256;  // one 8-bit digit per radix pass
constexpr int kMaxCandidates = 2048;  // tokens of the chosen bucket kept in shared memory
constexpr float kMinDraw = 1e-10f;  // as the reference's MIN_EXP_DRAW
constexpr float kMassScale = 4294967296.f;  // 2^32: w = 1 (the top token) is 2^32 units of mass
constexpr float kMassSpan = 22.2f;  // exp(-22.2) < 2^-32: tokens further below the top have no mass units

struct SampleParams {
  const float* logits;
  int64_t logits_stride;
  const float* draws;
  int64_t draws_stride;
  const float* temperature;
  const float* top_p;
  const int64_t* top_k;
  const float* min_p;
  int64_t* out;
  const int64_t* drafts;  // null, or per row the draft token (-1: none)
  float* draft_probs;  // with drafts: per row, the draft's probability
  int vocab;
  int index_bits;  // 2^index_bits >= vocab
};

struct Shared {
  unsigned long long mass[kBins];
  unsigned int count[kBins];
  uint64_t candidate_key[kMaxCandidates];
  unsigned long long candidate_units[kMaxCandidates];
  float reduce_value[kGroups];
  int reduce_index[kGroups];
  // The digit search's answer, broadcast to the block.
  unsigned long long remaining;
  unsigned int digit;
  unsigned int bucket_count;
  unsigned int candidates;
  uint64_t found_key;
};

__device__ __forceinline__ uint64_t sort_key(float s, int i, int index_bits) {
  uint32_t u = __float_as_uint(s);
  if (u == 0x80000000u) u = 0;  // -0 sorts with +0, as in torch
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << index_bits) | static_cast<uint64_t>((1u << index_bits) - 1u - i);
}

__device__ __forceinline__ unsigned long long mass_units(float s, float top) {
  return static_cast<unsigned long long>(expf(s - top) * kMassScale);
}

// Larger value wins, then the lower index (torch's argmax keeps the first maximum).
__device__ __forceinline__ bool beats(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

// f(i, x[i]) for every token of the row, the block's threads striding over it with kUnroll loads in flight.
template <typename F>
__device__ __forceinline__ void for_each_token(const float* x, int n, F f) {
  for (int base = threadIdx.x; base < n; base += kThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = base + u * kThreads < n ? x[base + u * kThreads] : 0.f;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads < n) f(base + u * kThreads, v[u]);
    }
  }
}

__device__ __forceinline__ uint64_t shfl_up_u64(uint64_t v, int delta) {
  const uint32_t lo = __shfl_up_sync(0xffffffffu, static_cast<uint32_t>(v), delta, kGroup);
  const uint32_t hi = __shfl_up_sync(0xffffffffu, static_cast<uint32_t>(v >> 32), delta, kGroup);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

__device__ __forceinline__ uint64_t shfl_u64(uint64_t v, int lane) {
  const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(v), lane, kGroup);
  const uint32_t hi = __shfl_sync(0xffffffffu, static_cast<uint32_t>(v >> 32), lane, kGroup);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// The block's (value, index) winner; every thread gets it.
__device__ void block_argmax(Shared& sh, float& v, int& i) {
#pragma unroll
  for (int off = kGroup / 2; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off, kGroup);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off, kGroup);
    if (beats(ov, oi, v, i)) v = ov, i = oi;
  }
  if (threadIdx.x % kGroup == 0) sh.reduce_value[threadIdx.x / kGroup] = v, sh.reduce_index[threadIdx.x / kGroup] = i;
  __syncthreads();
  v = sh.reduce_value[0];
  i = sh.reduce_index[0];
  for (int g = 1; g < kGroups; ++g) {
    if (beats(sh.reduce_value[g], sh.reduce_index[g], v, i)) v = sh.reduce_value[g], i = sh.reduce_index[g];
  }
  __syncthreads();  // the scratch is reused
}

__device__ float block_sum(Shared& sh, float v) {
  v = group_sum(v);
  if (threadIdx.x % kGroup == 0) sh.reduce_value[threadIdx.x / kGroup] = v;
  __syncthreads();
  v = 0.f;
  for (int g = 0; g < kGroups; ++g) v += sh.reduce_value[g];
  __syncthreads();  // the scratch is reused
  return v;
}

__device__ float block_min(Shared& sh, float v) {
  int unused = 0;
  v = -v;
  block_argmax(sh, v, unused);
  return -v;
}

// Run by the first 32 threads after a histogram pass: the digit d whose bin
// holds the `remaining`-th unit counted from digit 255 down, i.e.
// above(d) < remaining <= above(d) + bin[d]. Leaves d, remaining - above(d)
// and the bin's token count in `sh`. With a fraction (top-p, first pass),
// `remaining` is first ceil(fraction * the bins' total).
template <typename T>
__device__ void find_digit(Shared& sh, const T* bins, uint64_t remaining, double fraction) {
  const int lane = threadIdx.x;
  const int top = kBins - 1 - lane * (kBins / kGroup);  // this lane's 8 digits: top, top-1, ..., top-7
  uint64_t own = 0;
#pragma unroll
  for (int j = 0; j < kBins / kGroup; ++j) own += bins[top - j];
  uint64_t inclusive = own;
#pragma unroll
  for (int off = 1; off < kGroup; off *= 2) {
    const uint64_t o = shfl_up_u64(inclusive, off);
    if (lane >= off) inclusive += o;
  }
  if (fraction > 0.0) {
    const uint64_t total = shfl_u64(inclusive, kGroup - 1);
    const double target = ceil(fraction * static_cast<double>(total));
    remaining = target < 1.0 ? 1 : (target > static_cast<double>(total) ? total : static_cast<uint64_t>(target));
  }
  uint64_t above = inclusive - own;
  if (above < remaining && remaining <= inclusive) {
    for (int j = 0; j < kBins / kGroup; ++j) {
      const uint64_t bin = bins[top - j];
      if (remaining <= above + bin) {
        sh.digit = top - j;
        sh.remaining = remaining - above;
        sh.bucket_count = sh.count[top - j];
        break;
      }
      above += bin;
    }
  }
}

// One histogram pass: visit(f) calls f(digit, units) for each token taking part. Returns the digit
// holding the `remaining`-th unit from the top (find_digit), with `remaining` updated to within it.
template <bool kByMass, typename Visit>
__device__ unsigned histogram_pass(Shared& sh, Visit visit, uint64_t& remaining, double fraction) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) sh.mass[b] = 0, sh.count[b] = 0;
  if (threadIdx.x == 0) {  // what the search leaves if no bin qualifies (a row of NaN or -inf): no hang
    sh.digit = 0;
    sh.remaining = 1;
    sh.bucket_count = 0;
  }
  __syncthreads();
  visit([&](unsigned digit, unsigned long long units) {
    if (kByMass) atomicAdd(&sh.mass[digit], units);
    atomicAdd(&sh.count[digit], 1u);
  });
  __syncthreads();
  if (threadIdx.x < kGroup) {
    if (kByMass) {
      find_digit(sh, sh.mass, remaining, fraction);
    } else {
      find_digit(sh, sh.count, remaining, 0.0);
    }
  }
  __syncthreads();
  remaining = sh.remaining;
  return sh.digit;
}

// The key of the `remaining`-th token from the top (by count, or by mass: the token whose running mass
// first reaches ceil(fraction * total)) among tokens with key >= floor_key (and mass units, by mass).
//   1. a histogram over 256 buckets of (top - s), linear up to `span` below the top (keys' top bits are
//      the float's exponent: a first radix pass over them would pile most tokens into a few bins);
//   2. the chosen bucket's tokens copied to shared memory (or, past kMaxCandidates, read from the row);
//   3. radix passes over their keys, 8 bits at a time, until one token is left.
template <bool kByMass>
__device__ uint64_t select_key(Shared& sh, const float* x, const SampleParams& p, float temperature, float top,
                               float span, uint64_t floor_key, uint64_t remaining, double fraction) {
  const float scale = span > 0.f ? kBins / span : 0.f;
  auto bucket_digit = [&](float s) -> unsigned {  // 255 at the top: larger digits hold larger keys
    const float d = (top - s) * scale;
    return d < static_cast<float>(kBins - 1) ? kBins - 1 - static_cast<unsigned>(d) : 0u;
  };
  // f(s, key, units) for each token taking part in this select.
  auto each_token = [&](auto f) {
    for_each_token(x, p.vocab, [&](int i, float xi) {
      const float s = xi / temperature;
      const uint64_t key = sort_key(s, i, p.index_bits);
      if (key < floor_key) return;
      const unsigned long long units = kByMass ? mass_units(s, top) : 1ull;
      if (units == 0) return;  // below every possible boundary (the boundary token has mass)
      f(s, key, units);
    });
  };
  const unsigned bucket = histogram_pass<kByMass>(
      sh,
      [&](auto add) {
        each_token([&](float s, uint64_t, unsigned long long units) { add(bucket_digit(s), units); });
      },
      remaining, fraction);
  if (threadIdx.x == 0) sh.candidates = 0;
  __syncthreads();
  each_token([&](float s, uint64_t key, unsigned long long units) {
    if (bucket_digit(s) != bucket) return;
    const unsigned c = atomicAdd(&sh.candidates, 1u);
    if (c < kMaxCandidates) sh.candidate_key[c] = key, sh.candidate_units[c] = units;
  });
  __syncthreads();
  const unsigned candidates = sh.candidates;
  const bool in_shared = candidates <= kMaxCandidates;
  // g(key, units) for each token of the chosen bucket.
  auto each_candidate = [&](auto g) {
    if (in_shared) {
      for (unsigned c = threadIdx.x; c < candidates; c += kThreads) g(sh.candidate_key[c], sh.candidate_units[c]);
    } else {
      each_token([&](float s, uint64_t key, unsigned long long units) {
        if (bucket_digit(s) == bucket) g(key, units);
      });
    }
  };
  uint64_t prefix = 0, mask = 0;
  unsigned left = candidates;
  const int total_bits = (32 + p.index_bits + 7) / 8 * 8;
  for (int shift = total_bits - 8; shift >= 0 && left > 1; shift -= 8) {
    const unsigned digit = histogram_pass<kByMass>(
        sh,
        [&](auto add) {
          each_candidate([&](uint64_t key, unsigned long long units) {
            if ((key & mask) == prefix) add(static_cast<unsigned>(key >> shift) & (kBins - 1), units);
          });
        },
        remaining, 0.0);
    prefix |= static_cast<uint64_t>(digit) << shift;
    mask |= static_cast<uint64_t>(kBins - 1) << shift;
    left = sh.bucket_count;
    __syncthreads();  // everyone has read sh before it changes
  }
  // One token left: its key (its bucket alone, or the prefix narrowed to it).
  if (threadIdx.x == 0) sh.found_key = prefix;
  __syncthreads();
  each_candidate([&](uint64_t key, unsigned long long) {
    if ((key & mask) == prefix) sh.found_key = key;
  });
  __syncthreads();
  const uint64_t key = sh.found_key;
  __syncthreads();
  return key;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  pdl_enter();
  __shared__ Shared sh;
  const int row = blockIdx.x;
  const float* x = p.logits + row * p.logits_stride;
  const float temperature = p.temperature[row];
  const int64_t top_k = p.top_k[row];
  const int64_t draft = p.drafts ? p.drafts[row] : -1;

  if (temperature == 0.f || top_k == 1) {
    float best = -INFINITY;
    int best_i = INT32_MAX;
    for_each_token(x, p.vocab, [&](int i, float xi) {
      if (beats(xi, i, best, best_i)) best = xi, best_i = i;
    });
    block_argmax(sh, best, best_i);
    if (threadIdx.x == 0) {
      p.out[row] = best_i;
      if (p.drafts) p.draft_probs[row] = draft == best_i ? 1.f : 0.f;
    }
    return;
  }

  float top = -INFINITY, bottom = INFINITY;
  for_each_token(x, p.vocab, [&](int, float xi) {
    top = fmaxf(top, xi / temperature);
    bottom = fminf(bottom, xi / temperature);
  });
  int unused = 0;
  block_argmax(sh, top, unused);
  bottom = block_min(sh, bottom);

  uint64_t floor_key = 0;  // kept: keys >= floor_key
  if (top_k > 1 && top_k < p.vocab) {
    floor_key = select_key<false>(sh, x, p, temperature, top, top - bottom, 0, static_cast<uint64_t>(top_k), 0.0);
  }
  const float top_p = p.top_p[row];
  if (top_p < 1.f) {
    // A fraction of 0 would mean "by count" to find_digit: a top_p that float32 holds as 0 keeps the top token.
    const double fraction = top_p > 0.f ? top_p : 1e-300;
    floor_key = select_key<true>(sh, x, p, temperature, top, fminf(top - bottom, kMassSpan), floor_key, 0, fraction);
  }

  const float min_p = p.min_p[row];
  const float* draws = p.draws + row * p.draws_stride;
  float best = -INFINITY, kept = 0.f, draft_weight = 0.f;
  int best_i = INT32_MAX;
  for_each_token(x, p.vocab, [&](int i, float xi) {
    const float s = xi / temperature;
    if (sort_key(s, i, p.index_bits) < floor_key) return;
    const float w = expf(s - top);
    if (w < min_p || w == 0.f) return;  // (no weight: never drawn, also where the draft is left out)
    kept += w;
    if (i == draft) {
      draft_weight = w;
      return;
    }
    const float race = w / fmaxf(draws[i], kMinDraw);
    if (beats(race, i, best, best_i)) best = race, best_i = i;
  });
  block_argmax(sh, best, best_i);
  if (p.drafts) {
    kept = block_sum(sh, kept);
    draft_weight = block_sum(sh, draft_weight);
  }
  if (threadIdx.x == 0) {
    p.out[row] = best_i == INT32_MAX && draft >= 0 ? draft : best_i;
    if (p.drafts) p.draft_probs[row] = draft_weight / kept;
  }
}

// Keyed Exp(1) draws (seeded requests; atom.ops.sampling.keyed_draws_ref): row rows.row[j] of draws gets
// -log(1 - v_i), v_i the top 53 bits of SplitMix64's i-th output from key mix64(seed + counter * kGamma), over
// 2^53. In double, as the reference: the two give the same floats. The rows come by value (no upload).
constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct KeyedRows {
  int64_t row[kMaxKeyedRows];
  uint64_t seed[kMaxKeyedRows];
  uint64_t counter[kMaxKeyedRows];
};

__global__ void keyed_draws_kernel(float* draws, int64_t stride, int64_t width, KeyedRows rows) {
  pdl_enter();
  const int j = blockIdx.y;
  float* out = draws + rows.row[j] * stride;
  const uint64_t key = mix64(rows.seed[j] + rows.counter[j] * kGamma);
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < width; i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t bits = mix64(key + static_cast<uint64_t>(i + 1) * kGamma);
    out[i] = static_cast<float>(-log1p(-static_cast<double>(bits >> 11) * 0x1p-53));
  }
}

}  // namespace

const char* sample_tokens(uintptr_t logits, int64_t logits_stride, uintptr_t draws, int64_t draws_stride,
                          uintptr_t temperature, uintptr_t top_p, uintptr_t top_k, uintptr_t min_p, uintptr_t out,
                          uintptr_t drafts, uintptr_t draft_probs, int64_t rows, int64_t vocab, uintptr_t stream) {
  if (rows < 0 || vocab < 1 || vocab > (1 << 24)) return "sample_tokens: needs rows >= 0 and 1 <= vocab <= 2^24";
  if (rows == 0) return nullptr;
  if (rows > INT32_MAX) return "sample_tokens: too many rows";
  if ((drafts == 0) != (draft_probs == 0)) return "sample_tokens: drafts and draft_probs go together";
  int index_bits = 1;
  while ((int64_t{1} << index_bits) < vocab) ++index_bits;
  SampleParams p{reinterpret_cast<const float*>(logits),
                 logits_stride,
                 reinterpret_cast<const float*>(draws),
                 draws_stride,
                 reinterpret_cast<const float*>(temperature),
                 reinterpret_cast<const float*>(top_p),
                 reinterpret_cast<const int64_t*>(top_k),
                 reinterpret_cast<const float*>(min_p),
                 reinterpret_cast<int64_t*>(out),
                 reinterpret_cast<const int64_t*>(drafts),
                 reinterpret_cast<float*>(draft_probs),
                 static_cast<int>(vocab),
                 index_bits};
  launch_kernel(sample_kernel, static_cast<unsigned>(rows), kThreads, 0, as_stream(stream), p);
  return last_launch_error();
}

const char* keyed_draws(uintptr_t draws, int64_t stride, int64_t width, const int64_t* rows, const uint64_t* seeds,
                        const uint64_t* counters, int64_t n, uintptr_t stream) {
  if (n < 0 || width < 0) return "keyed_draws: needs n >= 0 and width >= 0";
  constexpr int threads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((width + threads - 1) / threads, 64));
  for (int64_t first = 0; first < n && width > 0; first += kMaxKeyedRows) {
    const int count = static_cast<int>(std::min<int64_t>(n - first, kMaxKeyedRows));
    KeyedRows batch;
    for (int j = 0; j < count; ++j) {
      batch.row[j] = rows[first + j];
      batch.seed[j] = seeds[first + j];
      batch.counter[j] = counters[first + j];
    }
    launch_kernel(keyed_draws_kernel, dim3(blocks, static_cast<unsigned>(count)), threads, 0, as_stream(stream),
                  reinterpret_cast<float*>(draws), stride, width, batch);
    if (const char* error = last_launch_error()) return error;
  }
  return nullptr;
}

}  // namespace atom
