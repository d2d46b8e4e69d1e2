// Launch parameters, passed to the kernels by value as one struct.
//
// The Python side builds the same struct as a NumPy structured dtype with
// aligned fields (cuflash/_params.py). Every field is 8 bytes wide, so the
// layout has no padding and cannot differ between the compilers; the
// static_asserts below pin it, and the Python side checks the same size.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Strides are in elements, not bytes. Tensor layouts (batch, seqlen, heads, dim)
// with the last dimension contiguous; LSE is (batch, heads, seqlen_q) float32.
struct ForwardParams {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;

    index_t q_batch_stride, q_row_stride, q_head_stride;
    index_t k_batch_stride, k_row_stride, k_head_stride;
    index_t v_batch_stride, v_row_stride, v_head_stride;
    index_t out_batch_stride, out_row_stride, out_head_stride;
    index_t lse_batch_stride, lse_head_stride;

    index_t batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim;
    index_t num_m_blocks;  // ceil(seqlen_q / kBlockM): the grid is flattened over it

    double softmax_scale_log2;  // softmax_scale * log2(e), see numeric.cuh
};

static_assert(sizeof(ForwardParams) == 27 * 8, "ForwardParams layout must match cuflash/_params.py");

}  // namespace cuflash
