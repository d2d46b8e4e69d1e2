"""``cuflash simulate --gpus``: ring attention and Ulysses per GPU, without
a GPU: the bytes each strategy sends written out by hand, balanced causal
sharding against contiguous shards, transfers hidden behind attention or
exposed by a slow link, the rule of thumb (GQA favours the ring, many GPUs
Ulysses), and the command line's checks."""

import json

import pytest
from click.testing import CliRunner

from cuflash.cli import main
from cuflash.simulate.distributed import STRATEGIES, choose, ring, ulysses
from cuflash.simulate.machines import MACHINES
from cuflash.simulate.traffic import Problem

H100 = MACHINES["h100"]


def _problem(seqlen=8192, heads=32, kv_heads=32, causal=True, batch=1):
    return Problem(batch=batch, nheads=heads, nheads_k=kv_heads, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=128,
                   causal=causal)


def test_ring_sends_every_kv_block_around_the_ring():
    p, gpus = _problem(kv_heads=8), 4
    shard = p.seqlen_q // gpus
    kv = 2 * shard * 8 * 128 * 2  # K and V of a shard, bf16
    forward = ring(p, H100, gpus, "fwd")
    assert forward.sent_bytes_per_gpu == (gpus - 1) * kv  # the last block stays
    backward = ring(p, H100, gpus, "bwd")
    # K/V with float32 dK/dV on to the next rank; after the last step the completed dK/dV home in bf16
    assert backward.sent_bytes_per_gpu == (gpus - 1) * (kv + 2 * shard * 8 * 128 * 4) + kv
    # that last transfer follows the last attention: nothing hides it
    assert backward.steps[-1].seconds == pytest.approx(backward.steps[-1].attention_s + backward.steps[-1].transfer_s)
    assert len(forward.steps) == gpus and len(backward.steps) == gpus


def test_ulysses_moves_the_heads_all_to_all():
    p, gpus = _problem(kv_heads=8), 4
    shard = p.seqlen_q // gpus
    away = (gpus - 1) / gpus
    forward = ulysses(p, H100, gpus, "fwd")
    assert forward.sent_bytes_per_gpu == int(away * shard * (32 + 2 * 8) * 128 * 2) + int(away * shard * 32 * 128 * 2)
    # fewer K/V heads than GPUs are replicated: each GPU receives the head its query heads use
    few = ulysses(_problem(kv_heads=2), H100, 4, "fwd")
    assert few.steps[0].transfer_bytes == int(away * shard * (32 + 2 * 4) * 128 * 2)


def test_balanced_causal_sharding_evens_the_work():
    p = _problem(seqlen=32768)
    balanced, contiguous = ring(p, H100, 4), ring(p, H100, 4, balanced=False)
    full = ring(_problem(seqlen=32768, causal=False), H100, 4)
    assert balanced.seconds < 0.65 * contiguous.seconds
    # contiguous shards: the last rank computes a full block every step but its own (the diagonal)
    assert 0.75 * full.attention_s < contiguous.attention_s < full.attention_s


def test_long_sequences_scale_and_slow_links_show():
    long = ring(_problem(seqlen=131072), MACHINES["h200"], 2)
    # only the backward's last transfer (the dK/dV home) shows
    assert 0 < long.exposed_transfer_s < 0.01 * long.seconds and 1.8 < long.speedup < 2.05
    short = ring(_problem(seqlen=4096), H100, 8, link_bandwidth=20e9)
    assert short.exposed_transfer_s > 0 and short.speedup < 1


def test_the_rule_of_thumb():
    """The ring sends about 2 gpus nheads_k / (nheads + nheads_k) times
    Ulysses' bytes: GQA on few GPUs favours the ring, many heads and GPUs
    Ulysses; the model picks the faster."""
    gqa = _problem(seqlen=16384, kv_heads=4)
    for gpus in (2, 8):
        ratio = ring(gqa, H100, gpus).sent_bytes_per_gpu / ulysses(gqa, H100, gpus).sent_bytes_per_gpu
        away = (gpus - 1) / gpus
        kv_heads = max(4, gpus)  # Ulysses replicates K/V heads fewer than the GPUs
        # per S d: ring 4 away nheads_k (bf16 K/V, forward) + 12 away nheads_k (K/V and float32 dK/dV,
        # backward) + 4 nheads_k / gpus (the bf16 dK/dV home); Ulysses 8 away (nheads + its K/V heads) / gpus
        # (Q, K, V, O in; dO, dQ, dK, dV out)
        ring_bytes = (16 * away + 4 / gpus) * 4
        assert ratio == pytest.approx(ring_bytes / (8 * away * (32 + kv_heads) / gpus), rel=1e-6)
        if gpus == 8:
            assert ratio == pytest.approx(2 * gpus * 4 / (32 + kv_heads), rel=0.15)  # the rule of thumb
    assert ring(gqa, H100, 2).sent_bytes_per_gpu < ulysses(gqa, H100, 2).sent_bytes_per_gpu
    mha = _problem(seqlen=16384)
    assert ulysses(mha, H100, 8).sent_bytes_per_gpu < ring(mha, H100, 8).sent_bytes_per_gpu
    for problem in (gqa, mha):
        best = choose(problem, H100, 8, link_bandwidth=25e9)
        assert best.seconds == min(ring(problem, H100, 8, link_bandwidth=25e9).seconds,
                                   ulysses(problem, H100, 8, link_bandwidth=25e9).seconds)
    assert choose(_problem(heads=12, kv_heads=12), H100, 8).strategy == "ring"  # Ulysses needs heads per GPU


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shapes_that_cannot_shard_are_refused(strategy):
    build = ring if strategy == "ring" else ulysses
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        build(_problem(), H100, 1)
    with pytest.raises(ValueError, match="seqlen_q and seqlen_k must be equal"):
        build(Problem(nheads=32, seqlen_q=1024, seqlen_k=2048), H100, 2)
    with pytest.raises(ValueError, match="2 x 3 equal chunks"):
        build(_problem(seqlen=1000), H100, 3)


def test_command_line():
    runner = CliRunner()
    result = runner.invoke(main, ["simulate", "--gpus", "2", "--machine", "h200", "--seqlen", "64k", "--heads", "32",
                                  "-d", "128", "--causal"])
    assert result.exit_code == 0, result.output
    assert "ring attention over 2 GPUs" in result.output and "ulysses attention" in result.output
    assert "faster here:" in result.output
    result = runner.invoke(main, ["simulate", "--gpus", "4", "--strategy", "ring", "--link-bandwidth", "100",
                                  "--seqlen", "16k", "--heads", "32", "-d", "128", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [r["strategy"] for r in data["results"]] == ["ring"] and data["results"][0]["link_bandwidth"] == 100e9
    for args, message in ((["--strategy", "ring"], "go with --gpus"),
                          (["--gpus", "2", "--sweep", "seqlen", "--values", "1k,2k"], "leave out --sweep"),
                          (["--gpus", "2", "--heads", "3", "--strategy", "ulysses"], "do not divide over 2 GPUs"),
                          (["--gpus", "2", "--link-bandwidth", "-1"], "must be positive")):
        result = runner.invoke(main, ["simulate", *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
