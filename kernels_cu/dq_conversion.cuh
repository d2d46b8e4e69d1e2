// The float32 dQ accumulator (params.cuh's dq_accum) turned into dq, in the
// input dtype and dq's strides: by the conversion kernel after a dK/dV pass
// (flash_bwd_elementwise.cu), or, in the Hopper dK/dV kernel's converted dQ
// mode (flash_bwd_wgmma.cu), by the key block whose addition completed a
// query block, for that block's rows.
#pragma once

#include "numeric.cuh"
#include "params.cuh"

namespace cuflash {

// Whether every row of `t` starts on a 16-byte boundary (whole chunks of 8
// 16-bit elements): the pointer and every stride. Uniform over the grid.
template <typename Element>
__device__ __forceinline__ bool rows_in_chunks(const TensorRef& t, int head_dim) {
    static_assert(sizeof(Element) == 2, "chunks of 8 16-bit elements");
    return head_dim % 8 == 0 && reinterpret_cast<unsigned long long>(t.ptr) % 16 == 0 && t.batch_stride % 8 == 0 &&
           t.row_stride % 8 == 0 && t.head_stride % 8 == 0;
}

// Eight float32 values (two float4) rounded to one 16-byte chunk of 16-bit elements.
template <typename Element>
__device__ __forceinline__ uint4 dq_chunk(const float4& lo, const float4& hi) {
    return make_uint4(pack_pair<Element>(lo.x, lo.y), pack_pair<Element>(lo.z, lo.w), pack_pair<Element>(hi.x, hi.y),
                      pack_pair<Element>(hi.z, hi.w));
}

// dq = the accumulator for `rows` rows from `row0` of (batch, head) of the
// tensors, whose rows are whole 16-byte chunks (rows_in_chunks), by
// `threads` threads of which the caller is `thread`, a chunk a thread at a
// time. The accumulator is read from L2 (ld.global.cg): the copy engines of
// other blocks added into it, and this SM's L1 may hold none of it.
template <typename Element>
__device__ __forceinline__ void convert_dq_rows_in_chunks(const BackwardParams& params, index_t batch, index_t head,
                                                          int row0, int rows, int head_dim, int thread, int threads) {
    const int chunks = head_dim / 8;
    for (int i = thread; i < rows * chunks; i += threads) {
        const int row = row0 + i / chunks, c = i % chunks;
        const float4* acc = reinterpret_cast<const float4*>(params.dq_accum_row(batch, head, row, head_dim));
        reinterpret_cast<uint4*>(params.dq.row_ptr<Element>(batch, head, row))[c] =
            dq_chunk<Element>(__ldcg(acc + 2 * c), __ldcg(acc + 2 * c + 1));
    }
}

}  // namespace cuflash
