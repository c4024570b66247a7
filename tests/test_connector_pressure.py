"""Decode's pressure check (connector/patches/residency.py): the blocks a waiting request
lacks, with the prefix it shares with retained turns left out. vLLM's scheduler, block
pool and prefix-cache lookup are stand-ins with the attributes the patch reads (its
TARGETS name them, and the launcher checks them against the installed vLLM)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from bidirkv.connector.core.residency import Residency  # noqa: E402
from bidirkv.connector.patches.residency import TARGETS, blocks_short  # noqa: E402
from bidirkv.connector.targets import site_problems  # noqa: E402

BLOCK = 16


def block(ref_cnt: int) -> SimpleNamespace:
    return SimpleNamespace(ref_cnt=ref_cnt, is_null=False)


def scheduler(free: int, hits: list, caching: bool = True, tokens: int = 10 * BLOCK - 4):
    """A decode scheduler whose first waiting request has `tokens` tokens and whose
    prefix-cache lookup finds `hits` (blocks, in prompt order)."""
    req = SimpleNamespace(status=RequestStatus.WAITING, num_tokens=tokens,
                          block_hashes=[f"h{i}" for i in range(tokens // BLOCK)])
    looked = []

    def find_longest_cache_hit(block_hashes, max_cache_hit_length):
        looked.append((list(block_hashes), max_cache_hit_length))
        return (list(hits),), len(hits) * BLOCK, 0

    kvm = SimpleNamespace(
        block_pool=SimpleNamespace(get_num_free_blocks=lambda: free, num_gpu_blocks=64),
        prefix_cache_lookup_enabled=lambda r: caching,
        coordinator=SimpleNamespace(find_longest_cache_hit=find_longest_cache_hit))
    sched = SimpleNamespace(waiting=[req], running=[], block_size=BLOCK, kv_cache_manager=kvm)
    return sched, looked


def test_an_extend_needs_free_blocks_only_for_what_it_does_not_share():
    """The prompt's first 8 blocks sit in a retained turn's blocks (held: ref_cnt 1), so
    of its 10 blocks only 2 need the free pool, which has 3: nothing is short, and no
    other tenant's retention is released for it."""
    sched, looked = scheduler(free=3, hits=[block(1)] * 8)
    assert blocks_short(sched, Residency()) == 0
    assert looked == [([f"h{i}" for i in range(9)], 10 * BLOCK - 5)]


def test_cached_blocks_nobody_holds_still_come_from_the_free_pool():
    # ref_cnt 0: cached but free (counted in the free pool, taken from it on admission).
    sched, _ = scheduler(free=3, hits=[block(0)] * 8)
    assert blocks_short(sched, Residency()) == 10 - 3
    sched, _ = scheduler(free=3, hits=[block(1)] * 4 + [block(0)] * 4)
    assert blocks_short(sched, Residency()) == 10 - 4 - 3


def test_without_prefix_caching_the_whole_prompt_counts():
    sched, looked = scheduler(free=3, hits=[block(1)] * 8, caching=False)
    assert blocks_short(sched, Residency()) == 10 - 3 and looked == []


def test_the_lookup_the_check_relies_on_is_in_the_installed_vllm():
    assert site_problems(TARGETS) == []
