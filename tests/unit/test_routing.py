"""Routing policy, prefix index and core sharing: plain data in, decisions out."""

import pytest

from controller.pools import share_cores
from engine.block_pool import block_hashes
from protos import tandem_pb2 as pb
from router.policy import RoutingConfig, WorkerView, choose_decode, choose_prefill, plan
from router.prefix_index import PrefixIndex
from worker_runtime.stats import RateMeter

pytestmark = pytest.mark.unit


def d(wid, free, running=0, in_flight=0, in_flight_blocks=0, cached=0, max_seqs=8):
    return WorkerView(wid, free_blocks=free, num_blocks=100, running=running, in_flight=in_flight,
                      in_flight_blocks=in_flight_blocks, max_num_seqs=max_seqs, cached_blocks=cached)


@pytest.mark.parametrize("policy", ["prefix", "headroom"])
def test_without_cached_blocks_the_least_loaded_decode_worker_wins(policy):
    cfg = RoutingConfig(decode_routing=policy)
    ws = [d("a", 50), d("b", 80, in_flight_blocks=40), d("c", 60)]
    assert choose_decode(ws, 5, cfg).worker.worker_id == "c"  # b's headroom is 40
    assert choose_decode(ws, 5, cfg).reason == "load"
    assert choose_decode([d("a", 3), d("b", 100, running=8)], 5, cfg) is None  # no blocks / no seats
    assert choose_decode([d("a", 50, running=2), d("b", 50, running=1)], 5, cfg).worker.worker_id == "b"
    assert choose_decode([d("a", 3), d("b", 50)], 5, cfg).reason == "only_fit"


def test_decode_routing_weighs_the_prompt_blocks_a_worker_holds_against_its_load():
    # the case: a 1000-token prompt (62 full blocks); "a" holds 60 of them,
    # "b" has a single free block more
    a, b = d("a", 40, cached=60), d("b", 41)
    pick = choose_decode([a, b], 5, RoutingConfig(), prompt_blocks=62)
    assert (pick.worker.worker_id, pick.reason) == ("a", "prefix_overlap")
    assert choose_decode([a, b], 5, RoutingConfig(decode_routing="headroom"), 62).worker.worker_id == "b"
    # overlap wins until the other worker's load is lighter by more than the blocks saved
    # (60 here) times the weight
    even = RoutingConfig(prefill_block_weight=1.0)
    assert choose_decode([d("a", 40, cached=60), d("b", 99)], 5, even, 62).worker.worker_id == "a"
    assert choose_decode([d("a", 30, cached=60), d("b", 91)], 5, even, 62).worker.worker_id == "b"
    assert choose_decode([d("a", 30, cached=60), d("b", 91)], 5, RoutingConfig(), 62).worker.worker_id == "a"
    with pytest.raises(ValueError):
        RoutingConfig(decode_routing="random")


def test_prefill_worker_by_cached_overlap_minus_queue():
    a = WorkerView("a", 100, 100, queued_tokens=400, cached_blocks=30)  # 480 - 400 = 80
    b = WorkerView("b", 100, 100, queued_tokens=0, cached_blocks=0)  # 0
    c = WorkerView("c", 100, 100, queued_tokens=100, in_flight_tokens=300, cached_blocks=20)  # 320 - 400
    assert choose_prefill([a, b, c], block_size=16).worker_id == "a"
    assert choose_prefill([], 16) is None


def test_conditional_disaggregation():
    cfg = RoutingConfig(local_prefill_threshold=64)
    pf = [WorkerView("p", 100, 100)]
    assert plan(40, d("d", 90), pf, cfg, 16).reason == "short_uncached"
    assert plan(200, d("d", 90, cached=9), pf, cfg, 16).reason == "short_uncached"  # 200 - 144 < 64
    r = plan(200, d("d", 90, cached=2), pf, cfg, 16)
    assert (r.prefill, r.reason) == ("p", "remote")
    assert plan(500, d("d", 90), [], cfg, 16).reason == "no_prefill_worker"
    assert plan(500, d("d", 90), pf, RoutingConfig(colocated=True), 16).reason == "colocated"


def test_spill_to_the_decode_worker_when_every_prefill_queue_is_seconds_long():
    cfg = RoutingConfig(spill_prefill_s=2.0)

    def p(wid, queued, rate, in_flight=0):
        return WorkerView(wid, 100, 100, queued_tokens=queued, in_flight_tokens=in_flight, prefill_tokens_per_s=rate)

    def dq(queued=0, in_flight=0):
        return WorkerView("d", 90, 100, queued_tokens=queued, in_flight_tokens=in_flight)

    # 1,900 tokens at 1,000 tok/s is under 2 s: remote; 2,000 queued or on their way: spill
    assert plan(256, dq(), [p("p", 1900, 1000.0)], cfg, 16).reason == "remote"
    assert plan(256, dq(), [p("p", 1500, 1000.0, in_flight=500)], cfg, 16).reason == "spill"
    assert plan(256, dq(), [p("p", 2000, 1000.0)], cfg, 16).prefill is None
    # the decode worker's own prefill backlog plus the prompt may not exceed the prefill worker's
    assert plan(256, dq(queued=1744), [p("p", 2000, 1000.0)], cfg, 16).reason == "spill"
    assert plan(256, dq(queued=1500, in_flight=245), [p("p", 2000, 1000.0)], cfg, 16).reason == "remote"
    # the least-loaded prefill worker decides: one with a short queue takes the prompt
    r = plan(256, dq(), [p("busy", 50_000, 1000.0), p("free", 100, 1000.0)], cfg, 16)
    assert (r.prefill, r.reason) == ("free", "remote")
    # seconds, not tokens: a fast worker's long queue is short
    assert plan(256, dq(), [p("p", 50_000, 100_000.0)], cfg, 16).reason == "remote"
    # a rate not measured yet (no step run), or spill turned off: remote
    assert plan(256, dq(), [p("p", 50_000, 0.0)], cfg, 16).reason == "remote"
    assert plan(256, dq(), [p("p", 50_000, 1000.0)], RoutingConfig(spill_prefill_s=0), 16).reason == "remote"
    with pytest.raises(ValueError):
        RoutingConfig(spill_prefill_s=-1)


def test_a_prompt_the_prefill_worker_could_not_finish_within_the_lease_stays_on_the_decode_worker():
    cfg = RoutingConfig(spill_prefill_s=0)  # the lease rule alone

    def p(queued, rate, in_flight=0):
        return WorkerView("p", 100, 100, queued_tokens=queued, in_flight_tokens=in_flight, prefill_tokens_per_s=rate)

    d = WorkerView("d", 90, 100)
    # 1,000 tok/s and a 30 s lease: 24 s (LEASE_FILL) of queue and prompt may go remote
    assert plan(256, d, [p(23_744, 1000.0)], cfg, 16, lease_s=30.0).reason == "remote"
    r = plan(256, d, [p(23_745, 1000.0)], cfg, 16, lease_s=30.0)
    assert (r.prefill, r.reason) == (None, "lease")
    assert plan(256, d, [p(20_000, 1000.0, in_flight=4_000)], cfg, 16, lease_s=30.0).reason == "lease"
    # no lease known, or no rate measured yet: remote, as before
    assert plan(256, d, [p(50_000, 1000.0)], cfg, 16).reason == "remote"
    assert plan(256, d, [p(50_000, 0.0)], cfg, 16, lease_s=30.0).reason == "remote"
    # the spill rule, when it applies, still comes first
    assert plan(256, d, [p(50_000, 1000.0)], RoutingConfig(spill_prefill_s=2.0), 16, lease_s=30.0).reason == "spill"


def test_rate_meter_averages_steps_and_skips_small_ones():
    m = RateMeter(weight=0.5, min_tokens=16)
    assert m.value == 0.0
    m.add(8, 0.001)  # too small to say anything about the rate
    m.add(100, 0.0)
    assert m.value == 0.0
    m.add(1000, 1.0)
    assert m.value == 1000.0
    m.add(3000, 1.0)
    assert m.value == 2000.0


def test_prefix_index_follows_kv_events():
    idx = PrefixIndex()
    hashes = block_hashes(list(range(64)), 16)
    idx.apply("w", pb.KVEventBatch(cleared=True, stored=hashes[:3]))
    assert idx.overlap_blocks("w", hashes) == 3
    idx.apply("w", pb.KVEventBatch(removed=[hashes[1]]))
    assert idx.overlap_blocks("w", hashes) == 1  # a leading run only
    idx.apply("w", pb.KVEventBatch(cleared=True))
    assert idx.overlap_blocks("w", hashes) == 0 and idx.overlap_blocks("other", hashes) == 0


def test_prefix_index_knows_which_blocks_are_below_the_device_and_routing_prefers_the_device():
    """A block offloaded to a KV tier is still held (it counts in the run) but marked
    below; restored, it is on the device again. Of two prefill workers holding the same
    prefix, the one with it on its device gets the prompt; a tier's hit still beats none."""
    from router.policy import WorkerView, choose_prefill

    idx = PrefixIndex()
    hashes = block_hashes(list(range(64)), 16)
    idx.apply("a", pb.KVEventBatch(cleared=True, stored=hashes))
    idx.apply("b", pb.KVEventBatch(cleared=True, stored=hashes[:1], offloaded=hashes[1:]))
    assert idx.overlap_blocks("b", hashes) == 4 and idx.overlap_below("b", hashes, 4) == 3
    idx.apply("a", pb.KVEventBatch(offloaded=hashes[2:]))
    assert idx.overlap_below("a", hashes, 4) == 2
    idx.apply("a", pb.KVEventBatch(offloaded=[hashes[3]], stored=[hashes[3]]))  # restored in the same batch
    assert idx.overlap_below("a", hashes, 4) == 1
    idx.apply("a", pb.KVEventBatch(removed=hashes[2:3]))
    assert idx.overlap_blocks("a", hashes) == 2 and idx.overlap_below("a", hashes, 2) == 0

    def view(wid, cached, below):
        return WorkerView(wid, free_blocks=10, num_blocks=10, running=0, queued_tokens=0, in_flight=0,
                          in_flight_blocks=0, in_flight_tokens=0, max_num_seqs=4, cached_blocks=cached,
                          cached_below=below)

    assert choose_prefill([view("a", 4, 3), view("b", 4, 0)], 16).worker_id == "b"
    assert choose_prefill([view("a", 4, 4), view("b", 0, 0)], 16).worker_id == "a"


def test_with_peer_pulls_an_idle_prefill_worker_takes_a_prompt_from_a_busy_holder():
    """The holder of an 8-block prefix (128 tokens) has 100 tokens queued; the other is
    idle. Without pulls the holder wins (28 against 0); with them the idle one counts the
    8 blocks it would pull at 3/4 (96 tokens) and wins; a holder with a short queue (118)
    still keeps its prompt."""
    def view(wid, cached, queued):
        return WorkerView(wid, free_blocks=10, num_blocks=10, running=0, queued_tokens=queued, in_flight=0,
                          in_flight_blocks=0, in_flight_tokens=0, max_num_seqs=4, cached_blocks=cached)

    busy, idle = view("holder", 8, 100), view("idle", 0, 0)
    assert choose_prefill([busy, idle], 16).worker_id == "holder"
    assert choose_prefill([busy, idle], 16, pullable=8).worker_id == "idle"
    assert choose_prefill([view("holder", 8, 10), idle], 16, pullable=8).worker_id == "holder"


@pytest.mark.parametrize("cores,n,slot,want", [((0, 1), 1, 0, (0, 1)), ((0, 1), 2, 1, (1,)), ((0, 1), 5, 4, (0,)),
                                               (tuple(range(8)), 3, 2, (4, 5)), (tuple(range(8)), 4, 3, (6, 7))])
def test_share_cores(cores, n, slot, want):
    assert share_cores(cores, n, slot) == want


def test_the_router_hashes_a_longrope_prompt_as_the_worker_names_its_blocks():
    """LongRoPE: a worker names a long prompt's blocks with an extra key (rotated with the
    long factors, they are not a short prompt's blocks of the same tokens); the router,
    told the threshold in the worker's stats, hashes such a prompt with the same key, so
    its prefix index (fed the worker's events) still finds them; a short prompt is hashed
    plain on both sides."""
    from types import SimpleNamespace

    from engine.block_pool import LONG_ROPE_KEY, BlockPool
    from engine.kv_cache_manager import KVCacheManager
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    from router.cluster import ClusterBackend
    from worker_runtime.config import Role
    from worker_runtime.stats import WorkerStats

    stats = WorkerStats("p0", 1, Role.PREFILL, block_size=16, long_rope_from=64)
    view = SimpleNamespace(workers={"p0": SimpleNamespace(stats=stats)})
    router = ClusterBackend(view, RoutingConfig(), metrics=object())
    cache = KVCacheManager(BlockPool(32, 16), long_rope_from=64)
    for n, key in ((64, b""), (100, LONG_ROPE_KEY)):
        prompt = list(range(5, 5 + n))
        seq = Sequence(f"s{n}", prompt, SamplingParams(max_tokens=1))
        assert router._hash_key(n) == key
        assert cache._hashes_of(seq, n // 16) == block_hashes(prompt, 16, router._hash_key(n))
    assert block_hashes(list(range(5, 69)), 16, LONG_ROPE_KEY) != block_hashes(list(range(5, 69)), 16)
    plain = ClusterBackend(SimpleNamespace(workers={"p0": SimpleNamespace(stats=WorkerStats("p0", 1, Role.PREFILL))}),
                           RoutingConfig(), metrics=object())
    assert plain._hash_key(10_000) == b""
