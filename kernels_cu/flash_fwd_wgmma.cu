// FlashAttention forward on Hopper's warpgroup tensor cores (wgmma, sm_90a;
// float16, bfloat16).
//
// One thread block per (query block, head, batch); each warpgroup (128
// threads) owns 64 query rows. S = Q K^T reads Q and K straight from
// 128-byte swizzled shared memory (wgmma.mma_async, both operands from
// shared memory); O += P V takes P from registers, where the softmax left
// it, and V from shared memory, transposed by the instruction. The tensor
// cores run asynchronously to the issuing threads, which the schedule uses:
//
//   block i:  S_i = Q K_i^T  and  O += P_{i-1} V_{i-1}  are issued together;
//             the softmax of S_i runs while P_{i-1} V_{i-1} is still in the
//             tensor cores; O is rescaled once that product has landed.
//
// K and V are double-buffered and copied with cp.async one block ahead: at
// the top of block i, after one barrier, K_{i+1} and V_i are requested (V_i is
// first needed at block i + 1). Key blocks are visited from the last to the
// first, so the blocks that need masking (the partial last block, the causal
// diagonal) come first. The online softmax, masking and P packing are those
// of the mma.sync kernel (flash_fwd_mma.cu): a warp's wgmma accumulators have
// exactly the layout of one m16 row of mma fragments (see wgmma.cuh).
#include "numeric.cuh"
#include "params.cuh"
#include "grid.cuh"
#include "kernel_traits.cuh"
#include "async_copy.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "masking.cuh"
#include "online_softmax.cuh"

namespace cuflash {

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, bool kIsCausal, int kBlocksPerSm>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
flash_forward_wgmma_kernel(const ForwardParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Traits = WgmmaForwardTraits<Element, kHeadDim, kBlockM, kBlockN, kWarps>;
    using QTile = typename Traits::QTile;
    using KvTile = typename Traits::KvTile;
    constexpr int kNTiles = Traits::kNTiles;
    constexpr int kDTiles = Traits::kDTiles;

    require_shared_memory<Traits>();
    unsigned char* smem;
    const u32 base = aligned_shared_base<Traits::kAlignment>(smem);
    const u32 q_smem = base + Traits::kQ;
    const u32 k_smem = base + Traits::kK;
    const u32 v_smem = base + Traits::kV;

    // This block's query tile, computed again for the epilogue (see
    // block_index) so that it holds no registers through the main loop.
    const auto tile_origin = [&]() {
        return query_tile_origin<kIsCausal>(params.num_m_blocks, params.size.nheads, kBlockM);  // .tile: first row
    };
    const BlockCoordinates origin = tile_origin();
    const index_t kv_head = params.size.kv_head_of(origin.head);

    const int seqlen_q = params.size.seqlen_q_int();
    const int seqlen_k = params.size.seqlen_k_int();
    const int head_dim = params.size.head_dim_int();
    const float scale_log2 = static_cast<float>(params.softmax_scale_log2);

    const int thread = threadIdx.x;
    const int warp = thread / 32;
    const int lane = thread % 32;
    const int warpgroup = warp / 4;
    const int m_start = origin.tile;
    const int warp_row0 = warp * 16;  // a warp's 16 accumulator rows: warpgroup * 64 + (warp % 4) * 16

    const Element* q = params.q.row_ptr<const Element>(origin.batch, origin.head, m_start);
    const Element* k = params.k.row_ptr<const Element>(origin.batch, kv_head, 0);
    const Element* v = params.v.row_ptr<const Element>(origin.batch, kv_head, 0);
    const int n_blocks = visible_key_blocks<kIsCausal>(m_start, kBlockM, kBlockN, seqlen_q, seqlen_k);
    // Last key the warp's first row sees.
    const int warp_row_diagonal = m_start + warp_row0 + causal_diagonal_offset(seqlen_q, seqlen_k);

    // Copies key block n_block of K or V (`rows`, from the head's first key) into the buffer at `buffer`.
    const auto load_key_block = [&](u32 buffer, const Element* rows, index_t row_stride, int n_block) {
        const int n_start = n_block * kBlockN;
        load_swizzled_tile_async<KvTile, Traits::kThreads>(buffer, rows + static_cast<index_t>(n_start) * row_stride,
                                                           row_stride, seqlen_k - n_start, head_dim, thread);
    };
    // A block whose rows see no key (causal, seqlen_q > seqlen_k) loads
    // nothing, issues no wgmma and writes zeros and -inf.
    if (n_blocks > 0) {
        load_swizzled_tile_async<QTile, Traits::kThreads>(q_smem, q, params.q.row_stride, seqlen_q - m_start,
                                                          head_dim, thread);
        load_key_block(k_smem, k, params.k.row_stride, n_blocks - 1);
    }
    cp_async_commit();

    // Descriptors (wgmma.cuh): K-major Q and K, MN-major V; k16 steps by
    // kmajor_k_step and kMnMajorKStep.
    const u64 q_descriptor = swizzled_descriptor(q_smem + warpgroup * 64 * 128, 16, 1024);
    const u64 k_descriptor = swizzled_descriptor(k_smem, 16, 1024);
    const u64 v_descriptor = swizzled_descriptor(v_smem, KvTile::kPanelBytes, 1024);
    constexpr u64 kBufferStep = KvTile::kBytes >> 4;  // the second K or V buffer, in descriptor units

    float o[1][kDTiles][4];
    fill_fragments(o, 0.0f);
    float(&o_flat)[kHeadDim / 2] = reinterpret_cast<float(&)[kHeadDim / 2]>(o);
    u32 p[Traits::kPvSteps][4];  // the previous key block's P, the A operand of its P V
    FragmentOnlineSoftmax<1> softmax;
    softmax.init();

    for (int i = 0; i < n_blocks; ++i) {
        const int n_block = n_blocks - 1 - i;
        const int n_start = n_block * kBlockN;
        const int stage = i & 1;  // buffer of K_i and V_i; K_{i+1} and V_{i-1} are in the other
        // K_i and V_{i-1} have landed for every thread, published to the
        // tensor cores; every warpgroup is done with S_{i-1} and P_{i-2} V_{i-2},
        // so K_{i+1} and V_i may overwrite their buffers.
        cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();
        if (n_block > 0) {
            load_key_block(k_smem + (stage ^ 1) * KvTile::kBytes, k, params.k.row_stride, n_block - 1);
        }
        load_key_block(v_smem + stage * KvTile::kBytes, v, params.v.row_stride, n_block);
        cp_async_commit();

        float s[1][kNTiles][4];
        float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
        wgmma_fence();  // P and the rescaled O were written by this thread since the last wgmma
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            Wgmma<Element, kBlockN>::ss(s_flat, q_descriptor + kmajor_k_step<QTile>(ks),
                                        k_descriptor + stage * kBufferStep + kmajor_k_step<KvTile>(ks),
                                        ks > 0);
        }
        wgmma_commit();
        if (i > 0) {
#pragma unroll
            for (int ps = 0; ps < Traits::kPvSteps; ++ps) {
                Wgmma<Element, kHeadDim>::rs(o_flat, p[ps], v_descriptor + (stage ^ 1) * kBufferStep + ps * kMnMajorKStep,
                                             1);
            }
            wgmma_commit();
            wgmma_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
        } else {
            wgmma_wait<0>();
        }
        pin_registers(s_flat);

        if (key_block_needs_mask<kIsCausal>(warp_row_diagonal, n_start, kBlockN, seqlen_k)) {
            apply_mask_to_fragments<kIsCausal>(s, warp_row_diagonal, n_start, lane, seqlen_k);
        }
        float rescale[2];
        softmax.update(s, scale_log2, rescale);

        wgmma_wait<0>();  // P_{i-1} V_{i-1} has landed in O
        pin_registers(o_flat);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                o[0][dt][e] *= rescale[e / 2];
            }
        }
        // P rounded to the element type (its float32 row sums were taken before rounding).
#pragma unroll
        for (int ps = 0; ps < Traits::kPvSteps; ++ps) {
            pack_a_fragment<Element>(p[ps], s[0][2 * ps], s[0][2 * ps + 1]);
        }
    }
    if (n_blocks > 0) {
        // The last block's P V, once its V has landed.
        cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();
        const int stage = (n_blocks - 1) & 1;
        wgmma_fence();
#pragma unroll
        for (int ps = 0; ps < Traits::kPvSteps; ++ps) {
            Wgmma<Element, kHeadDim>::rs(o_flat, p[ps], v_descriptor + stage * kBufferStep + ps * kMnMajorKStep, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(o_flat);
    }

    // Epilogue. Every wgmma reading Q finished before the barrier above, so
    // each warp stages its normalised output rows in its own rows of the Q
    // tile (same swizzle: conflict-free) and stores them 16 bytes at a time.
    const int group = lane / 4, quad = lane % 4;
    const BlockCoordinates block = tile_origin();
    const int first_row = block.tile;
    float* lse_row = params.lse + block.batch * params.lse_batch_stride + block.head * params.lse_head_stride;
    unsigned char* const q_tile = smem + Traits::kQ;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float sum = softmax.row_sum(half);
        // A row that saw no key has sum 0: its output is 0, not 0 / 0.
        const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row_in_block = warp_row0 + half * 8 + group;
        if (quad == 0 && first_row + row_in_block < seqlen_q) {
            lse_row[first_row + row_in_block] = softmax.log_sum_exp(half, sum);
        }
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
            *reinterpret_cast<u32*>(q_tile + QTile::chunk_offset(row_in_block, dt) + 4 * quad) =
                pack_pair<Element>(o[0][dt][2 * half] * inv_sum, o[0][dt][2 * half + 1] * inv_sum);
        }
    }
    __syncwarp();
    store_warp_rows<QTile>(params.out.row_ptr<Element>(block.batch, block.head, first_row), params.out.row_stride,
                           q_tile, warp_row0, seqlen_q - first_row, head_dim, lane);
#else
    // Built only for sm_90a (the launcher picks this kernel on compute capability 9.0 alone).
    __trap();
#endif
}

}  // namespace cuflash
