"""The IO simulator (CPU): hand-counted small cases, Theorem 2's scaling, the
FlashAttention paper's Figure 2, and agreement with cuflash's own tiling."""

import numpy as np
import pytest

from cuflash._kernel_families import select
from cuflash._tiling import backward_tiling
from cuflash.reference import attention_backward_tiled, attention_tiled
from cuflash.simulate import ALGORITHMS, MACHINES, Problem, key_sweep, query_sweep, run, summarize

A100 = MACHINES["a100"]

# Hand counts: one head, N = 256, d = 64, 2-byte elements, 64 x 64 blocks.
# Sizes: an N x d tensor (Q, K, V, O, dO, dQ, dK, dV) is 256*64*2 = 32768 bytes;
# an N x N one (S, P, dP, dS) 256*256*2 = 131072; an N-vector of float32 1024;
# a 64 x 64 tile of the N x d tensors 8192; a 64-row slice of a float32 vector 256.
ND, NN, VEC, TILE, ROWS = 32768, 131072, 1024, 8192, 256
HAND_COUNTS = {
    # Algorithm 0: Q, K read; S written; S read, P written; P, V read, O written.
    ("standard", "fwd"): 4 * ND + 4 * NN,
    # dV = P^T dO; dP = dO V^T; dS from P, dP; dQ = dS K; dK = dS^T Q:
    # N x N: P, dP(w), P, dP, dS(w), dS, dS; N x d: dO, dV(w), dO, V, K, dQ(w), Q, dK(w).
    ("standard", "bwd"): 7 * NN + 8 * ND,
    # no mask, no dropout: the same ops as Algorithm 0
    ("pytorch", "fwd"): 4 * ND + 4 * NN,
    ("pytorch", "bwd"): 7 * NN + 8 * ND,
    # init O, l, m; K, V once; 16 (i, j) pairs each read Q_i, O_i, l_i, m_i and write O_i, l_i, m_i
    ("flash1", "fwd"): (ND + 2 * VEC) + 2 * ND + 16 * (2 * TILE + 2 * ROWS) + 16 * (TILE + 2 * ROWS),
    # init dQ, dK, dV; K, V once; 16 pairs read Q, O, dO, dQ tiles and l, m, write dQ; write dK, dV
    ("flash1", "bwd"): 3 * ND + 2 * ND + 16 * (4 * TILE + 2 * ROWS) + 16 * TILE + 2 * ND,
    # Q once; each of 4 query blocks reads all 256 keys of K and V; O once; LSE once
    ("flash2", "fwd"): ND + 2 * 4 * ND + ND + VEC,
    # preprocess: O, dO read, D written, accumulator (float32) zeroed; K, V once; 4 key blocks read all
    # 256 rows of Q, dO (2-byte) and LSE, D (float32) and add into the accumulator; dK, dV written;
    # conversion reads the accumulator and writes dQ
    ("flash2", "bwd"): 2 * ND + VEC + 2 * ND + 2 * ND + 4 * (2 * ND + 2 * VEC) + 4 * 2 * ND + 2 * ND + 2 * ND + ND,
    # cuflash fp16 d=64: tensor-core forward tiles 128 x 64, 2 query blocks read all 256 keys
    ("cuflash", "fwd"): ND + 2 * 2 * ND + ND + VEC,
    # backward tiles 64 x 128 (mma.sync on the A100): 2 key blocks, each reads all 256 rows
    ("cuflash", "bwd"): 2 * ND + VEC + 2 * ND + 2 * ND + 2 * (2 * ND + 2 * VEC) + 2 * 2 * ND + 2 * ND + 2 * ND + ND,
}


@pytest.mark.parametrize("algorithm,passes", sorted(HAND_COUNTS))
def test_hand_counted_small_case(algorithm, passes):
    problem = Problem(batch=1, nheads=1, seqlen_q=256, head_dim=64, element_size=2)
    blocks = {} if algorithm == "cuflash" else {"block_m": 64, "block_n": 64}
    traffic = run(algorithm, problem, A100, passes, **blocks)
    assert traffic.total("requested") == HAND_COUNTS[(algorithm, passes)]


def test_fwd_plus_bwd_is_the_sum():
    problem = Problem(batch=2, nheads=4, seqlen_q=300, seqlen_k=200, head_dim=72, causal=True)
    for name in ALGORITHMS:
        both = run(name, problem, A100, "fwd+bwd").total("requested")
        assert both == run(name, problem, A100, "fwd").total("requested") + run(name, problem, A100, "bwd").total("requested")


def test_requested_traffic_scales_with_batch_times_heads():
    # At a fixed split count: flash-decoding's own choice depends on the grid's size.
    for name in ALGORITHMS:
        one = run(name, Problem(batch=1, nheads=1, seqlen_q=777, head_dim=64, num_splits=1), A100).total("requested")
        many = run(name, Problem(batch=3, nheads=5, seqlen_q=777, head_dim=64, num_splits=1), A100).total("requested")
        assert many == 15 * one


def test_standard_is_nd_plus_n_squared_exactly():
    """Theorem 2: standard attention moves Theta(Nd + N^2); forward 4Nd + 4N^2 elements."""
    for n in (1000, 2048, 16384):
        traffic = run("standard", Problem(batch=1, nheads=1, seqlen_q=n, head_dim=64, element_size=1), A100, "fwd")
        assert traffic.total("requested") == 4 * n * 64 + 4 * n * n


def _flash_forward(n, sram, algorithm="flash1"):
    problem = Problem(batch=1, nheads=1, seqlen_q=n, head_dim=64, element_size=2)
    return run(algorithm, problem, A100.with_sram(sram), "fwd").total("requested")


def test_flash_traffic_halves_when_sram_doubles():
    """Theorem 2: FlashAttention moves Theta(N^2 d^2 / M)."""
    n = 16384
    for sram in (48 * 1024, 96 * 1024, 192 * 1024):
        ratio = _flash_forward(n, sram) / _flash_forward(n, 2 * sram)
        assert ratio == pytest.approx(2.0, rel=0.10)


def test_flash_traffic_quadruples_when_n_doubles():
    for n in (4096, 8192, 16384):
        ratio = _flash_forward(2 * n, 192 * 1024) / _flash_forward(n, 192 * 1024)
        assert ratio == pytest.approx(4.0, rel=0.10)


FIGURE2 = dict(batch=64, nheads=16, seqlen_q=1024, head_dim=64, element_size=2, key_padding_mask=True)


def test_figure2_pytorch_pipeline_traffic():
    """Paper, Figure 2 (A100): 35.3 GB for the unfused pipeline (key-padding mask, no dropout)."""
    traffic = run("pytorch", Problem(**FIGURE2), A100, "fwd+bwd")
    assert traffic.total("dram") / 1e9 == pytest.approx(35.3, rel=0.15)


def test_figure2_pytorch_pipeline_traffic_with_dropout():
    """The paper's earlier version: 40.3 GB with dropout."""
    traffic = run("pytorch", Problem(**FIGURE2, dropout=True), A100, "fwd+bwd")
    assert traffic.total("dram") / 1e9 == pytest.approx(40.3, rel=0.15)


def test_figure2_flash_attention_traffic():
    """Paper, Figure 2: 4.4 GB for FlashAttention."""
    traffic = run("flash1", Problem(**FIGURE2), A100, "fwd+bwd")
    assert traffic.total("dram") / 1e9 == pytest.approx(4.4, rel=0.30)
    assert traffic.total("requested") > traffic.total("dram")  # some re-reads hit in L2


def test_figure2_recomputation_flop_ratio():
    """Paper, Figure 2: 75.2 / 66.6 GFLOPs: recomputation costs ~13% more FLOPs."""
    standard = run("pytorch", Problem(**FIGURE2), A100, "fwd+bwd")
    flash = run("flash1", Problem(**FIGURE2), A100, "fwd+bwd")
    ratio = (flash.matmul_flops + flash.other_flops) / (standard.matmul_flops + standard.other_flops)
    assert ratio == pytest.approx(75.2 / 66.6, abs=0.05)


def test_flash_beats_standard_by_the_papers_margin():
    problem = Problem(**FIGURE2)
    standard = run("pytorch", problem, A100).total("dram")
    for name in ("flash1", "flash2", "cuflash"):
        assert run(name, problem, A100).total("dram") < standard / 5


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(256, 256, False), (300, 200, True), (1000, 17, True), (17, 1000, False)])
@pytest.mark.parametrize("head_dim", [64, 100, 256])
def test_cuflash_matches_the_kernels_tiling(seqlen_q, seqlen_k, causal, head_dim):
    """cuflash's simulated K/V reads walk the same tiles as the NumPy emulation
    of the kernels, read from the same tables."""
    problem = Problem(batch=1, nheads=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal)
    fwd = select("forward", "float16", head_dim)
    sweep = query_sweep(problem, fwd.block_m, fwd.block_n)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seqlen_q, 1, head_dim))
    k, v = (rng.standard_normal((1, seqlen_k, 1, head_dim)) for _ in range(2))
    _, _, visited = attention_tiled(q, k, v, causal=causal)
    assert sum(-(-b.keys // fwd.block_n) for b in sweep) == visited
    k_reads = sum(t.requested for t in run("cuflash", problem, A100, "fwd").terms if t.tensor == "K")
    assert k_reads == sum(b.keys for b in sweep) * head_dim * 2

    bwd = backward_tiling("float16", head_dim)
    key_blocks = key_sweep(problem, bwd.block_m, bwd.block_n)
    *_, bwd_visited = attention_backward_tiled(q, q, k, v, causal=causal)
    assert sum(-(-b.rows // bwd.block_m) for b in key_blocks) == bwd_visited


def test_cuflash_deterministic_trades_atomics_for_a_dq_pass():
    problem = Problem(batch=2, nheads=8, nheads_k=2, seqlen_q=2048, head_dim=128, causal=True)
    atomic = summarize(run("cuflash", problem, A100, "bwd"), A100)
    deterministic = summarize(run("cuflash", Problem(**{**problem.__dict__, "deterministic": True}), A100, "bwd"), A100)
    assert "dQ_accum" in atomic["tensors"] and "dQ_accum" not in deterministic["tensors"]
    assert deterministic["matmul_flops"] > atomic["matmul_flops"]  # S and dP computed twice


def test_cuflash_on_hopper_stores_first_dq_tiles_where_the_launcher_does():
    """Causal with seqlen_q >= seqlen_k on Hopper at head dims up to 128 (cuflash.api.stores_first_dq):
    no pass zeroes the float32 dQ accumulator and no zeroed lines come from
    DRAM for the first additions; the same call without a mask, or on an
    A100, adds into zeros. The preprocessing launch moves the accumulator's
    4 x heads x seqlen x head_dim bytes less."""
    from cuflash.simulate.timing import launches

    h100 = MACHINES["h100"]
    causal = Problem(batch=2, nheads=16, seqlen_q=2048, head_dim=128, causal=True)
    full = Problem(**{**causal.__dict__, "causal": False})
    zeroing = {"preprocess zeroes the float32 dQ accumulator",
               "L2 fetches the zeroed accumulator lines for the atomics (no SM request)"}

    def formulas(problem, machine):
        return {term.formula for term in run("cuflash", problem, machine, "bwd").terms}

    assert not zeroing & formulas(causal, h100)
    assert zeroing <= formulas(full, h100) and zeroing <= formulas(causal, A100)
    # Fewer queries than keys: the walks share their first query block, and add into zeros.
    assert zeroing <= formulas(Problem(**{**causal.__dict__, "seqlen_k": 4096}), h100)
    # Head dims whose consumers split it (above 128) add into zeros too (claimed_dq_applies).
    assert zeroing <= formulas(Problem(**{**causal.__dict__, "head_dim": 256}), h100)
    assert not zeroing & formulas(Problem(**{**causal.__dict__, "head_dim": 96}), h100)
    preprocess = {problem.causal: next(launch for launch in launches("cuflash", problem, h100, "bwd")
                                       if launch.name == "cuflash backward preprocess")
                  for problem in (causal, full)}
    assert preprocess[False].dram_bytes - preprocess[True].dram_bytes == 2 * 16 * 2048 * 128 * 4


@pytest.mark.parametrize("deterministic", [False, True])
def test_cuflash_on_hopper_stores_dq_directly_from_one_key_block(deterministic):
    """One key block (128 keys at head dim 64) on Hopper, deterministic or
    not (cuflash.api.stores_dq_directly): dQ is written once, in the input
    dtype, by the dK/dV kernel, which computes D from O too; no float32
    accumulator, no zeroing, no D in memory, no preprocessing or
    conversion launch. With 129 keys, or on an A100, the accumulator, D
    and both launches are back."""
    from cuflash.simulate.timing import launches

    h100 = MACHINES["h100"]
    one_block = Problem(batch=4, nheads=8, seqlen_q=1000, seqlen_k=128, head_dim=64, causal=False,
                        deterministic=deterministic)
    two_blocks = Problem(**{**one_block.__dict__, "seqlen_k": 129})

    def backward(problem, machine):
        return summarize(run("cuflash", problem, machine, "bwd"), machine)

    def launch_names(problem, machine):
        return [launch.name for launch in launches("cuflash", problem, machine, "bwd")]

    direct = backward(one_block, h100)
    assert "dQ_accum" not in direct["tensors"] and "dQ" in direct["tensors"]
    assert any("stores dQ itself" in note for note in run("cuflash", one_block, h100, "bwd").notes)
    assert "D" not in direct["tensors"] and "O" in direct["tensors"]
    assert launch_names(one_block, h100) == ["cuflash backward dK/dV"]
    if not deterministic:  # (an A100's deterministic dQ pass writes dQ once too)
        assert direct["requested_write_bytes"] < backward(one_block, A100)["requested_write_bytes"]
    for problem, machine in ((two_blocks, h100), (one_block, A100)):
        assert "cuflash backward dQ conversion" in launch_names(problem, machine) or deterministic
        assert launch_names(problem, machine)[0] == "cuflash backward preprocess"
        assert "D" in backward(problem, machine)["tensors"]
        assert ("dQ_accum" in backward(problem, machine)["tensors"]) is not deterministic


def test_gqa_reduces_cuflash_backward_traffic_but_not_flash2s_dk_writes():
    mha = Problem(batch=1, nheads=8, seqlen_q=4096, head_dim=64)
    gqa = Problem(batch=1, nheads=8, nheads_k=1, seqlen_q=4096, head_dim=64)
    assert run("cuflash", gqa, A100, "bwd").total("requested") < run("cuflash", mha, A100, "bwd").total("requested")
    flash2 = summarize(run("flash2", gqa, A100, "bwd"), A100)
    assert "dK_expanded" in flash2["tensors"]


def test_summary_fields_and_roofline():
    s = summarize(run("flash2", Problem(**FIGURE2), A100), A100)
    assert s["requested_bytes"] == s["requested_read_bytes"] + s["requested_write_bytes"]
    assert s["dram_bytes"] == s["dram_read_bytes"] + s["dram_write_bytes"]
    assert s["flops"] == s["matmul_flops"] + s["other_flops"]
    assert s["roofline"]["estimate_s"] == max(s["roofline"]["compute_s"], s["roofline"]["memory_s"])
    assert s["intensity_dram"] == pytest.approx(s["flops"] / s["dram_bytes"])


def test_bad_problems_are_rejected():
    with pytest.raises(ValueError, match="nheads .* multiple of nheads_k"):
        Problem(nheads=6, nheads_k=4)
    with pytest.raises(ValueError, match="seqlen_q must be at least 1"):
        Problem(seqlen_q=0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        run("flash3", Problem(), A100)
    with pytest.raises(ValueError, match="pass must be one of"):
        run("flash2", Problem(), A100, "forward")


@pytest.mark.parametrize("algorithm", ["flash2", "cuflash"])
def test_tiled_backward_charges_dram_for_visited_rows_only(algorithm):
    """Causal with seqlen_q >> seqlen_k: only the last query rows see a key,
    so the dK/dV pass reads only their Q, dO and statistics (the DRAM estimate
    once charged every row: 1.86x the requested bytes)."""
    problem = Problem(batch=1, nheads=16, seqlen_q=32768, seqlen_k=1, head_dim=64, causal=True)
    s = summarize(run(algorithm, problem, MACHINES["a100"], "bwd"), MACHINES["a100"])
    q = s["tensors"]["Q"]
    assert q["dram_read"] <= q["read"]
    assert s["dram_bytes"] <= 1.01 * s["requested_bytes"]


@pytest.mark.parametrize("algorithm", ["standard", "pytorch", "flash1", "flash2"])
def test_gqa_gradients_are_summed_per_kv_head(algorithm):
    """Algorithms that broadcast K/V to every query head write dK/dV per
    query head and sum them per K/V head (as flash2 always modelled); with
    one K/V head per query head nothing is summed."""
    e, nk, d = 2, 512, 64
    grouped = run(algorithm, Problem(batch=1, nheads=4, nheads_k=1, seqlen_q=512, head_dim=d), MACHINES["a100"],
                  "bwd")
    by_tensor = {(term.tensor, term.kind): term.requested for term in grouped.terms}
    assert by_tensor[("dK", "write")] == by_tensor[("dV", "write")] == 1 * nk * d * e
    assert by_tensor[("dK_expanded", "read")] == by_tensor[("dV_expanded", "read")] == 4 * nk * d * e
    plain = run(algorithm, Problem(batch=1, nheads=4, seqlen_q=512, head_dim=d), MACHINES["a100"], "bwd")
    assert not any(term.tensor.endswith("_expanded") for term in plain.terms)


def test_cuflash_on_a_99_kib_machine_takes_the_launchers_small_tiles():
    """With SRAM of an sm_86/sm_89 block the simulated cuflash picks what the
    launcher picks there: the mma.sync backward's 99 KiB tiles."""
    from cuflash._tiling import mma_backward_99kib_tiling, mma_backward_tiling

    small = MACHINES["a100"].with_sram(99 * 1024)
    problem = Problem(batch=1, nheads=4, seqlen_q=2048, head_dim=256)
    t = run("cuflash", problem, small, "bwd")
    tiling = mma_backward_99kib_tiling("float16", 256)
    assert (t.blocks["cuflash bwd Br"], t.blocks["cuflash bwd Bc"]) == (tiling.block_m, tiling.block_n)
    a100 = run("cuflash", problem, MACHINES["a100"], "bwd")
    assert a100.blocks["cuflash bwd Bc"] == mma_backward_tiling("float16", 256).block_n != tiling.block_n


# --- decoding and the KV cache (issue 18, build 3) ------------------------------------------------
# One K/V row of head dim 64 in 2-byte elements is 128 bytes; block sizes are pinned (64 x 128).
ROW = 64 * 2


def _decode(**fields):
    base = dict(batch=1, nheads=2, seqlen_q=1, seqlen_k=1000, head_dim=64)
    return Problem(**{**base, **fields})


def test_split_kv_reads_k_v_once_and_q_once_per_split():
    t = run("flash2", _decode(num_splits=4), A100, "fwd", block_m=64, block_n=128).by_tensor()
    # 1000 keys = 8 blocks of 128: 2 per split (256, 256, 256, 232 keys)
    assert t["K"]["read"] == t["V"]["read"] == 2 * 1000 * ROW
    assert t["Q"]["read"] == 2 * 4 * ROW
    # each split's O row in float32 and its LSE, written and read back by the merge
    assert t["O_partial"]["write"] == t["O_partial"]["read"] == 2 * 4 * 64 * 4
    assert t["LSE_partial"]["write"] == t["LSE_partial"]["read"] == 2 * 4 * 4
    assert t["O"]["write"] == 2 * ROW and t["LSE"]["write"] == 2 * 4
    unsplit = run("flash2", _decode(num_splits=1), A100, "fwd", block_m=64, block_n=128).by_tensor()
    assert "O_partial" not in unsplit and unsplit["Q"]["read"] == 2 * ROW


def test_splits_beyond_the_key_blocks_still_write_their_partial_results():
    t = run("flash2", _decode(seqlen_k=200, num_splits=4), A100, "fwd", block_m=64, block_n=128).by_tensor()
    assert t["K"]["read"] == 2 * 200 * ROW  # 128 + 72 + 0 + 0 keys
    assert t["O_partial"]["write"] == 2 * 4 * 64 * 4


def test_gqa_packing_reads_k_v_once_per_kv_head():
    problem = dict(nheads=8, nheads_k=2, num_splits=1)
    packed = run("cuflash", _decode(pack_gqa=True, **problem), A100, "fwd").by_tensor()
    unpacked = run("cuflash", _decode(pack_gqa=False, **problem), A100, "fwd").by_tensor()
    assert packed["K"]["read"] == 2 * 1000 * ROW
    assert unpacked["K"]["read"] == 8 * 1000 * ROW
    assert packed["Q"]["read"] == unpacked["Q"]["read"] == 8 * ROW


def test_gqa_packing_with_causal_rows_visits_the_keys_of_the_positions_a_block_covers():
    # 2 query heads per K/V head, 2 query positions, 130 keys (the diagonal offset is 128): one packed block of
    # 4 rows covers positions 0 and 1, whose last sees key 129, so it visits all 130 keys once per K/V head.
    problem = Problem(batch=1, nheads=2, nheads_k=1, seqlen_q=2, seqlen_k=130, head_dim=64, causal=True)
    packed = run("flash2", Problem(**{**problem.__dict__, "pack_gqa": True}), A100, "fwd", 64, 64).by_tensor()
    plain = run("flash2", Problem(**{**problem.__dict__, "pack_gqa": False}), A100, "fwd", 64, 64).by_tensor()
    assert packed["K"]["read"] == 130 * ROW
    assert plain["K"]["read"] == 2 * 130 * ROW


def test_paged_reads_add_the_page_numbers_of_the_pages_each_block_spans():
    for page_size, splits, pages in ((16, 1, 63), (16, 4, 63), (100, 1, 10), (100, 4, 3 + 4 + 3 + 3)):
        t = run("flash2", _decode(page_size=page_size, num_splits=splits), A100, "fwd", 64, 128).by_tensor()
        assert t["block_table"]["read"] == 2 * pages * 4, (page_size, splits)
        contiguous = run("flash2", _decode(num_splits=splits), A100, "fwd", 64, 128).by_tensor()
        assert t["K"] == contiguous["K"]


def test_appending_reads_the_new_tokens_and_writes_them_into_the_cache():
    t = run("cuflash", _decode(nheads=4, nheads_k=2, seqlen_q=3, append=True), A100, "fwd").by_tensor()
    assert t["K_new"]["read"] == t["V_new"]["read"] == 2 * 3 * ROW
    assert t["K"]["write"] == t["V"]["write"] == 2 * 3 * ROW
    with pytest.raises(ValueError, match="seqlen_k .* must be at least seqlen_q"):
        Problem(seqlen_q=8, seqlen_k=4, append=True)


@pytest.mark.parametrize("fields,message", [
    ({"page_size": 0}, "page_size must be at least 1, got 0"),
    ({"num_splits": 0}, "num_splits must be a whole number of at least 1 or 'auto', got 0"),
    ({"num_splits": "many"}, "got 'many'"),
])
def test_decode_options_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        Problem(**fields)


def test_wave_efficient_splits():
    from cuflash.simulate.algorithms import wave_efficient_splits

    assert wave_efficient_splits(200, 132, 64) == 1  # the grid nearly fills the GPU already
    assert wave_efficient_splits(106, 132, 64) == 1  # 80% of the slots
    # 8 blocks, 1024 key blocks: 16 splits fill 97% of a wave (33 would fill 2 waves, but 32 key blocks per
    # split is what 32 splits give too, so it is not a count of its own); 14 is the first within 85% of that.
    assert wave_efficient_splits(8, 132, 1024) == 14
    assert wave_efficient_splits(1, 132, 3) == 3  # no more splits than key blocks


def test_flash_decoding_packs_one_token_queries_and_splits_small_grids():
    problem = Problem(batch=1, nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=131072, head_dim=128)
    blocks = run("flash-decoding", problem, MACHINES["h100"], "fwd").blocks
    assert blocks["flash-decoding packed heads"] == 4 and blocks["flash-decoding splits"] == 14
    full = Problem(batch=128, nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=2048, head_dim=128)
    assert run("flash-decoding", full, MACHINES["h100"], "fwd").blocks["flash-decoding splits"] == 1
    # cuflash's kernels before their decode path did neither (cuflash_decode=False models them)
    before = run("cuflash", Problem(**{**problem.__dict__, "cuflash_decode": False}), MACHINES["h100"], "fwd")
    assert before.by_tensor()["K"]["read"] == 32 * 131072 * 128 * 2
    today = run("cuflash", problem, MACHINES["h100"], "fwd")
    assert today.by_tensor()["K"]["read"] == 8 * 131072 * 128 * 2
    assert today.blocks["cuflash splits"] > 1


# --- peak memory (issue 18, build 5: the paper's Figure 3) -----------------------------------------


def test_peak_memory_hand_counts():
    p = Problem(batch=1, nheads=1, seqlen_q=256, head_dim=64)  # ND = 32768 bytes per N x d tensor
    standard_fwd = run("standard", p, A100, "fwd").peak_memory()
    assert standard_fwd[0] == 3 * ND + 2 * NN and "softmax" in standard_fwd[1]
    standard_bwd = run("standard", p, A100, "bwd").peak_memory()
    assert standard_bwd[0] == 3 * ND + ND + ND + 3 * NN + ND  # Q K V, O, dO, P dP dS, dV
    flash_fwd = run("cuflash", p, A100, "fwd").peak_memory()
    assert flash_fwd[0] == 4 * ND + VEC  # Q K V O, LSE
    flash_bwd = run("cuflash", p, A100, "bwd").peak_memory()
    assert flash_bwd[0] == 8 * ND + 2 * VEC + 2 * ND  # Q K V O dO dQ dK dV, LSE D, float32 dQ accumulator
    deterministic = run("cuflash", Problem(**{**p.__dict__, "deterministic": True}), A100, "bwd").peak_memory()
    assert deterministic[0] == flash_bwd[0] - 2 * ND


def test_peak_memory_grows_quadratically_unfused_and_linearly_tiled():
    def peak(name, n):
        problem = Problem(batch=2, nheads=8, seqlen_q=n, head_dim=64, dropout=True, key_padding_mask=True)
        return run(name, problem, A100, "fwd+bwd").peak_memory()[0]

    for name in ("standard", "pytorch"):
        assert peak(name, 8192) / peak(name, 4096) > 3.8
    for name in ("flash1", "flash2", "cuflash"):
        assert peak(name, 8192) / peak(name, 4096) == pytest.approx(2, rel=0.01)
    assert peak("pytorch", 4096) > 20 * peak("cuflash", 4096)


def test_peak_memory_counts_expanded_k_v_and_split_partials():
    gqa = Problem(batch=1, nheads=8, nheads_k=2, seqlen_q=1, seqlen_k=4096, head_dim=64)
    assert "K_expanded" in run("standard", gqa, A100, "fwd").peak_memory()[2]
    assert "K_expanded" not in run("cuflash", gqa, A100, "fwd").peak_memory()[2]
    split = run("cuflash", Problem(**{**gqa.__dict__, "num_splits": 4}), A100, "fwd").peak_memory()[2]
    assert split["O_partial"] == 8 * 4 * 64 * 4


def test_block_sparse_traffic_scales_with_the_density_of_kept_blocks():
    """Proposition 4: the tiled algorithms' K/V (forward) and Q/dO (backward) re-reads scale with the
    fraction s of blocks the mask keeps; the unfused pipelines compute everything and mask."""
    dense = Problem(batch=1, nheads=1, seqlen_q=1024, head_dim=64)
    sparse = Problem(**{**dense.__dict__, "block_density": 0.25})
    for name in ("flash2", "cuflash"):
        full, quarter = (run(name, p, A100, "fwd+bwd", 64, 64).by_tensor() for p in (dense, sparse))
        assert quarter["K"]["read"] - 1024 * ROW == (full["K"]["read"] - 1024 * ROW) // 4  # 4 of 16 key blocks
        assert quarter["dO"]["read"] - 1024 * ROW == (full["dO"]["read"] - 1024 * ROW) // 4
        assert quarter["K"]["dram_read"] == full["K"]["dram_read"]  # the kept blocks differ per query block
    assert run("standard", sparse, A100).total() == run("standard", dense, A100).total()
    with pytest.raises(ValueError, match="block_density must be in"):
        Problem(block_density=0)


def test_cuflash_decodes_as_its_launcher_does():
    """One query token, GQA 32/8, 131072 keys on the H100: the decode tiles,
    the query heads of a K/V head packed (K/V read once per K/V head) and
    the launcher's split count (decode_split_count over 132 SMs)."""
    from cuflash._tiling import decode_split_count, decode_tilings
    from cuflash.simulate.algorithms import cuflash_plan

    h100 = MACHINES["h100"]
    problem = Problem(batch=1, nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=131072, head_dim=128)
    plan = cuflash_plan(problem, h100)
    decode = decode_tilings("float16", 128, 4)[1]
    assert (plan.fwd_m, plan.fwd_n, plan.pack) == (decode.block_m, decode.block_n, 4)
    assert plan.splits == decode_split_count(8, h100.sms, 131072 // decode.block_n) > 1
    t = run("cuflash", problem, h100, "fwd").by_tensor()
    assert t["K"]["read"] == 8 * 131072 * 128 * 2
    # a prefill keeps the forward's own tiles, unsplit
    prefill = cuflash_plan(Problem(batch=1, nheads=32, nheads_k=8, seqlen_q=4096, seqlen_k=4096, head_dim=128), h100)
    assert plan.fwd_m != prefill.fwd_m and (prefill.splits, prefill.pack) == (1, 1)


@pytest.mark.parametrize("head_dim,causal,seqlen,tile", [
    (64, True, 512, (64, 64, 3)),      # causal short sequences: three blocks an SM
    (64, True, 2048, (64, 64, 3)),
    (64, False, 1024, (64, 128, 2)),   # short sequences: two blocks an SM
    (64, False, 4096, (192, 96, 1)),   # the table's tile
    (64, True, 4096, (192, 96, 1)),
    (128, False, 512, (128, 128, 1)),  # d128's short tile only where persistent blocks do not apply
])
def test_cuflash_times_the_forward_tiles_its_launcher_takes(head_dim, causal, seqlen, tile):
    """On Hopper the forward's tile follows the key count and mask
    (cuflash._tiling.wgmma_forward_for_call), so the model times the
    tiles that run, not only the table's."""
    from cuflash.simulate.algorithms import cuflash_plan

    plan = cuflash_plan(Problem(batch=4, nheads=16, seqlen_q=seqlen, head_dim=head_dim, causal=causal),
                        MACHINES["h100"])
    assert (plan.fwd_m, plan.fwd_n, plan.fwd_blocks_per_sm) == tile


def test_cuflash_forward_tile_follows_dropout_block_masks_and_sram():
    """Dropout and a block mask (a user mask's tile map) take no persistent
    blocks, so d128's short tile serves them at 512 keys; a short tile whose
    blocks an SM do not all fit the machine's SRAM (``--sram``) leaves the one
    that does."""
    from dataclasses import replace

    from cuflash.simulate.algorithms import cuflash_plan

    h100 = MACHINES["h100"]

    def tile(machine=h100, **fields):
        plan = cuflash_plan(Problem(batch=4, nheads=16, seqlen_q=512, **fields), machine)
        return plan.fwd_m, plan.fwd_n, plan.fwd_blocks_per_sm

    assert tile(head_dim=128) == (128, 128, 1)
    assert tile(head_dim=128, dropout=True) == tile(head_dim=128, block_density=0.5) == (64, 64, 2)
    assert tile(head_dim=64, causal=True, block_density=0.5) == (64, 128, 2)  # the 64 x 64 tile is causal's
    assert tile(head_dim=64) == (64, 64, 3)
    assert tile(head_dim=64, seqlen_k=1024) == (64, 128, 2)
    # 64 x 64 at three blocks needs 171 KiB, 64 x 128 at two 210
    assert tile(replace(h100, sram_per_sm=100 * 1024), head_dim=64) == (192, 96, 1)


def test_data_beyond_l2_is_reread_as_far_as_each_waves_blocks_reach():
    """One causal 64k sequence over 32 heads (d128, H100: 512 query tiles of
    128 rows a head, 132 in flight, a head's 33.5 MB of K and V beyond what
    L2 keeps between waves). The grid hands the longest tiles out first, so
    the waves reach key blocks 512, 380, 248 and 116: 1256 key blocks of K
    from DRAM a head, not four times 512 (ncu measured about 1.6 times a
    head's K/V there, docs/io-validation.md)."""
    problem = Problem(batch=1, nheads=32, nheads_k=32, seqlen_q=65536, head_dim=128, element_size=2, causal=True)
    traffic = run("cuflash", problem, MACHINES["h100"], "fwd")
    (k_read,) = [term for term in traffic.terms if term.tensor == "K"]
    assert k_read.dram == 32 * (512 + 380 + 248 + 116) * 128 * 128 * 2
    # The backward likewise: key block j (of 128 keys) visits the query rows
    # from 128 j on, and the grid hands out key block 0 first, so its waves
    # of 132 reach 512, 380, 248 and 116 blocks of 128 rows of Q, dO and the
    # accumulator.
    backward = run("cuflash", problem, MACHINES["h100"], "bwd")
    (q_read,) = [term for term in backward.terms if term.tensor == "Q"]
    assert q_read.dram == 32 * (512 + 380 + 248 + 116) * 128 * 128 * 2
    # K/V that stay in L2 (the FlashAttention-2 grid's 16k) are read once a head, as before
    within = run("cuflash", Problem(batch=1, nheads=16, seqlen_q=16384, head_dim=128, causal=True),
                 MACHINES["h100"], "fwd")
    (k_within,) = [term for term in within.terms if term.tensor == "K"]
    assert k_within.dram == 16 * 16384 * 128 * 2
