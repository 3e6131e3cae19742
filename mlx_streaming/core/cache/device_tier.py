"""The device path's planning step over a bounded swap tier: its numpy references and
the pieces of the plan kernel (``plan_kernel``'s ``SWAP`` 2 variant) that do it on the
GPU (the design in benchmarks/RESULTS.md, "The design this opens").

A layer call's slots are chosen as over a whole tier (``device_plan.plan_reference``:
the slot table and its ``Scored`` ranking); then the tier's one rule
(``tier_moves.plan_moves``) says where each record goes: a miss in the tier trades
places with its victim; a miss outside it is read from its file (through the engine's
request ring, ``io.ring``), its victim going out to the first empty row, else the row of
the tier's coldest record (``heat``: ``SlotCache.heat``'s decayed lookups, kept here in
the same arithmetic), which is dropped. The tier's arrays are the layer's
(``device_plan.layer_arrays`` with ``rows``: ``home``, ``owner``, ``stamp``, ``heat``,
``heat_w``, ``clock``), handed between host and device whole, as the slot table is.

``ops``, what the kernel's copy blocks do, in this order: ``[brought, sent, reads, (row,
slot) * (brought + sent), (expert, slot) * reads]``: the first ``brought`` pairs trade a
row and a slot; the next ``sent`` copy a victim from its slot out to a row (its record
dropped); then each read's record comes from staging (request ring entry ``j`` for the
``j``-th read) into its slot. ``copy_reference`` moves numpy rows that way.

This call's lookups are added to ``heat`` before the rows are ranked (as the store's
simulator, ``planning.tiers``, does; the store adds them after): the rows a victim may
take never hold this call's experts, so the two rank alike except where the rescaling
below makes old heats equal.
"""

from __future__ import annotations

import numpy as np

from ..io.tier_moves import plan_moves
from .device_plan import plan_reference
from .slots import HEAT_DECAY, HEAT_LIMIT, HEAT_SHIFT


def access_heat(arrays: dict[str, np.ndarray], experts) -> None:
    """One call's lookups of distinct ``experts`` into a layer's ``heat``, to the bit as
    ``SlotCache.access`` adds them."""
    w = arrays["heat_w"][0] / HEAT_DECAY
    heat = arrays["heat"]
    for e in np.asarray(experts, np.int64).tolist():
        heat[e] += w
    if w > HEAT_LIMIT:
        heat[:] = np.ldexp(heat, HEAT_SHIFT)
        w = np.ldexp(w, HEAT_SHIFT)
    arrays["heat_w"][0] = w


def bounded_reference(
    layer: int, arrays: dict[str, np.ndarray], weights, ids
) -> tuple[np.ndarray, np.ndarray]:
    """One planning step over a bounded tier, updating ``arrays`` (``layer_arrays``
    with ``rows``) in place: ``(slot of each routed id, ops)`` (the module's text says
    what ``ops`` holds)."""
    held = arrays["expert_in"].tolist()  # each slot's record before the call: the victims
    slots, fills = plan_reference(arrays, weights, ids)
    access_heat(arrays, np.unique(np.asarray(ids, np.int64)))
    tables = [arrays["home"].tolist(), held, arrays["owner"].tolist(), arrays["stamp"].tolist()]
    moves = plan_moves(
        layer, tables, int(arrays["clock"][0]), fills[1::2], fills[2::2],
        lambda: arrays["heat"].tolist(), True,
    )  # fmt: skip
    home, _, owner, stamp = moves.tables
    arrays["home"][:], arrays["owner"][:], arrays["stamp"][:] = home, owner, stamp
    arrays["clock"][0] = moves.clock
    ops = [moves.brought, len(moves.trades) - moves.brought, len(moves.reads)]
    ops += [v for pair in [*moves.trades, *moves.reads] for v in pair]
    return slots, np.array(ops, np.int32)


def tier_to_arrays(arrays: dict[str, np.ndarray], tier, cache, layer: int) -> None:
    """Hand ``layer``'s bounded tier (``io.tier.SwapTier``) and its slot table's heat
    (``SlotCache``) to the device's image of its arrays."""
    arrays["home"][:], arrays["owner"][:] = tier.home[layer], tier.owner[layer]
    arrays["stamp"][:], arrays["clock"][0] = tier.stamp[layer], tier.clock
    arrays["heat"][:], arrays["heat_w"][0] = cache.heat, cache.heat_weight


def arrays_to_tier(arrays: dict[str, np.ndarray], tier, cache, layer: int) -> None:
    """``tier_to_arrays`` back, once the device is done: the tier's tables (each slot's
    record from the slot table), its clock run on from the later, and the heat."""
    tables = arrays["owner"], arrays["stamp"], int(arrays["clock"][0])
    tier.placed(layer, arrays["home"], arrays["expert_in"], *tables)
    cache.set_heat(arrays["heat"], arrays["heat_w"][0])


def copy_reference(ops, rows: np.ndarray, pool: np.ndarray, files: np.ndarray) -> None:
    """``ops`` on numpy rows of whole records (``rows [R, stride]`` the tier, ``pool [S,
    stride]``, ``files [E, stride]`` every record as its file holds it), for tests."""
    brought, sent, reads = (int(v) for v in ops[:3])
    pairs = np.asarray(ops[3 : 3 + 2 * (brought + sent)], np.int64).reshape(-1, 2)
    for i, (r, s) in enumerate(pairs):
        if i < brought:
            rows[r], pool[s] = pool[s].copy(), rows[r].copy()
        else:
            rows[r] = pool[s]
    start = 3 + 2 * (brought + sent)
    for e, s in np.asarray(ops[start : start + 2 * reads], np.int64).reshape(-1, 2):
        pool[s] = files[e]


# The plan kernel's (``plan_kernel``) planner, after it has placed the misses: the tier's
# rule above, the reads asked of the ring as soon as they are known.
TIER_PLAN = """{  // the bounded tier's rule (tier_moves.plan_moves; device_tier.bounded_reference)
            const int parts = (int)meta[2];
            int* words = (int*)meta[3 + 4 * parts];
            const int pos = (int)meta[6 + 4 * parts], entries = (int)meta[7 + 4 * parts];
            double hw = __ddiv_rn(heat_w[0], HEAT_DECAY);  // SlotCache.access's heat
            for (int i = 0; i < nd; i++) heat[d[i]] = __dadd_rn(heat[d[i]], hw);
            if (hw > HEAT_LIMIT) {  // scaled down, exactly, as the host does
                for (int e = 0; e < E; e++) heat[e] = scalbn(heat[e], HEAT_SHIFT);
                hw = scalbn(hw, HEAT_SHIFT);
            }
            heat_w[0] = hw;
            int* ops = fills + 3;
            int rd_e[N], rd_s[N], rd_v[N], rd_q[N];
            int nt = 0, nr = 0;
            long long c = tclock[0];
            for (int h = 0; h < R; h++) taken[h] = 0;
            for (int i = 0; i < placed; i++) {  // a miss in the tier trades with its victim
                const int e = m[i], s = target[i], v = i < nfree ? -1 : victim[i - nfree];
                const int h = home[e];
                if (h < 0) {  // a miss outside it is read from its file: asked for at once
                    rd_e[nr] = e;
                    rd_s[nr] = s;
                    rd_v[nr] = v;
                    rd_q[nr] = 0;  // no entry left (a defect): the copy traps
                    if (nr < entries) {
                        volatile int* q = words + 16 * nr;
                        const int seq = q[0] % 2147483647 + 1;  // io.ring's numbering
                        q[1] = pos;
                        q[2] = e;
                        asm volatile("st.release.sys.global.u32 [%0], %1;"
                                     :: "l"((int*)q), "r"(seq) : "memory");
                        rd_q[nr] = seq;
                    } else {
                        ctr[FAILED] += 1;
                    }
                    nr++;
                    continue;
                }
                c++;
                ops[2 * nt] = h;
                ops[2 * nt + 1] = s;
                nt++;
                taken[h] = 1;
                home[e] = -1;
                owner[h] = v;
                stamp[h] = c;
                if (v >= 0) home[v] = h;
            }
            const int brought = nt;
            for (int j = 0; j < nr; j++) {  // each read's victim to the coldest row left
                const int v = rd_v[j];
                if (v < 0) continue;
                int b = -1, bc = 0;
                double bh = 0.0;
                long long bs = 0;
                for (int h = 0; h < R; h++) {  // (empty first, heat, when written, row)
                    if (taken[h]) continue;
                    const int o = owner[h], cl = o >= 0;
                    const double ht = cl ? heat[o] : 0.0;
                    const long long st = stamp[h];
                    if (b < 0 || cl < bc || (cl == bc && (ht < bh || (ht == bh && st < bs)))) {
                        b = h;
                        bc = cl;
                        bh = ht;
                        bs = st;
                    }
                }
                if (b < 0) continue;  // no row left: the victim is dropped (in its file)
                c++;
                ops[2 * nt] = b;
                ops[2 * nt + 1] = rd_s[j];
                nt++;
                taken[b] = 1;
                if (owner[b] >= 0) home[owner[b]] = -1;  // dropped: it is in its file
                home[v] = b;
                owner[b] = v;
                stamp[b] = c;
            }
            tclock[0] = c;
            fills[0] = brought;
            fills[1] = nt - brought;
            fills[2] = nr;
            for (int j = 0; j < nr; j++) {
                ops[2 * nt + 2 * j] = rd_e[j];
                ops[2 * nt + 2 * j + 1] = rd_s[j];
                ops[2 * nt + 2 * nr + j] = rd_q[j];
            }
            ctr[READS] += nr;
        }"""

# A bounded tier's copies (``SWAP`` 2): the ops ``[brought, sent, reads, (row, slot)...,
# (expert, slot)..., request numbers...]`` (``device_tier``), ``meta`` the layer's copy
# description followed by the ring's entries, its staging, staging stride, the layer's
# position and the entry count. Staging is read past the caches (``__ldcv``).
TIER_COPY = """
template <typename W>
__device__ void mlxs_tier_copy(const int* f, const int64_t* meta, long long tid, long long nth,
                               long long wait_ns, unsigned long long* late, int* answered,
                               bool poller) {
    char* rows = (char*)(meta[0]);
    const int64_t stride = meta[1];
    const int parts = (int)meta[2];
    const int* words = (const int*)(meta[3 + 4 * parts]);
    char* staging = (char*)(meta[4 + 4 * parts]);
    const int64_t sstride = meta[5 + 4 * parts];
    const int brought = f[0], moved = f[0] + f[1], reads = f[2];
    for (int k = 0; k < moved; k++) {  // trades (brought), then victims out to rows (sent)
        char* rec = rows + (int64_t)f[3 + 2 * k] * stride;
        if (k < brought) mlxs_parts<W, MLXS_SWAP>(rec, f[4 + 2 * k], meta, tid, nth);
        else mlxs_parts<W, MLXS_OUT>(rec, f[4 + 2 * k], meta, tid, nth);
    }
    const int* rd = f + 3 + 2 * moved;
    __shared__ int ready;
    for (int j = 0; j < reads; j++) {  // each read, once the ring answers it, into its slot
        if (threadIdx.x == 0) {  // the planner's block watches the ring (the host's memory),
            // and relays each answer to the other blocks in ``answered`` (the device's)
            const int want = rd[2 * reads + j];
            const int* done = words + 16 * j + 3;
            unsigned long long t0, now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            int v = 0, ok = 0;
            while (poller && want != 0) {
                asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(done) : "memory");
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (v == want || now - t0 > (unsigned long long)wait_ns) break;
                __nanosleep(128);
            }
            if (poller) {
                ok = want != 0 && v == want && ((volatile const int*)done)[1] == 0;
                __threadfence();
                atomicExch(answered, ok ? j + 1 : -1);  // -1: failed, or not answered in time
            }
            while (!poller) {  // (the planner's block runs: a wait on it needs no other)
                v = ((volatile int*)answered)[0];
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (v > j || v < 0 || now - t0 > (unsigned long long)wait_ns + 100000000ull) break;
                __nanosleep(64);
            }
            __threadfence();
            ready = poller ? ok : v > j;
        }
        __syncthreads();
        if (!ready) {  // unanswered in time, or failed: its slot would hold wrong bytes
            if (threadIdx.x == 0) atomicAdd(late, 1ull);
            __trap();
        }
        mlxs_parts<W, MLXS_FRESH>(staging + (int64_t)j * sstride, rd[2 * j + 1], meta, tid, nth);
        __syncthreads();
    }
}
"""
