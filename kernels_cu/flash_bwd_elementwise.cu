// The backward pass's element-wise kernels, shared by every dK/dV kernel
// (flash_bwd.cu, flash_bwd_wgmma.cu):
//   preprocess:  delta_i = rowsum(dO_i * O_i), and zero the float32 dQ accumulator
//   convert:     float32 dQ accumulator -> dq in the input dtype and strides
#include "numeric.cuh"
#include "params.cuh"
#include "warp_reduce.cuh"

namespace cuflash {

// The rows of the q-side tensors, (batch, seqlen_q, nheads) (a packed
// batch: one entry of total_q rows, ProblemSize), are enumerated with the
// head fastest, which is also the layout of the float32 dQ accumulator
// (total_q, nheads, head_dim): row r's accumulator starts at
// dq_accum + r * head_dim. A packed batch's rows past its last sequence are
// visited too: their dQ is 0.
struct QueryRow {
    index_t batch, row, head;  // batch entry and row of the tensors
};

__device__ __forceinline__ QueryRow query_row(index_t r, const ProblemSize& size) {
    QueryRow q;
    q.head = r % size.nheads;
    const index_t rest = r / size.nheads;
    const index_t rows_per_entry = size.tensor_seqlen_q();
    q.row = rest % rows_per_entry;
    q.batch = rest / rows_per_entry;
    return q;
}

// Calls f(r, row, lane) for every query row r of the problem with one warp
// per row, grid-stride (r is uniform per warp: shuffles inside f see all
// lanes).
template <int kWarps, typename F>
__device__ __forceinline__ void for_each_query_row_by_warp(const ProblemSize& size, F&& f) {
    const index_t rows = size.total_q * size.nheads;
    const int lane = threadIdx.x % 32;
    const index_t first = static_cast<index_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    const index_t step = static_cast<index_t>(gridDim.x) * kWarps;
    for (index_t r = first; r < rows; r += step) {
        f(r, query_row(r, size), lane);
    }
}

// delta = rowsum(dO * O), one warp per query row; also zeroes the row's dQ
// accumulator when there is one, and the dQ turn counters of the ordered
// mode, which saves separate memset passes.
template <typename Element, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_preprocess_kernel(const BackwardParams params) {
    const int head_dim = params.size.head_dim_int();
    if (params.dq_semaphore != nullptr) {
        const index_t counters = params.size.batch * params.size.nheads * params.num_m_blocks;
        for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < counters;
             i += static_cast<index_t>(gridDim.x) * blockDim.x) {
            params.dq_semaphore[i] = 0;
        }
    }
    for_each_query_row_by_warp<kWarps>(params.size, [&](index_t r, const QueryRow& q, int lane) {
        const Element* o = params.out.row_ptr<const Element>(q.batch, q.head, q.row);
        const Element* dout = params.dout.row_ptr<const Element>(q.batch, q.head, q.row);
        float sum = 0.0f;
        // Two elements per lane and access where the rows allow it (even
        // head_dim, pair-aligned rows): half the load instructions.
        if (head_dim % 2 == 0 && pair_aligned<Element>(o) && pair_aligned<Element>(dout)) {
            for (int c = 2 * lane; c < head_dim; c += 64) {
                const float2 a = load_pair(o + c), b = load_pair(dout + c);
                sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
            }
        } else {
            for (int c = lane; c < head_dim; c += 32) {
                sum = fmaf(to_float(o[c]), to_float(dout[c]), sum);
            }
        }
        sum = group_allreduce_sum<32>(sum);
        if (lane == 0) {
            params.delta_row(q.batch, q.head)[q.row] = sum;
        }
        if (params.dq_accum != nullptr) {
            float* acc = params.dq_accum + r * head_dim;
            if (head_dim % 2 == 0) {  // the accumulator is contiguous: rows of even length are 8-byte aligned
                for (int c = 2 * lane; c < head_dim; c += 64) {
                    *reinterpret_cast<float2*>(acc + c) = make_float2(0.0f, 0.0f);
                }
            } else {
                for (int c = lane; c < head_dim; c += 32) {
                    acc[c] = 0.0f;
                }
            }
        }
    });
}

// dq (input dtype, any strides) = the float32 accumulator, already scaled.
// One warp per query row, as in the preprocessing: the row's coordinates
// take 64-bit divisions, which per element would cost more than the copy.
template <typename Element, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_convert_dq_kernel(const BackwardParams params) {
    const int head_dim = params.size.head_dim_int();
    for_each_query_row_by_warp<kWarps>(params.size, [&](index_t r, const QueryRow& q, int lane) {
        Element* dq = params.dq.row_ptr<Element>(q.batch, q.head, q.row);
        const float* acc = params.dq_accum + r * head_dim;
        if (head_dim % 2 == 0 && pair_aligned<Element>(dq)) {
            for (int c = 2 * lane; c < head_dim; c += 64) {
                store_pair(dq + c, *reinterpret_cast<const float2*>(acc + c));
            }
        } else {
            for (int c = lane; c < head_dim; c += 32) {
                dq[c] = from_float<Element>(acc[c]);
            }
        }
    });
}

}  // namespace cuflash
