import itertools
import os
import threading
import time

import pytest
import torch

from tierzero.placement.storage.tiers import ALIGNMENT, HUGE_PAGE, Budget, HostPool, PinnedArena, round_up
from tierzero.config.tiernames import Tier


def test_tier_names_and_parsing():
    assert Tier("nvme") is Tier.NVME and Tier.parse("host") is Tier.HOST
    assert Tier.DEVICE == "device" and str(Tier.HOST) == "host" and f"{Tier.NVME}" == "nvme"
    assert {Tier.HOST: 1}["host"] == 1  # hashes like its value
    with pytest.raises(ValueError, match="expected one of 'device', 'host', 'nvme', got 'gpu'"):
        Tier.parse("gpu")


@pytest.mark.parametrize("n,expected", [(0, 0), (1, 4096), (4096, 4096), (4097, 8192)])
def test_round_up(n, expected):
    assert round_up(n) == expected


def test_budget_reserve_release_peak_and_hooks():
    seen = []
    b = Budget(Tier.HOST, 1000)
    b.add_hook(lambda tier, used: seen.append((tier, used)))
    assert b.try_reserve(600) and not b.try_reserve(401) and b.try_reserve(400)
    assert b.used == 1000 and b.free == 0
    b.release(700)
    assert b.used == 300 and b.peak == 1000
    b.reset_peak()
    assert b.peak == 300
    assert seen == [(Tier.HOST, 600), (Tier.HOST, 1000), (Tier.HOST, 300)]
    assert "host" in repr(b)


def test_budget_reserve_waits_for_release_and_times_out():
    b = Budget(Tier.DEVICE, 100)
    b.reserve(80)
    threading.Timer(0.05, b.release, args=(80,)).start()
    t0 = time.monotonic()
    b.reserve(50, timeout=5)
    assert time.monotonic() - t0 >= 0.04 and b.used == 50
    with pytest.raises(TimeoutError, match="did not become free"):
        b.reserve(60, timeout=0.01)
    with pytest.raises(ValueError, match="can never fit"):
        b.reserve(101)


def test_budget_never_exceeded_under_threads():
    b = Budget(Tier.HOST, 10_000)
    over = []
    b.add_hook(lambda tier, used: over.append(used) if used > 10_000 else None)

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(500):
            n = int(torch.randint(1, 3000, (1,), generator=g))
            if b.try_reserve(n):
                b.release(n)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over and b.used == 0 and 0 < b.peak <= 10_000


def test_host_pool_aligned_reused_and_counted():
    b = Budget(Tier.HOST, 5 * ALIGNMENT)
    pool = HostPool(b)
    buf = pool.try_alloc(5000)
    assert buf.dtype == torch.uint8 and buf.numel() == 8192 and buf.data_ptr() % ALIGNMENT == 0
    assert b.used == 8192 and pool.in_use_count == 1
    ptr = buf.data_ptr()
    pool.free(buf)
    assert b.used == 8192 and pool.cached_bytes == 8192  # cached memory still counts
    again = pool.try_alloc(8000)
    assert again.data_ptr() == ptr and pool.cached_bytes == 0
    pool.free(again)
    # A different bucket that only fits once the cache is dropped: the pool trims itself.
    big = pool.try_alloc(4 * ALIGNMENT + 1)
    assert big is not None and big.numel() == 5 * ALIGNMENT and b.used == 5 * ALIGNMENT
    assert pool.try_alloc(1) is None  # full
    pool.free(big)
    assert pool.trim() == 5 * ALIGNMENT and b.used == 0
    pool.close()


def test_host_pool_trims_the_buckets_asked_for():
    b = Budget(Tier.HOST, 9 * ALIGNMENT)
    pool = HostPool(b)
    bufs = [pool.try_alloc(n) for n in (ALIGNMENT, 2 * ALIGNMENT + 7, 2 * ALIGNMENT + 9, ALIGNMENT + 1)]
    for buf in bufs:
        pool.free(buf)
    assert pool.trim([2 * ALIGNMENT + 1, 5 * ALIGNMENT]) == 6 * ALIGNMENT  # both of the 3-page bucket
    assert b.used == pool.cached_bytes == 3 * ALIGNMENT
    assert pool.trim([3 * ALIGNMENT]) == 0  # nothing cached of that size now
    again = pool.try_alloc(ALIGNMENT - 1)
    assert again.data_ptr() == bufs[0].data_ptr() and pool.cached_bytes == 2 * ALIGNMENT
    pool.free(again)
    pool.close()


def test_host_pool_close_reports_leaks():
    pool = HostPool(Budget(Tier.HOST, 1 << 20))
    pool.try_alloc(10)
    with pytest.raises(RuntimeError, match="1 buffers .* still in use"):
        pool.close()


def test_pinned_arena_is_its_budget_sliced_best_fit_and_merged():
    b = Budget(Tier.HOST, 10 * ALIGNMENT + 100)
    arena = PinnedArena(b, pin=False)
    assert arena.size == 10 * ALIGNMENT and arena.base % ALIGNMENT == 0  # never more than the budget
    x = [arena.try_alloc(n * ALIGNMENT) for n in (1, 2, 3)]
    assert [t.data_ptr() - arena.base for t in x] == [0, ALIGNMENT, 3 * ALIGNMENT] and b.used == 6 * ALIGNMENT
    arena.free(x[1])
    assert b.used == 4 * ALIGNMENT
    small = arena.try_alloc(5000)  # best fit: the 2-page hole, not the 4-page tail
    assert small.data_ptr() - arena.base == ALIGNMENT and small.numel() == 2 * ALIGNMENT
    home = arena.try_alloc(1, home=True)  # homes from the top: they leave no holes below
    assert home.data_ptr() - arena.base == 9 * ALIGNMENT
    assert arena.try_alloc(4 * ALIGNMENT) is None  # 3 pages free in one extent: no room
    for t in (x[0], small, x[2], home):
        arena.free(t)
    assert b.used == 0 and arena.try_alloc(10 * ALIGNMENT) is not None  # merged back into one extent


def _advised_huge(addr: int) -> bool:
    """Whether the mapping holding `addr` was advised to use huge pages (its VmFlags has "hg")."""
    mapping = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= addr < hi
        elif mapping and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping of {addr:#x} with VmFlags in /proc/self/smaps")


def _no_thp() -> bool:
    switch = "/sys/kernel/mm/transparent_hugepage/enabled"
    return not os.path.exists("/proc/self/smaps") or not os.path.exists(switch) or "[never]" in open(switch).read()


@pytest.mark.skipif(_no_thp(), reason="this kernel gives no transparent huge pages")
def test_pinned_arena_asks_for_huge_pages():
    """The arena's region starts on a huge page and asks the kernel for them: with 4 KiB pages
    the copies and updates over it cost a fifth more CPU (benchmarks/RESULTS.md)."""
    arena = PinnedArena(Budget(Tier.HOST, 8 << 20), pin=False)
    assert arena.base % HUGE_PAGE == 0 and _advised_huge(arena.base)
    arena.close()


def test_pinned_arena_fragmented_is_no_room_and_close_reports_leaks():
    b = Budget(Tier.HOST, 4 * ALIGNMENT)
    arena = PinnedArena(b, pin=False)
    bufs = [arena.try_alloc(ALIGNMENT) for _ in range(4)]
    arena.free(bufs[0])
    arena.free(bufs[2])
    assert b.free == 2 * ALIGNMENT and arena.try_alloc(2 * ALIGNMENT) is None and b.free == 2 * ALIGNMENT
    with pytest.raises(RuntimeError, match="2 buffers .* still in use"):
        arena.close()


def test_pinned_arena_victims_open_the_least_recent_window():
    """[Note: arena windows]: of the slices offered (victims first), those of the window whose
    most recent victim is least recent, then of the fewest bytes; none where no window opens."""
    arena = PinnedArena(Budget(Tier.HOST, 10 * ALIGNMENT), pin=False)
    s = [arena.try_alloc(ALIGNMENT) for _ in range(10)]
    offered = [s[0], s[5], s[2], s[6], s[1], s[7], s[3], s[8], s[9]]  # s[4] is not offered
    assert arena.try_alloc(3 * ALIGNMENT) is None
    # s0 s1 s2 (latest victim: rank 4) opens before s5 s6 s7 (rank 5); LRU alone would give
    # back ranks 0-4, five slices, for three pages
    assert arena.victims(3 * ALIGNMENT, offered) == [0, 2, 4]
    assert arena.victims(5 * ALIGNMENT, offered) == [1, 3, 5, 7, 8]  # s5..s9: s4 stays
    assert arena.victims(6 * ALIGNMENT, offered) == []  # no window of 6 pages without s4
    arena.free(s[6])
    offered = [s[0], s[5], s[7], s[1], s[2], s[3], s[8], s[9]]
    # s5 beside the hole: one page given back, where LRU would give back s0 first
    assert arena.victims(2 * ALIGNMENT - 1, offered) == [1]
    # as recent a latest victim (s7) either way: s7 beside the hole, not s8 and s7
    assert arena.victims(2 * ALIGNMENT, [s[8], s[7], s[5]]) == [1]
    assert arena.victims(3 * ALIGNMENT, offered) == [1, 2]  # s5, the hole, s7
    for i in arena.victims(3 * ALIGNMENT, offered):  # what victims chose opens the window
        arena.free(offered[i])
    assert arena.try_alloc(3 * ALIGNMENT) is not None


def test_host_pool_has_no_windows():
    pool = HostPool(Budget(Tier.HOST, 4 * ALIGNMENT))
    bufs = [pool.try_alloc(ALIGNMENT) for _ in range(4)]
    assert pool.victims(2 * ALIGNMENT, bufs) is None  # any bytes given back serve


def _worst_gap(region: int, held: list[int], need: int) -> bool:
    """Whether some placement of slices of `held` pages in `region` pages leaves no gap of
    `need` pages (the rest free or evictable: only the held slices stay)."""
    def place(at: int, rest: list[int], gap: int) -> bool:
        if not rest:
            return max(gap, region - at) < need
        return any(place(start + rest[0], list(rest[1:]), max(gap, start - at))
                   for start in range(at, region - sum(rest) + 1))
    return any(place(0, order, 0) for order in set(itertools.permutations(held)))


def test_pinned_arena_room_for_a_working_set_finds_its_last_window_wherever_the_first_were_cut():
    """[Note: working set windows]: slices taken one at a time and held together need more than
    their sum in one region: bytes_for is the least region in which the last (the largest) finds
    a gap whatever the placement of the others; one page less and some placement leaves none,
    though the free bytes would hold it."""
    sizes = [2 * ALIGNMENT - 100, ALIGNMENT + 1, 3 * ALIGNMENT, 700]  # pages 2, 2, 3, 1
    pool = PinnedArena(Budget(Tier.HOST, ALIGNMENT), pin=False)
    room = pool.bytes_for(sizes)
    assert room == (2 + 2 + 1) * ALIGNMENT + 4 * 2 * ALIGNMENT + ALIGNMENT  # 14 pages, not the sum's 8
    assert not _worst_gap(room // ALIGNMENT, [2, 2, 1], 3)
    assert _worst_gap(room // ALIGNMENT - 1, [2, 2, 1], 3)
    assert HostPool(Budget(Tier.HOST, ALIGNMENT)).bytes_for(sizes) == 8 * ALIGNMENT  # separate buffers: the sum
    # the adversarial placement cut for real, one page short: 2-page gaps that evicting would leave
    arena = PinnedArena(Budget(Tier.HOST, room - ALIGNMENT), pin=False)
    cached = [arena.try_alloc(2 * ALIGNMENT)]
    held = [arena.try_alloc(sizes[0])]
    cached.append(arena.try_alloc(2 * ALIGNMENT))
    held.append(arena.try_alloc(sizes[1]))
    cached.append(arena.try_alloc(2 * ALIGNMENT))
    held.append(arena.try_alloc(sizes[3]))
    for c in cached:  # every copy not held given back: 6 free pages, none 3 together
        arena.free(c)
    assert arena.budget.free >= 3 * ALIGNMENT and arena.try_alloc(sizes[2]) is None
    for h in held:
        arena.free(h)
    arena.close()
