// The backward pass's element-wise kernels, shared by every dK/dV kernel
// (flash_bwd.cu, flash_bwd_wgmma.cu):
//   preprocess:  delta_i = rowsum(dO_i * O_i), and zero the float32 dQ
//                accumulator (unless its blocks are stored first, dq_block_m)
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
    const index_t rows_per_entry = size.tensor_seqlen_q();
    // 32-bit divisions where the row count allows (a 64-bit one is a
    // subroutine of ~70 instructions, paid per row here).
    if (size.total_q * size.nheads <= 0xffffffffll) {
        const unsigned index = static_cast<unsigned>(r), heads = static_cast<unsigned>(size.nheads);
        const unsigned rest = index / heads, per_entry = static_cast<unsigned>(rows_per_entry);
        q.head = index - rest * heads;
        q.row = rest % per_entry;
        q.batch = rest / per_entry;
        return q;
    }
    q.head = r % size.nheads;
    const index_t rest = r / size.nheads;
    q.row = rest % rows_per_entry;
    q.batch = rest / rows_per_entry;
    return q;
}

// Calls f(r, row, lane, valid) for every query row r of the problem with
// kLanesPerRow lanes per row (a power of two dividing 32), grid-stride. Every
// lane of a warp makes the same calls, so f may shuffle within its row's
// lanes; `valid` is false for a group past the last row (its r is clamped to
// a real row, and f must not write).
template <int kLanesPerRow, int kWarps, typename F>
__device__ __forceinline__ void for_each_query_row(const ProblemSize& size, F&& f) {
    constexpr int kRowsPerWarp = 32 / kLanesPerRow;
    const index_t rows = size.total_q * size.nheads;
    const int lane = threadIdx.x % 32;
    const index_t first = (static_cast<index_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kRowsPerWarp;
    const index_t step = static_cast<index_t>(gridDim.x) * kWarps * kRowsPerWarp;
    for (index_t r0 = first; r0 < rows; r0 += step) {
        const index_t r = r0 + lane / kLanesPerRow;
        const bool valid = r < rows;
        const index_t row = valid ? r : rows - 1;
        f(row, query_row(row, size), lane % kLanesPerRow, valid);
    }
}

// Whether every row of `t` starts on a 16-byte boundary (whole chunks of 8
// 16-bit elements): the pointer and every stride. Uniform over the grid.
template <typename Element>
__device__ __forceinline__ bool rows_in_chunks(const TensorRef& t, int head_dim) {
    static_assert(sizeof(Element) == 2, "chunks of 8 16-bit elements");
    return head_dim % 8 == 0 && reinterpret_cast<unsigned long long>(t.ptr) % 16 == 0 && t.batch_stride % 8 == 0 &&
           t.row_stride % 8 == 0 && t.head_stride % 8 == 0;
}

// kLanesPerRow as a type, for the generic lambdas of with_lanes_per_row.
template <int kLanes>
struct LanesPerRow {
    static constexpr int value = kLanes;
};

// Calls body(LanesPerRow<k>()) with the fewest lanes per row k (4, 8, 16
// or 32) that cover a row of head_dim 16-bit elements in 16-byte chunks,
// one chunk a lane (rows past 256 elements: several a lane).
template <typename Body>
__device__ __forceinline__ void with_lanes_per_row(int head_dim, Body&& body) {
    const int chunks = head_dim / 8;
    if (chunks <= 4) {
        body(LanesPerRow<4>());
    } else if (chunks <= 8) {
        body(LanesPerRow<8>());
    } else if (chunks <= 16) {
        body(LanesPerRow<16>());
    } else {
        body(LanesPerRow<32>());
    }
}

// delta = rowsum(dO * O); also zeroes the row's dQ accumulator where the
// dK/dV kernel adds every tile into it (dq_block_m == 0), and the dQ
// counters, which saves separate memset passes. 16-bit rows in whole
// 16-byte chunks take one chunk a lane and several rows a warp (one warp a
// row, two elements a lane, read the bandwidth at ~60% at head dims 64-128:
// 120-154 us against cuDNN's 91-96 on the FlashAttention-2 grid,
// docs/perf-notes.md); other rows one warp.
template <typename Element, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_preprocess_kernel(const BackwardParams params) {
    const int head_dim = params.size.head_dim_int();
    const bool zero_accumulator = params.dq_accum != nullptr && params.dq_block_m == 0;
    if (params.dq_semaphore != nullptr) {
        const index_t counters = params.size.batch * params.size.nheads * params.num_m_blocks;
        for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < counters;
             i += static_cast<index_t>(gridDim.x) * blockDim.x) {
            params.dq_semaphore[i] = 0;
        }
    }
    if constexpr (sizeof(Element) == 2) {
        if (rows_in_chunks<Element>(params.out, head_dim) && rows_in_chunks<Element>(params.dout, head_dim)) {
            with_lanes_per_row(head_dim, [&](auto lanes) {
                constexpr int kLanesPerRow = decltype(lanes)::value;
                for_each_query_row<kLanesPerRow, kWarps>(params.size, [&](index_t r, const QueryRow& q, int sub,
                                                                         bool valid) {
                    const uint4* o =
                        reinterpret_cast<const uint4*>(params.out.row_ptr<const Element>(q.batch, q.head, q.row));
                    const uint4* dout =
                        reinterpret_cast<const uint4*>(params.dout.row_ptr<const Element>(q.batch, q.head, q.row));
                    float sum = 0.0f;
                    for (int c = sub; c < head_dim / 8; c += kLanesPerRow) {
                        sum = dot_chunk<Element>(o[c], dout[c], sum);
                    }
                    sum = group_allreduce_sum<kLanesPerRow>(sum);
                    if (!valid) {
                        return;
                    }
                    if (sub == 0) {
                        params.delta_row(q.batch, q.head)[q.row] = sum;
                    }
                    if (zero_accumulator) {  // rows of a multiple of 8 floats: 32-byte aligned
                        float4* acc = reinterpret_cast<float4*>(params.dq_accum + r * head_dim);
                        for (int c = sub; c < head_dim / 4; c += kLanesPerRow) {
                            acc[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        }
                    }
                });
            });
            return;
        }
    }
    for_each_query_row<32, kWarps>(params.size, [&](index_t r, const QueryRow& q, int lane, bool valid) {
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
        if (zero_accumulator) {
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

// Whether query row q's dQ accumulator holds its dQ: always where it was
// zeroed; where the dK/dV kernel stores each block's first tile
// (dq_block_m > 0), only if a tile reached the row's block (its counter is
// not 0, ordered_accumulation.cuh). A block no tile reached (no key sees
// its rows) was never written, and its dQ is 0.
__device__ __forceinline__ bool dq_accumulated(const BackwardParams& params, const QueryRow& q) {
    if (params.dq_block_m == 0) {
        return true;
    }
    // 32-bit division: a row index and a block size fit (a 64-bit one is a subroutine).
    const int m_block = static_cast<int>(q.row) / static_cast<int>(params.dq_block_m);
    return *params.dq_counter(q.batch, q.head, m_block) != 0;
}

// dq (input dtype, any strides) = the float32 accumulator, already scaled
// (0 where it was never written, dq_accumulated); rows in whole 16-byte
// chunks a chunk a lane, others one warp a row.
template <typename Element, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_convert_dq_kernel(const BackwardParams params) {
    const int head_dim = params.size.head_dim_int();
    if constexpr (sizeof(Element) == 2) {
        if (rows_in_chunks<Element>(params.dq, head_dim)) {
            with_lanes_per_row(head_dim, [&](auto lanes) {
                constexpr int kLanesPerRow = decltype(lanes)::value;
                for_each_query_row<kLanesPerRow, kWarps>(params.size, [&](index_t r, const QueryRow& q, int sub,
                                                                         bool valid) {
                    if (!valid) {
                        return;
                    }
                    uint4* dq = reinterpret_cast<uint4*>(params.dq.row_ptr<Element>(q.batch, q.head, q.row));
                    if (!dq_accumulated(params, q)) {
                        for (int c = sub; c < head_dim / 8; c += kLanesPerRow) {
                            dq[c] = make_uint4(0u, 0u, 0u, 0u);  // +0 in either 16-bit type
                        }
                        return;
                    }
                    const float4* acc = reinterpret_cast<const float4*>(params.dq_accum + r * head_dim);
                    for (int c = sub; c < head_dim / 8; c += kLanesPerRow) {
                        const float4 lo = acc[2 * c], hi = acc[2 * c + 1];
                        dq[c] = make_uint4(pack_pair<Element>(lo.x, lo.y), pack_pair<Element>(lo.z, lo.w),
                                           pack_pair<Element>(hi.x, hi.y), pack_pair<Element>(hi.z, hi.w));
                    }
                });
            });
            return;
        }
    }
    for_each_query_row<32, kWarps>(params.size, [&](index_t r, const QueryRow& q, int lane, bool valid) {
        if (!valid) {
            return;
        }
        Element* dq = params.dq.row_ptr<Element>(q.batch, q.head, q.row);
        if (!dq_accumulated(params, q)) {
            for (int c = lane; c < head_dim; c += 32) {
                dq[c] = from_float<Element>(0.0f);
            }
            return;
        }
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
