"""``runtime.resolve``: every choice left to the backend made once, with its reason; a
choice forced where it cannot run is refused, saying why and what to do."""

from __future__ import annotations

import argparse
import sys

import pytest

from mlx_streaming.core.mem import HostShare
from mlx_streaming.core.meta import load_meta
from mlx_streaming.core.options import StreamConfig
from mlx_streaming.core.runtime import RuntimeChoiceError, resolve

BIG = (1 << 40, 1 << 40)


@pytest.fixture(scope="module")
def meta(models):
    return load_meta(models.experts("tiny-qwen3_moe")[1])


def cuda(cfg: StreamConfig, meta, memory=BIG, engine=True, **kw):
    """``resolve`` on CUDA (``kw``: its ``slots``, ``host``)."""
    return resolve(cfg, meta, backend="cuda", memory=memory, cuda_available=True,
                   engine_available=engine, **kw)  # fmt: skip


def test_cuda_maps_the_files_that_fit_and_says_why(meta):
    rt = cuda(StreamConfig(), meta)
    assert (rt.mapped, rt.reader, rt.decode_path) == (True, "device", "device")
    assert "fit in half" in rt.reason("decode_path")
    assert "device path (expert files" in rt.line()
    small = cuda(StreamConfig(), meta, memory=(1 << 20, 1 << 20))  # too little memory
    assert (small.mapped, small.reader, small.decode_path) == (False, "native", "host")
    assert "do not fit in half" in small.reason("decode_path")
    ahead = cuda(StreamConfig(prefetch=True), meta)
    assert ahead.decode_path == "host" and ahead.reason("decode_path") == "read-ahead is on"
    direct = cuda(StreamConfig(direct_io=True), meta)
    assert not direct.mapped and direct.reader == "native"
    off = cuda(StreamConfig(device_reads=False), meta)
    assert (off.reader, off.decode_path) == ("device", "host")


def test_a_swap_tier_takes_the_device_path_on_cuda_whatever_the_memory(meta):
    """Asked for, the swap tier is the reader; on CUDA the device path trades with it,
    even where the files would not fit in half of memory (the tier holds only what the
    pools do not). Elsewhere the routing is read on the host."""
    small = (1 << 20, 1 << 20)
    rt = cuda(StreamConfig(swap_tier=True), meta, memory=small)
    assert (rt.mapped, rt.reader, rt.decode_path) == (False, "tier", "device")
    assert rt.reason("decode_path") == "the swap tier" and "reader tier" in rt.line()
    assert cuda(StreamConfig(swap_tier=True, device_reads=True), meta).decode_path == "device"
    off = cuda(StreamConfig(swap_tier=True, device_reads=False), meta)
    assert (off.reader, off.decode_path) == ("tier", "host")
    cpu = resolve(StreamConfig(swap_tier=True), meta, backend="cpu", engine_available=True)
    assert (cpu.reader, cpu.decode_path, cpu.files_reader) == ("tier", "host", "native")
    # bounded: the records beyond it asked of the request ring by the GPU (1.88x the host
    # path's tok/s at 25% in a 6 GB cgroup on an H100, 2026-12-07b), or the host path
    bounded = cuda(StreamConfig(swap_tier=True, swap_tier_gb=1.0, direct_io=True), meta)
    assert (bounded.reader, bounded.decode_path, bounded.direct_io) == ("tier", "device", True)
    assert "asked of the request ring" in bounded.reason("decode_path")
    assert "at most 1 GB: the rest read by the native reader" in bounded.reason("reader")
    assert "the request ring's 8 threads, 8 pieces a record" in bounded.reason("threads")
    assert bounded.ring_cut == (8, 8)
    cut = StreamConfig(swap_tier=True, swap_tier_gb=1.0, ring_readers=16, ring_pieces=4)
    assert cuda(cut, meta).ring_cut == (16, 4)
    wide = cuda(StreamConfig(swap_tier=True, swap_tier_gb=1.0, ring_readers=16), meta)
    assert wide.ring_cut == (16, 8)  # a piece a reader, 8 at most
    few = cuda(StreamConfig(swap_tier=True, swap_tier_gb=1.0, ring_readers=4), meta)
    assert few.ring_cut == (4, 4) and "ring's 4 threads, 4 pieces" in few.reason("threads")
    whole = cuda(StreamConfig(swap_tier=True, ring_readers=4), meta)  # whole or refused
    assert whole.ring_cut == (0, 0) and "ring_* unused" in whole.reason("ring")
    none = cuda(StreamConfig(ring_readers=4, map_files=True), meta)  # no tier, no ring
    assert none.ring_cut == (0, 0) and "ring_* unused" in none.reason("ring")
    with pytest.raises(ValueError, match="ring_readers must be 1 to 16 threads, got 17"):
        StreamConfig(ring_readers=17)
    with pytest.raises(
        ValueError, match=r"ring_pieces must be 1 to the ring's readers \(8\), got 9"
    ):
        StreamConfig(ring_readers=8, ring_pieces=9)
    with pytest.raises(ValueError, match=r"ring's readers \(8\), got 12"):  # the default's
        StreamConfig(ring_pieces=12)  # (before, refused only as the ring started, at load)
    host = cuda(StreamConfig(swap_tier=True, swap_tier_gb=1.0, device_reads=False), meta)
    assert (host.reader, host.decode_path, host.bounded) == ("tier", "host", True)


def test_an_auto_swap_tier_is_whole_where_memory_holds_it_and_bounded_where_not(meta, monkeypatch):
    """``--swap-tier-gb auto``: on CUDA the device path trades with a tier that fits whole
    beside the margin and the trunk's load; where it does not, the tier is bounded and
    both paths ask the request ring for the rest (--no-device-reads: the host path, which
    asks it from the host); without the pools' slots it cannot be weighed and is bounded. ``auto`` or
    a positive number, nothing else."""
    from mlx_streaming.commands._args import add_store_args
    from mlx_streaming.core.io import tier

    monkeypatch.setattr(tier, "MARGIN", 1000)
    slots = {li: 4 for li in meta.layers}
    need = sum((meta.layers[li].num_experts - 4) * meta.layers[li].stride for li in slots)
    cfg = StreamConfig(swap_tier=True, swap_tier_gb="auto")

    def at(room: int, reserve: int = 0, config=cfg, with_slots=True):
        return cuda(config, meta, (room, room), slots=slots if with_slots else None,
                    host=HostShare(reserve=reserve))  # fmt: skip

    whole = at(need + 1000 + 7, reserve=7)
    assert (whole.reader, whole.decode_path) == ("tier", "device")
    assert "as large as memory holds: whole" in whole.reason("reader")
    # ... and it may be bounded at load (less memory by then): the ring's cut is resolved
    # for it, the config's choice included (before, the reader fell back to the default)
    assert whole.ring_cut == (8, 8) and not whole.reason("threads")
    few = at(need + 1000 + 7, 7, cfg.replace(ring_readers=4))
    assert few.ring_cut == (4, 4) and "used only if memory bounds it" in few.reason("ring")
    part = at(need + 1000 + 7, reserve=8)
    assert (part.reader, part.decode_path, part.bounded) == ("tier", "device", True)
    assert "at most what memory holds: the rest read by the native reader" in part.line()
    unweighed = at(10 * need, with_slots=False)
    assert (unweighed.bounded, unweighed.decode_path) == (True, "device")
    reads = at(need, config=cfg.replace(device_reads=True))  # bounded: through the ring
    assert reads == at(need) and (reads.reader, reads.decode_path) == ("tier", "device")
    host = at(need, config=cfg.replace(device_reads=False))
    assert (host.reader, host.decode_path, host.bounded) == ("tier", "host", True)
    with pytest.raises(ValueError, match="'auto'"):
        StreamConfig(swap_tier_gb="most")
    p = argparse.ArgumentParser()
    add_store_args(p)
    assert p.parse_args(["--swap-tier", "--swap-tier-gb", "auto"]).swap_tier_gb == "auto"
    assert p.parse_args(["--swap-tier", "--swap-tier-gb", "1.5"]).swap_tier_gb == 1.5


def test_cuda_takes_a_whole_swap_tier_where_the_files_do_not_fit_and_it_does(meta, monkeypatch):
    """Beyond half of memory, CUDA's default is the swap tier where the experts the
    pools do not hold fit beside what the trunk's load takes (the device path trades
    with it: 0.86 of stock at 50% in a 6 GB cgroup, against the page cache's host
    path's 0.16); where they do not, a tier bounded to what memory holds, the records
    beyond it asked of the request ring by the GPU (41.4 tok/s at 25% in 6 GB on an H100
    against the host path's 22.1 over the same tier, 2026-12-07b; the host path where the
    ring's staging has no room), and the files alone only where not even a record a layer
    fits; each saying why."""
    from mlx_streaming.core import runtime
    from mlx_streaming.core.io import engine_lib, tier
    from mlx_streaming.core.runtime import files_bytes

    monkeypatch.setattr(tier, "MARGIN", 1000)
    monkeypatch.setattr(runtime, "_linux", lambda: True)  # where O_DIRECT is the default
    monkeypatch.setattr(engine_lib, "direct_refused", lambda paths: "")  # any filesystem
    slots = {li: 4 for li in meta.layers}
    need = sum((meta.layers[li].num_experts - 4) * meta.layers[li].stride for li in slots)
    files = files_bytes(meta)
    assert need < files
    room = files + files // 2  # the files do not fit in half of it
    mem = (room, room)
    fits = cuda(StreamConfig(), meta, mem, slots=slots)
    assert (fits.mapped, fits.reader, fits.decode_path) == (False, "tier", "device")
    assert "the swap tier fits" in fits.line() and "--no-swap-tier" in fits.line()
    reads = cuda(StreamConfig(device_reads=True), meta, mem, slots=slots)
    assert (reads.reader, reads.decode_path) == ("tier", "device")  # not refused
    tight = (need + 999, need + 999)  # a whole tier and its margin do not fit: bounded
    short = cuda(StreamConfig(), meta, tight, slots=slots)
    assert (short.reader, short.decode_path, short.files_reader) == ("tier", "device", "native")
    assert "nor does a whole swap tier" in short.line() and "a bounded one" in short.line()
    assert "at most what memory holds" in short.line() and "--no-swap-tier" in short.line()
    from mlx_streaming.core.io.ring import DEVICE_ENTRIES
    from mlx_streaming.core.io.tier import staging_beside

    # the least tier: a record a layer, beside the margin and the request ring's staging,
    # through which both paths read the records beyond it (the files' reader stages one)
    stride = max(lay.stride for lay in meta.layers.values())
    assert staging_beside(meta, True) == stride + DEVICE_ENTRIES * stride
    one = sum(meta.layers[li].stride for li in slots) + staging_beside(meta, True)
    none = cuda(StreamConfig(), meta, (one + 999, one + 999), slots=slots)
    assert (none.reader, none.decode_path) == ("native", "host")
    assert "misses read from the files" in none.line()
    bare = cuda(StreamConfig(), meta, (one + 1000,) * 2, slots=slots)
    assert (bare.reader, bare.decode_path, bare.bounded) == ("tier", "device", True)
    assert "misses beyond it asked of the request ring" in bare.line(), bare.line()
    low = cuda(StreamConfig(device_reads=False), meta, (one + 1000,) * 2, slots=slots)
    assert (low.reader, low.decode_path, low.bounded) == ("tier", "host", True)
    # direct_io: the files beyond a tier bounded to what memory holds read around the
    # page cache, which has no room left (24.6 tok/s at 25% in 6 GB on an H100 against
    # 22.2 through it, 2026-12-06), where the filesystem takes O_DIRECT reads: the default;
    # --no-direct-io, or a bound of the user's (room beside it), through the page cache
    assert short.direct_io and "leaves the page cache no room" in short.line(), short.line()
    assert not cuda(StreamConfig(direct_io=False), meta, tight, slots=slots).direct_io
    given = cuda(StreamConfig(swap_tier=True, swap_tier_gb=1e-6), meta, tight, slots=slots)
    assert (given.reader, given.direct_io) == ("tier", False)
    auto = StreamConfig(swap_tier=True, swap_tier_gb="auto")
    assert cuda(auto, meta, tight, slots=slots).direct_io
    # an auto tier that resolves whole may be bounded at load (less memory by then): on
    # here too, turned off by the store where it comes out whole (test_exactness)
    assert cuda(auto, meta, mem, slots=slots).direct_io
    assert not fits.direct_io and not none.direct_io  # no tier, or nothing read beside it
    monkeypatch.setattr(engine_lib, "direct_refused", lambda paths: f"{paths[0]}: Invalid argument")
    tmpfs = cuda(StreamConfig(), meta, tight, slots=slots)
    assert (tmpfs.reader, tmpfs.direct_io) == ("tier", False)
    assert "O_DIRECT refused" in tmpfs.line() and "Invalid argument" in tmpfs.line()
    monkeypatch.setattr(engine_lib, "direct_refused", lambda paths: "")
    direct = cuda(StreamConfig(direct_io=True), meta, tight, slots=slots)
    assert (direct.reader, direct.decode_path, direct.direct_io) == ("tier", "device", True)
    assert cuda(StreamConfig(direct_io=True), meta, mem, slots=slots).decode_path == "device"
    alone = cuda(StreamConfig(direct_io=True), meta, (4 * files,) * 2, slots=slots)
    assert (alone.reader, alone.mapped) == ("native", False)
    assert "direct_io reads around the page cache" in alone.line()
    # the device path's reads over a bounded tier (the default, as asked for): the records
    # beyond it asked of the request ring, whose staging is left beside the tier;
    # --no-device-reads: the host path over the same tier
    ring = cuda(StreamConfig(device_reads=True), meta, tight, slots=slots)
    assert ring == short and ring.decode_path == "device"
    assert ring.bounded and short.bounded and not fits.bounded  # (the reader sizes it so)
    assert "asked of the request ring" in ring.line(), ring.line()
    host = cuda(StreamConfig(device_reads=False), meta, tight, slots=slots)
    assert (host.reader, host.decode_path, host.bounded) == ("tier", "host", True)
    least = one + 1000  # the least bounded tier and the ring beside it
    with pytest.raises(RuntimeChoiceError, match="device_reads: the GPU copies misses"):
        cuda(StreamConfig(device_reads=True), meta, (least - 1,) * 2, slots=slots)
    assert cuda(StreamConfig(device_reads=True), meta, (least,) * 2, slots=slots).reader == "tier"
    assert cuda(StreamConfig(), meta, (least,) * 2, slots=slots).decode_path == "device"
    trunk = room - need - 1000  # the trunk's load takes what is left beside the tier
    at = cuda(StreamConfig(), meta, mem, slots=slots, host=HostShare(reserve=trunk))
    assert (at.reader, at.decode_path) == ("tier", "device")
    over = cuda(StreamConfig(), meta, mem, slots=slots, host=HostShare(reserve=trunk + 1))
    assert (over.reader, over.bounded, over.decode_path) == ("tier", True, "device")  # bounded
    assert "for the trunk as it loads" in over.line(), over.line()
    # two ranks of a pipeline on this host: each plans with half of what is available
    halves = cuda(StreamConfig(), meta, mem, slots=slots, host=HostShare(ranks=2))
    assert (halves.bounded, halves.decode_path) == (True, "device")
    assert "(a share: 2 ranks on this host)" in halves.line()
    both = cuda(StreamConfig(), meta, (2 * room, 2 * room), slots=slots, host=HostShare(ranks=2))
    assert (both.reader, both.decode_path) == ("tier", "device")
    # a share is of what was available as the ranks met, never more than is left now
    assert HostShare(2, base=10).available(8) == 5 and HostShare(2, base=10).available(3) == 3
    assert HostShare(2).available(8) == 4 and HostShare().available(7) == 7
    for cfg in (StreamConfig(swap_tier=False), StreamConfig(prefetch=True)):  # not asked for
        rt = cuda(cfg, meta, mem, slots=slots)
        assert rt.reader == "native" and "swap tier" not in rt.line()
    no_slots = cuda(StreamConfig(), meta, memory=(room, room))  # pools unknown: not weighed
    assert no_slots.reader == "native"
    cpu = resolve(StreamConfig(), meta, backend="cpu", memory=(room, room),
                  engine_available=True, slots=slots)  # fmt: skip
    assert cpu.reader == "native"  # unified memory: a bigger pool does better


@pytest.mark.parametrize(
    "backend,cfg,match",
    [
        ("cpu", StreamConfig(device_reads=True), "device_reads: the GPU copies misses"),
        ("cpu", StreamConfig(map_files=True), "map_files lets the GPU copy records"),
        ("cpu", StreamConfig(pool_mode="cuda"), "needs MLX's CUDA backend"),
        ("cuda", StreamConfig(pool_mode="host"), "MLX's CUDA kernels do not read"),
        ("cuda", StreamConfig(reader="python", map_files=False), "reads into host slots only"),
        ("cuda", StreamConfig(reader="native"), "the GPU copies each record itself"),
        ("cuda", StreamConfig(device_reads=True, prefetch=True), "exclude each other"),
        ("cuda", StreamConfig(device_reads=True, map_files=False), "device_reads: the GPU"),
        ("cuda", StreamConfig(map_files=True, direct_io=True), "exclude each other"),
        ("cpu", StreamConfig(rows="masked", zero_slot=False), "points skipped rows at a zero"),
        ("cuda", StreamConfig(swap_tier=True, map_files=True), "swap_tier and map_files"),
        ("cpu", StreamConfig(swap_tier=True, direct_io=True), "swap_tier and direct_io"),
        ("cuda", StreamConfig(swap_tier=True, prefetch=True), "swap_tier and prefetch"),
        ("cpu", StreamConfig(swap_tier=True, reader="python"), "swap_tier and reader"),
        ("cpu", StreamConfig(swap_tier_gb=2.0), "add --swap-tier"),
    ],
)
def test_a_forced_choice_that_cannot_run_is_refused(meta, backend, cfg, match):
    with pytest.raises(RuntimeChoiceError, match=match):
        resolve(cfg, meta, backend=backend, memory=BIG, cuda_available=True,
                engine_available=True)  # fmt: skip


def test_without_the_engine(meta):
    """The CPU falls back to the Python reader, saying why; asked for, or on CUDA without
    mappings, the engine's absence is an error."""
    rt = resolve(StreamConfig(), meta, backend="cpu", engine_available=False)
    assert rt.reader == "python" and "not installed" in rt.reason("reader")
    with pytest.raises(RuntimeChoiceError, match="not installed"):
        resolve(StreamConfig(reader="native"), meta, backend="cpu", engine_available=False)
    with pytest.raises(RuntimeChoiceError, match="not installed"):
        cuda(StreamConfig(map_files=False), meta, engine=False)
    if sys.platform.startswith("linux"):  # O_DIRECT there needs the engine's aligned reads
        with pytest.raises(RuntimeChoiceError, match="direct_io needs it"):
            resolve(StreamConfig(direct_io=True), meta, backend="cpu", engine_available=False)


def test_macos_takes_the_python_reader_on_either_backend(meta, monkeypatch):
    """The engine has never run on macOS: a Mac's CPU backend reads as its GPU does."""
    monkeypatch.setattr(sys, "platform", "darwin")
    for b in ("cpu", "metal"):
        rt = resolve(StreamConfig(), meta, backend=b, engine_available=True)
        assert rt.reader == "python" and "untested off Linux" in rt.reason("reader"), b
        assert "reader python (the native reader is untested off Linux)" in rt.line()


def test_a_policy_without_its_library_says_so_once(monkeypatch):
    """The numpy ranking gives the same victims, slower: a warning, once per process."""
    from mlx_streaming.core.cache import native_policy

    monkeypatch.setattr(native_policy, "_lib", None)
    monkeypatch.setattr(native_policy, "library_path", lambda: None)
    with pytest.warns(UserWarning, match="ranked in numpy, slower; pip install"):
        assert native_policy.library() is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_policy.library() is None  # said once


def test_cuda_without_its_runtime_is_refused(meta):
    with pytest.raises(RuntimeChoiceError, match="libcudart"):
        resolve(StreamConfig(), meta, backend="cuda", memory=BIG, cuda_available=False)


def test_ids_transfers_that_fail_their_check_say_so(monkeypatch):
    """On CUDA the routing reaches the host through the ids' transfers if their start-up
    check passes; a failure falls back to MLX's own read, with a warning naming it."""
    import mlx.core as mx

    from mlx_streaming.core.io import cuda, transfers

    def broken():
        raise OSError("no mapped host memory")

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: None, raising=False)
    monkeypatch.setattr(transfers, "IdTransfers", broken)
    with pytest.warns(UserWarning, match="start-up check .*no mapped host memory.*exact"):
        got, why = transfers.id_transfers()
    assert got is None and "no mapped host memory" in why
    rt = resolve(StreamConfig(), backend="cpu")
    assert why in rt.revised({"ids": why}).line()  # the load line says it, as the store records it
