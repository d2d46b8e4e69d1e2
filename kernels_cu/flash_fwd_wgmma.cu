// FlashAttention forward on Hopper's warpgroup tensor cores (wgmma, sm_90a;
// float16, bfloat16).
//
// One thread block per (query block, head, batch); each warpgroup (128
// threads) owns 64 query rows. S = Q K^T reads Q and K straight from
// swizzled shared memory (wgmma.mma_async, both operands from
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
#include "block_info.cuh"
#include "tensor_core_traits.cuh"
#include "async_copy.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "online_softmax.cuh"
#include "forward_epilogue.cuh"

namespace cuflash {

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          int kBlocksPerSm>
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
    const QueryBlock origin = query_block<Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM);
    const BlockContext<Mask, Score> ctx(params, origin.batch);

    const int thread = threadIdx.x;
    const int warp = thread / 32;
    const int lane = thread % 32;
    const int warpgroup = warp / 4;
    const int m_start = origin.m_start;
    const int warp_row0 = warp * 16;  // a warp's 16 accumulator rows: warpgroup * 64 + (warp % 4) * 16
    const int warp_row = m_start + warp_row0;

    const Element* q = params.q.row_ptr<const Element>(origin.batch, origin.head, m_start);
    const Element* k = DenseKvSource::rows<Element>(params.k, origin.batch, origin.kv_head, 0);
    const Element* v = DenseKvSource::rows<Element>(params.v, origin.batch, origin.kv_head, 0);
    // Key blocks [first_block, first_block + n_blocks), visited last to first.
    const BlockRange key_range = ctx.mask.key_blocks(m_start, kBlockM, kBlockN);
    const int first_block = key_range.begin;
    const int n_blocks = key_range.end - first_block;

    // Copies key block n_block of K or V (`rows`, from the head's first key) into the buffer at `buffer`.
    const auto load_key_block = [&](u32 buffer, const Element* rows, index_t row_stride, int n_block) {
        const int n_start = n_block * kBlockN;
        load_swizzled_tile_async<KvTile, Traits::kThreads>(buffer, rows + static_cast<index_t>(n_start) * row_stride,
                                                           row_stride, ctx.seqlen_k - n_start, ctx.head_dim, thread);
    };
    // A block whose rows see no key (causal, seqlen_q > seqlen_k) loads
    // nothing, issues no wgmma and writes zeros and -inf.
    if (n_blocks > 0) {
        load_swizzled_tile_async<QTile, Traits::kThreads>(q_smem, q, params.q.row_stride, ctx.seqlen_q - m_start,
                                                          ctx.head_dim, thread);
        load_key_block(k_smem, k, params.k.row_stride, key_range.end - 1);
    }
    cp_async_commit();

    // Descriptors (wgmma.cuh): K-major Q (this warpgroup's 64 rows) and K,
    // MN-major V; k16 steps by kmajor_k_step and mn_major_k_step.
    const u64 q_descriptor = kmajor_descriptor<QTile>(base, Traits::kQ + warpgroup * 64 * QTile::kSwizzleBytes);
    const u64 k_descriptor = kmajor_descriptor<KvTile>(base, Traits::kK);
    const u64 v_descriptor = mn_major_descriptor<KvTile>(base, Traits::kV);
    constexpr u64 kBufferStep = KvTile::kBytes >> 4;  // the second K or V buffer, in descriptor units

    float o[1][kDTiles][4];
    fill_fragments(o, 0.0f);
    float(&o_flat)[kHeadDim / 2] = reinterpret_cast<float(&)[kHeadDim / 2]>(o);
    u32 p[Traits::kPvSteps][4];  // the previous key block's P, the A operand of its P V
    FragmentOnlineSoftmax<1> softmax;
    softmax.init();

    for (int i = 0; i < n_blocks; ++i) {
        const int n_block = key_range.end - 1 - i;
        const int n_start = n_block * kBlockN;
        const int stage = i & 1;  // buffer of K_i and V_i; K_{i+1} and V_{i-1} are in the other
        // K_i and V_{i-1} have landed for every thread, published to the
        // tensor cores; every warpgroup is done with S_{i-1} and P_{i-2} V_{i-2},
        // so K_{i+1} and V_i may overwrite their buffers.
        cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();
        if (n_block > first_block) {
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
                Wgmma<Element, kHeadDim>::rs(o_flat, p[ps], v_descriptor + (stage ^ 1) * kBufferStep + mn_major_k_step<KvTile>(ps),
                                             1);
            }
            wgmma_commit();
            wgmma_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
        } else {
            wgmma_wait<0>();
        }
        pin_registers(s_flat);

        apply_score_transform(ctx.score, s, warp_row, n_start, lane);
        if (key_block_needs_mask(ctx.mask, warp_row, 16, n_start, kBlockN)) {
            apply_mask_to_fragments(ctx.mask, s, warp_row, n_start, lane);
        }
        float rescale[2];
        softmax.update(s, ctx.scale_log2, rescale);

        wgmma_wait<0>();  // P_{i-1} V_{i-1} has landed in O
        pin_registers(o_flat);
        scale_fragment_rows(o, rescale);
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
            Wgmma<Element, kHeadDim>::rs(o_flat, p[ps], v_descriptor + stage * kBufferStep + mn_major_k_step<KvTile>(ps), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(o_flat);
    }

    // Epilogue. Every wgmma reading Q finished before the barrier above, so
    // each warp stages its normalised output rows in its own rows of the Q
    // tile (same swizzle: conflict-free) and stores them 16 bytes at a time.
    const QueryBlock block = query_block<Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM);
    const int first_row = block.m_start;
    unsigned char* const q_tile = smem + Traits::kQ;
    finish_forward_rows<Element>(
        softmax, o, params.lse_row(block.batch, block.head), first_row, warp_row0, ctx.seqlen_q, lane,
        [&](int row_in_block, int dt, u32 packed) {
            *reinterpret_cast<u32*>(q_tile + QTile::chunk_offset(row_in_block, dt) + 4 * (lane % 4)) = packed;
        });
    __syncwarp();
    store_warp_rows<QTile>(params.out.row_ptr<Element>(block.batch, block.head, first_row), params.out.row_stride,
                           q_tile, warp_row0, ctx.seqlen_q - first_row, ctx.head_dim, lane);
#else
    // Built only for sm_90a (the launcher picks this kernel on compute capability 9.0 alone).
    __trap();
#endif
}

}  // namespace cuflash
