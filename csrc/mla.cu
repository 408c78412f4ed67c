// MLA decode attention over the paged latent cache, absorbed form.
//
// Every head of sequence b attends over the same cached rows
// [c (rank) | k_rot (rope)] of its first seq_lens[b] positions:
//
//   score_p = (q_latent . c_p + q_pe . k_rot_p) * scale
//   out     = sum_p softmax(score)_p c_p                  [H, rank]
//
// so a sequence's cache is read once for all its heads (multi-query shape).
// With 32 heads that is ~60 flop per cache byte: more than CUDA cores can do
// at HBM speed, so the bf16 512/64 case (Kimi-Linear, DeepSeek) runs on the
// tensor cores (mla_mma.cuh; on sm_90a builds and compute capability 9.0
// GPUs the warpgroup-MMA version, mla_wgmma.cuh). Long sequences are split
// over several blocks (flash-decoding); mla_combine_kernel merges the splits by their
// log-sum-exp. Other dtypes and sizes, and HIP builds, use the CUDA-core
// kernel below.
#include "mla_common.cuh"

#if !defined(__HIPCC__) && !defined(USE_ROCM)
#define ATOM_MLA_MMA 1
#include "mla_mma.cuh"
#include "mla_wgmma.cuh"
#endif

namespace atom {
namespace {

// ---- CUDA-core kernel: any dtype, rank <= 1024, any rope.
// grid (H, B, splits), block 128; warp w scores positions 8w .. 8w+7 of each
// 32-position tile, then every thread updates its latent columns.
constexpr int kGenericTile = 32;
constexpr int kGenericThreads = 128;
constexpr int kGenericMaxCols = 8;  // rank <= 128 * 8

template <typename T, typename OutT>
__global__ void __launch_bounds__(kGenericThreads) mla_decode_generic_kernel(MlaParams p) {
  float* q_s = dynamic_shared<float>();  // rank + rope
  __shared__ float score[kGenericTile];
  const int h = blockIdx.x, split = blockIdx.z;
  const int64_t b = blockIdx.y;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int dim = p.rank + p.rope;
  const int64_t seq_len = load_index(p.seq_lens, b, p.sl64);
  const TileRange tiles = split_tiles(seq_len, kGenericTile, split, p.num_splits);
  if (tiles.begin >= tiles.end) {
    write_empty<OutT>(p, b, split, h, 1);
    return;
  }
  const T* ql = static_cast<const T*>(p.q_latent) + (b * p.heads + h) * p.rank;
  const T* qp = static_cast<const T*>(p.q_pe) + (b * p.heads + h) * p.rope;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) q_s[d] = to_float(d < p.rank ? ql[d] : qp[d - p.rank]);
  __syncthreads();

  const T* cache = static_cast<const T*>(p.cache);
  float m = -INFINITY, l = 0.f, acc[kGenericMaxCols];
#pragma unroll
  for (int i = 0; i < kGenericMaxCols; ++i) acc[i] = 0.f;

  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    for (int j = 0; j < kGenericTile / 4; ++j) {
      const int jj = warp * (kGenericTile / 4) + j;
      const int64_t pos = tile * kGenericTile + jj;
      float dot = 0.f;
      if (pos < seq_len) {
        const T* row = cache + row_offset(p, b, pos);
        for (int d = lane; d < dim; d += kGroup) dot = fmaf(q_s[d], to_float(row[d]), dot);
      }
      dot = group_sum(dot);
      if (lane == 0) score[jj] = pos < seq_len ? dot * p.scale : -INFINITY;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int j = 0; j < kGenericTile; ++j) mx = fmaxf(mx, score[j]);
    const float m_new = fmaxf(m, mx);  // finite: a tile's first position is valid
    const float alpha = expf(m - m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < kGenericMaxCols; ++i) acc[i] *= alpha;
    for (int j = 0; j < kGenericTile; ++j) {
      const int64_t pos = tile * kGenericTile + j;
      if (pos >= seq_len) break;
      const float pj = expf(score[j] - m_new);
      l += pj;
      const T* row = cache + row_offset(p, b, pos);
#pragma unroll
      for (int i = 0; i < kGenericMaxCols; ++i) {
        const int d = threadIdx.x + i * kGenericThreads;
        if (d < p.rank) acc[i] = fmaf(pj, to_float(row[d]), acc[i]);
      }
    }
    m = m_new;
    __syncthreads();  // score is rewritten next tile
  }

  const float inv = 1.f / l;
  if (p.num_splits == 1) {
    OutT* out = static_cast<OutT*>(p.out) + (b * p.heads + h) * p.rank;
#pragma unroll
    for (int i = 0; i < kGenericMaxCols; ++i) {
      const int d = threadIdx.x + i * kGenericThreads;
      if (d < p.rank) out[d] = from_float<OutT>(acc[i] * inv);
    }
  } else {
    const int64_t part = (b * p.num_splits + split) * p.heads + h;
    float* o = p.o_part + part * p.rank;
#pragma unroll
    for (int i = 0; i < kGenericMaxCols; ++i) {
      const int d = threadIdx.x + i * kGenericThreads;
      if (d < p.rank) o[d] = acc[i] * inv;
    }
    if (threadIdx.x == 0) p.lse_part[part] = m + logf(l);
  }
}

// ---- merge splits (merge_splits, kernel_common.h). grid (H, B), block kMergeThreads.
template <typename OutT>
__global__ void __launch_bounds__(kMergeThreads) mla_combine_kernel(MlaParams p) {
  const int h = blockIdx.x, S = p.num_splits;
  const int64_t b = blockIdx.y;
  merge_splits(p.lse_part + b * S * p.heads + h, p.heads, p.o_part + (b * S * p.heads + h) * p.rank,
               static_cast<int64_t>(p.heads) * p.rank, S, p.rank,
               static_cast<OutT*>(p.out) + (b * p.heads + h) * p.rank);
}

#ifdef ATOM_MLA_MMA
template <typename Kernel>
const char* launch_mma(Kernel kernel, size_t smem, int threads, const MlaParams& p, int64_t batch,
                       cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const dim3 grid(p.num_splits, static_cast<unsigned>(ceil_div(p.heads, mma::kHeads)), static_cast<unsigned>(batch));
  kernel<<<grid, threads, smem, stream>>>(p);
  return last_launch_error();
}

// A launch of the warpgroup kernel whose clusters are `splits` blocks along x (one sequence's splits).
class ClusterLaunch {
 public:
  ClusterLaunch(dim3 grid, int splits, cudaStream_t stream) {
    config_.gridDim = grid;
    config_.blockDim = dim3(wg::kThreads);
    config_.dynamicSmemBytes = wg::kSmemBytes;
    config_.stream = stream;
    cluster_.id = cudaLaunchAttributeClusterDimension;
    cluster_.val.clusterDim.x = static_cast<unsigned>(splits);
    cluster_.val.clusterDim.y = 1;
    cluster_.val.clusterDim.z = 1;
    config_.attrs = &cluster_;
    config_.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config_ points at cluster_
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
  const cudaLaunchConfig_t* config() const { return &config_; }

 private:
  cudaLaunchConfig_t config_ = {};
  cudaLaunchAttribute cluster_ = {};
};

template <typename Kernel>
cudaError_t allow_wgmma_smem(Kernel kernel) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(wg::kSmemBytes));
}

// The warpgroup kernel with each sequence's splits as one thread-block cluster (sm_90), which
// merges them itself.
template <typename OutT>
const char* launch_cluster(const MlaParams& p, int64_t batch, cudaStream_t stream) {
  auto kernel = wg::mla_decode_wgmma_kernel<OutT, true>;
  cudaError_t err = allow_wgmma_smem(kernel);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const ClusterLaunch launch(dim3(p.num_splits, static_cast<unsigned>(ceil_div(p.heads, wg::kHeads)),
                                  static_cast<unsigned>(batch)),
                             p.num_splits, stream);
  err = cudaLaunchKernelEx(launch.config(), kernel, p);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// How many clusters of `splits` warpgroup-kernel blocks the device runs at once (0 if unknown).
int max_active_clusters(int splits) {
  static int cached[wg::kMaxClusterSplits + 1] = {};  // per cluster size, for the current device
  static int device_of[wg::kMaxClusterSplits + 1] = {};
  int device = 0;
  if (splits < 1 || splits > wg::kMaxClusterSplits || cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cached[splits] > 0 && device_of[splits] == device) return cached[splits];
  auto kernel = wg::mla_decode_wgmma_kernel<bf16_t, true>;
  int clusters = 0;
  const ClusterLaunch launch(dim3(splits), splits, nullptr);
  if (allow_wgmma_smem(kernel) != cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, kernel, launch.config()) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  cached[splits] = clusters;
  device_of[splits] = device;
  return clusters;
}
#endif

// Whether a resolved kernel merges the splits itself, in a cluster, without o_part / lse_part (else
// mla_combine_kernel merges them).
bool merges_in_cluster(int kernel, int64_t num_splits) {
#ifdef ATOM_MLA_MMA
  return kernel == kMlaWarpgroupCluster && num_splits > 1 && num_splits <= wg::kMaxClusterSplits;
#else
  (void)kernel;
  (void)num_splits;
  return false;
#endif
}

template <typename T, typename OutT>
const char* launch_decode(const MlaParams& p, int64_t batch, int kernel, cudaStream_t stream) {
  const char* err = nullptr;
  switch (kernel) {
#ifdef ATOM_MLA_MMA
    case kMlaTensorCores8:
      err = launch_mma(mma::mla_decode_mma_kernel<8, false, false, OutT>, sizeof(mma::Smem), 8 * 32, p, batch, stream);
      break;
    case kMlaTensorCores16:
      err = launch_mma(mma::mla_decode_mma_kernel<16, false, false, OutT>, sizeof(mma::Smem), 16 * 32, p, batch, stream);
      break;
    case kMlaTensorCores8Lean:
      err = launch_mma(mma::mla_decode_mma_kernel<8, true, false, OutT>, sizeof(mma::Smem), 8 * 32, p, batch, stream);
      break;
    case kMlaTensorCores16Lean:
      err = launch_mma(mma::mla_decode_mma_kernel<16, true, false, OutT>, sizeof(mma::Smem), 16 * 32, p, batch, stream);
      break;
    case kMlaTensorCores16Bulk:
      err = launch_mma(mma::mla_decode_mma_kernel<16, true, true, OutT>, sizeof(mma::Smem), 16 * 32, p, batch, stream);
      break;
    case kMlaWarpgroupCluster:
      if (merges_in_cluster(kernel, p.num_splits)) return launch_cluster<OutT>(p, batch, stream);
      // one split (nothing to merge) or more than a cluster holds: as kMlaWarpgroup (mla_combine_kernel merges)
      [[fallthrough]];
    case kMlaWarpgroup:
      err = launch_mma(wg::mla_decode_wgmma_kernel<OutT, false>, wg::kSmemBytes, wg::kThreads, p, batch, stream);
      break;
#endif
    default: {
      const size_t smem = static_cast<size_t>(p.rank + p.rope) * sizeof(float);
      const dim3 grid(p.heads, static_cast<unsigned>(batch), p.num_splits);
      mla_decode_generic_kernel<T, OutT><<<grid, kGenericThreads, smem, stream>>>(p);
      err = last_launch_error();
    }
  }
  if (err != nullptr) return err;
  if (p.num_splits > 1) {
    const dim3 grid(p.heads, static_cast<unsigned>(batch));
    mla_combine_kernel<OutT><<<grid, kMergeThreads, merge_shared_bytes(p.num_splits), stream>>>(p);
  }
  return last_launch_error();
}

template <typename T>
const char* dispatch_out(const MlaParams& p, int64_t batch, int kernel, int out_dtype, cudaStream_t stream) {
  switch (out_dtype) {
    case kFloat32:
      return launch_decode<T, float>(p, batch, kernel, stream);
    case kBFloat16:
      return launch_decode<T, bf16_t>(p, batch, kernel, stream);
    case kFloat16:
      return launch_decode<T, fp16_t>(p, batch, kernel, stream);
    default:
      return "mla_decode: out must be float32, bfloat16 or float16";
  }
}

}  // namespace

namespace {

// The current device's compute capability (major * 10 + minor), 0 if unknown.
int device_capability() {
#ifdef ATOM_MLA_MMA
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return 0;
  return major * 10 + minor;
#else
  return 0;
#endif
}

// Whether the current device is Hopper or newer (cp.async.bulk, mbarrier tx counts).
bool has_sm90() { return device_capability() >= 90; }

}  // namespace

bool mla_decode_has_tensor_cores() {
#ifdef ATOM_MLA_MMA
  return true;
#else
  return false;
#endif
}

bool mla_decode_has_warpgroup_mma() {
#if defined(ATOM_MLA_MMA) && defined(ATOM_SM90A)
  return device_capability() == 90;  // sm_90a code runs on compute capability 9.0 only
#else
  return false;
#endif
}

namespace {

// Whether the tensor-core kernels take these operands: bf16, rank 512 + rope 64, 16-byte aligned rows.
bool tensor_cores_fit(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride, int64_t row_stride,
                      int64_t rank, int64_t rope_dim, int dtype) {
  const bool aligned16 = (q_latent | q_pe | cache) % 16 == 0 && block_stride % 8 == 0 && row_stride % 8 == 0;
  return mla_decode_has_tensor_cores() && dtype == kBFloat16 && rank == 512 && rope_dim == 64 && aligned16;
}

// The kernel kMlaAuto stands for with these arguments (any other kernel is returned as it is).
int resolve_kernel(int kernel, bool mma_fits, int64_t batch, int64_t heads, int64_t num_splits) {
  if (kernel != kMlaAuto) return kernel;
  kernel = !mma_fits ? kMlaCudaCores : mla_decode_has_warpgroup_mma() ? kMlaWarpgroup : kMlaTensorCores16Lean;
#ifdef ATOM_MLA_MMA
  // splits merged in a cluster, where every cluster runs at once (a second wave would cost more than the merge)
  const int64_t clusters = batch * ceil_div(heads, static_cast<int64_t>(wg::kHeads));
  if (kernel == kMlaWarpgroup && num_splits > 1 && num_splits <= wg::kMaxClusterSplits &&
      clusters <= max_active_clusters(static_cast<int>(num_splits)))
    kernel = kMlaWarpgroupCluster;
#endif
  return kernel;
}

}  // namespace

bool mla_decode_needs_workspace(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride,
                                int64_t row_stride, int64_t batch, int64_t heads, int64_t rank, int64_t rope_dim,
                                int64_t num_splits, int dtype, int kernel) {
  if (num_splits <= 1) return false;
  const bool mma_fits = tensor_cores_fit(q_latent, q_pe, cache, block_stride, row_stride, rank, rope_dim, dtype);
  return !merges_in_cluster(resolve_kernel(kernel, mma_fits, batch, heads, num_splits), num_splits);
}

const char* mla_decode(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride,
                       int64_t row_stride, int64_t block_size, uintptr_t block_tables, int64_t block_table_stride,
                       int block_table_dtype, uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out,
                       uintptr_t o_part, uintptr_t lse_part, int64_t batch, int64_t heads, int64_t rank,
                       int64_t rope_dim, int64_t num_splits, double scale, int dtype, int out_dtype, int kernel,
                       uintptr_t stream) {
  if (batch < 0 || heads < 1 || rank < 1 || rope_dim < 0 || block_size < 1)
    return "mla_decode: needs batch >= 0, heads, rank, block_size >= 1, rope_dim >= 0";
  if (num_splits < 1 || num_splits > 1024) return "mla_decode: num_splits must be in 1..1024";
  if (batch > 65535 || heads > 65535) return "mla_decode: batch and heads must be <= 65535";
  const bool idx_ok = (block_table_dtype == kInt32 || block_table_dtype == kInt64) &&
                      (seq_lens_dtype == kInt32 || seq_lens_dtype == kInt64);
  if (!idx_ok) return "mla_decode: block_tables and seq_lens must be int32 or int64";
  if (kernel < kMlaAuto || kernel > kMlaWarpgroupCluster) return "mla_decode: unknown kernel (MlaKernel)";
  const bool mma_fits = tensor_cores_fit(q_latent, q_pe, cache, block_stride, row_stride, rank, rope_dim, dtype);
  kernel = resolve_kernel(kernel, mma_fits, batch, heads, num_splits);
  if (num_splits > 1 && !merges_in_cluster(kernel, num_splits) && (o_part == 0 || lse_part == 0))
    return "mla_decode: num_splits > 1 needs o_part and lse_part (mla_decode_needs_workspace)";
  if (batch == 0) return nullptr;
  MlaParams p{reinterpret_cast<const void*>(q_latent),
              reinterpret_cast<const void*>(q_pe),
              reinterpret_cast<const void*>(cache),
              block_stride,
              row_stride,
              static_cast<int>(block_size),
              reinterpret_cast<const void*>(block_tables),
              block_table_stride,
              block_table_dtype == kInt64,
              reinterpret_cast<const void*>(seq_lens),
              seq_lens_dtype == kInt64,
              reinterpret_cast<void*>(out),
              reinterpret_cast<float*>(o_part),
              reinterpret_cast<float*>(lse_part),
              static_cast<int>(heads),
              static_cast<int>(rank),
              static_cast<int>(rope_dim),
              static_cast<int>(num_splits),
              static_cast<float>(scale)};
  cudaStream_t st = as_stream(stream);
  if (kernel != kMlaCudaCores && !mma_fits)
    return "mla_decode: the tensor-core kernels need bf16, rank 512, rope 64, 16-byte aligned rows (CUDA)";
  if (kernel == kMlaTensorCores16Bulk && !has_sm90()) return "mla_decode: bulk copies need an sm_90+ GPU";
  if ((kernel == kMlaWarpgroup || kernel == kMlaWarpgroupCluster) && !mla_decode_has_warpgroup_mma())
    return "mla_decode: warpgroup MMAs need an sm_90a build (CMAKE_CUDA_ARCHITECTURES 90a) and an sm_90 GPU";
  if (kernel == kMlaCudaCores && rank > kGenericThreads * kGenericMaxCols) return "mla_decode: rank must be <= 1024";
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "mla_decode", [&]() {
    return dispatch_out<scalar_t>(p, batch, kernel, out_dtype, st);
  });
}

}  // namespace atom
