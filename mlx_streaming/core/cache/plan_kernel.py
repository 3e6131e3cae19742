"""The device path's plan kernel (CUDA): ``device_plan``'s step on the GPU, then the
copies it plans, in one kernel per layer call.

With a bounded swap tier (``SWAP`` 2) the planner also applies the tier's rule
(``device_tier.bounded_reference``): a miss in the tier trades places with its victim; a
miss outside it is asked of the engine's request ring (``io.ring``) at once, its victim
going out to the coldest row left. Every block then makes the trades, sends the victims
out, and waits for each read's answer (the planner's block watches the ring in host
memory and relays each answer through device memory; bounded by ``READ_WAIT_MS``, a read
that failed or was not answered traps, counted in ``LATE``) before copying it from staging
into its slot: a thread sends a slot's word out before it writes the read's word there.
"""

from __future__ import annotations

import numpy as np

from ..io.device_reader import copy_kernel
from ..io.kernels import Consts
from ..io.ring import READ_WAIT_S
from .device_plan import COUNTERS, POINTERS, constants, layer_arrays, scratch_arrays
from .device_tier import TIER_COPY, TIER_PLAN
from .scored import AGE_POW, HISTORY, LOG1P_REC, WINDOWS
from .slots import HEAT_DECAY, HEAT_LIMIT, HEAT_SHIFT

MAX_EXPERTS = 4096  # per layer (the kernel keeps a mark per expert in shared memory)
THREADS = 256

# The kernel, BLOCKS blocks of THREADS threads per call. The first block to take a
# ticket plans (the step above) and publishes its fills; every block then copies its share
# of them (``COPY_HEADER``'s ``mlxs_copy``, the host path's copy too), so a call is one
# kernel. A block waits only on a planner that is already running, so it needs no other
# block to be scheduled; a wait past WAIT_NS (a stalled device) traps: the call fails
# loudly rather than leave experts marked resident and unfilled. The last block out
# resets the flag and the tickets. ``after`` (the layer's previous output) is unread: it
# orders the layer's calls in any graph. Constants (``plan_constants``): N (ids), E, S, H,
# NREC, NAGE, NWIN, SCORE (some weight is not 0), WAIT_NS, READ_WAIT_MS, SWAP (1: a swap
# tier's records; 2: a bounded tier's, the rest read through the request ring), R (its rows);
# WORD, the copy word, is written into the source too. Inputs: ids [N], p
# [len(POINTERS)] addresses, meta (the layer's copy description), after. Output: slots [N].
PLAN_NAMES = (["ids", "p", "meta", "after"], ["slots"])  # the kernel's inputs, outputs
BLOCKS = 128
WAIT_NS = 2_000_000_000  # a constexpr int: under 2**31
READ_WAIT_MS = READ_WAIT_S * 1000  # a ring read's wait (io.ring)
_PLAN_BODY = """
    const int tid = threadIdx.x, nth = blockDim.x;
    __shared__ int fl[3 + 5 * N];  // the fills (a bounded tier's ops), as each block reads them
    __shared__ int role;  // the block's ticket: the first block to run plans
    if (tid == 0) role = atomicAdd(sync + 2, 1);
    __syncthreads();
    if (role == 0) {  // the plan: one block
    __shared__ int d[N], m[N], target[N], victim[N];
    __shared__ int nd, nm, nfree, nvict;
    __shared__ unsigned char ok[E];
    __shared__ unsigned char taken[R > 0 ? R : 1];  // a bounded tier's rows this call took
    __shared__ double best_s[32];
    __shared__ long long best_l[32];
    __shared__ int best_e[32];
    const long long t = tp[0];
    if (tid == 0) {  // the call's distinct experts, sorted; its misses; free slots
        int n = 0;
        for (int i = 0; i < N; i++) {
            int e = (int)ids[i], j = n;
            bool seen = false;
            for (int q = 0; q < n; q++) seen = seen || d[q] == e;
            if (seen) continue;
            while (j > 0 && d[j - 1] > e) { d[j] = d[j - 1]; j--; }
            d[j] = e;
            n++;
        }
        nd = n;
        int k = 0;
        for (int i = 0; i < n; i++) if (slot_of[d[i]] < 0) m[k++] = d[i];
        nm = k;
        int f = 0;
        for (int s = 0; ctr[FREE] > 0 && s < S && f < k; s++) if (expert_in[s] < 0) target[f++] = s;
        nfree = f;
        nvict = 0;
    }
    __syncthreads();
    const int need = nm - nfree;
    if (need > 0) {
        for (int e = tid; e < E; e += nth) ok[e] = resident[e] && !pinned[e];
        __syncthreads();
        for (int i = tid; i < nd; i += nth) ok[d[i]] = 0;
        __syncthreads();
        __shared__ int ncand;
        if (tid == 0) ncand = 0;
        __syncthreads();
        int mine = 0;
        for (int e = tid; e < E; e += nth) mine += ok[e];
        atomicAdd(&ncand, mine);
        __syncthreads();
        if (ncand <= need) {  // every candidate, in id order
            if (tid == 0)
                for (int e = 0; e < E; e++) if (ok[e]) victim[nvict++] = e;
        } else {
            const long long lastn = t - 1;
            for (int r = 0; r < need; r++) {
                double bs = 0.0;
                long long bl = 0;
                int be = -1;
                for (int e = tid; e < E; e += nth) {
                    if (!ok[e]) continue;
                    double s = 0.0;
                    if (SCORE) {
                        long long rec = last[e] >= 0 ? t - last[e] : NREC - 1;
                        rec = rec < 0 ? 0 : (rec > NREC - 1 ? NREC - 1 : rec);
                        if (w[0] != 0.0) s = __dadd_rn(s, __dmul_rn(w[0], log1p_rec[rec]));
                        const double now = lastn >= 0 ? cum[(lastn % H) * E + e] : 0.0;
                        for (int i = 0; i < NWIN; i++) {
                            const long long span = windows[i];
                            const double win = lastn >= span
                                ? __dsub_rn(now, cum[((lastn - span) % H) * E + e]) : now;
                            if (w[1 + i] != 0.0) s = __dadd_rn(s, __dmul_rn(w[1 + i], win));
                        }
                        if (w[1 + NWIN] != 0.0) {
                            float tr = 0.0f;
                            for (int i = 0; i < nd; i++) {
                                const float rr = row[d[i]];
                                tr = __fadd_rn(tr, __fdiv_rn(trans[(long long)d[i] * E + e],
                                                             rr > 1.0f ? rr : 1.0f));
                            }
                            s = __dadd_rn(s, __dmul_rn(w[1 + NWIN], (double)tr));
                        }
                        if (w[2 + NWIN] != 0.0) {
                            long long a = lastn - aged_at[e];
                            a = a < 0 ? 0 : (a > NAGE - 1 ? NAGE - 1 : a);
                            const double ag = __dmul_rn(aged[e], age_pow[a]);
                            s = __dadd_rn(s, __dmul_rn(w[2 + NWIN], ag));
                        }
                    }
                    const long long l = last[e];
                    if (be < 0 || s < bs || (s == bs && (l < bl || (l == bl && e < be)))) {
                        bs = s; bl = l; be = e;
                    }
                }
                for (int off = 16; off > 0; off >>= 1) {
                    const double os = __shfl_down_sync(0xffffffffu, bs, off);
                    const long long ol = __shfl_down_sync(0xffffffffu, bl, off);
                    const int oe = __shfl_down_sync(0xffffffffu, be, off);
                    if (oe >= 0 && (be < 0 || os < bs || (os == bs && (ol < bl ||
                        (ol == bl && oe < be))))) {
                        bs = os; bl = ol; be = oe;
                    }
                }
                if ((tid & 31) == 0) {
                    best_s[tid >> 5] = bs; best_l[tid >> 5] = bl; best_e[tid >> 5] = be;
                }
                __syncthreads();
                if (tid == 0) {
                    for (int q = 1; q < (nth + 31) / 32; q++) {
                        const int oe = best_e[q];
                        const double os = best_s[q];
                        const long long ol = best_l[q];
                        if (oe >= 0 && (be < 0 || os < bs || (os == bs && (ol < bl ||
                            (ol == bl && oe < be))))) {
                            bs = os; bl = ol; be = oe;
                        }
                    }
                    if (be >= 0) { victim[nvict++] = be; ok[be] = 0; }
                }
                __syncthreads();
            }
        }
    }
    __syncthreads();
    if (tid == 0) {  // evict, place the misses (ascending) in their slots, count
        const int placed = nfree + nvict;  // nvict <= need; fewer: misses without a slot
        for (int i = 0; i < nvict; i++) {
            const int v = victim[i], s = slot_of[v];
            slot_of[v] = -1;
            resident[v] = 0;
            target[nfree + i] = s;
            if (SWAP == 1) home[v] = home[m[nfree + i]];  // the victim takes the miss's home
        }
        if (SWAP != 2) fills[0] = placed;
        for (int i = 0; i < placed; i++) {
            const int e = m[i], s = target[i];
            expert_in[s] = e;
            slot_of[e] = s;
            resident[e] = 1;
            if (SWAP == 2) continue;  // the bounded tier's rule lists its ops below
            fills[1 + 2 * i] = SWAP ? home[e] : e;  // the record: its home, or its id
            fills[2 + 2 * i] = s;
            if (SWAP && home[e] < 0) ctr[FAILED] += 1;  // a defect: copied from nowhere
            if (SWAP) home[e] = -1;
        }
        if (SWAP == 2) TIER_PLAN
        ctr[HITS] += nd - nm;
        ctr[MISSES] += placed;
        ctr[EVICTIONS] += placed - nfree;
        ctr[MISSED_CALLS] += nm > 0;
        ctr[FAILED] += nm - placed;
        ctr[FREE] -= nfree;
    }
    __syncthreads();
    if (tid == 0) {  // the fills are out: the other blocks may copy
        __threadfence();
        atomicExch(sync, 1);
    }
    for (int i = tid; i < N; i += nth) {  // each row's slot
        const int s = slot_of[(int)ids[i]];
        slots[i] = s < 0 ? 0 : s;
    }
    // the ranking sees the lookup (Scored.access): transitions from the last lookup
    const int np = (int)nprev[0];
    for (int q = tid; q < np * nd; q += nth) {
        const long long a = prev[q / nd];
        trans[a * E + d[q % nd]] = __fadd_rn(trans[a * E + d[q % nd]], 1.0f);
    }
    for (int q = tid; q < np; q += nth) row[prev[q]] = __fadd_rn(row[prev[q]], 1.0f);
    double* cur = cum + (t % H) * E;
    const double* before = cum + ((t + H - 1) % H) * E;
    for (int e = tid; e < E; e += nth) cur[e] = t ? before[e] : 0.0;
    __syncthreads();
    for (int i = tid; i < nd; i += nth) {
        const int e = d[i];
        long long a = t - aged_at[e];
        a = a < 0 ? 0 : (a > NAGE - 1 ? NAGE - 1 : a);
        cur[e] = __dadd_rn(cur[e], 1.0);
        aged[e] = __dadd_rn(__dmul_rn(aged[e], age_pow[a]), 1.0);
        aged_at[e] = t;
        last[e] = t;
        prev[i] = e;
    }
    __syncthreads();
    if (tid == 0) {
        nprev[0] = nd;
        tp[0] = t + 1;
    }
    } else if (tid == 0) {  // wait for the plan's fills: the planner is running
        unsigned long long t0, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        while (((volatile int*)sync)[0] == 0) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - t0 > WAIT_NS) {  // never for a running planner: fail loudly, since
                atomicAdd((unsigned long long*)(ctr + LATE), 1ull);  // copying nothing
                __trap();  // would leave resident experts unfilled (LATE)
            }
            __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
    // every block copies its share of the fills (read past L1: __ldcg)
    if (tid < 3) fl[tid] = __ldcg(fills + tid);
    __syncthreads();
    const int nfl = SWAP == 2 ? 3 + 2 * (fl[0] + fl[1]) + 3 * fl[2] : 1 + 2 * fl[0];
    for (int i = (SWAP == 2 ? 3 : 1) + tid; i < nfl; i += nth) fl[i] = __ldcg(fills + i);
    __syncthreads();
    const long long gtid = (long long)blockIdx.x * nth + tid, gnth = (long long)gridDim.x * nth;
    if (SWAP == 2) {
        mlxs_tier_copy<WORD>(fl, meta, gtid, gnth, READ_WAIT_MS * 1000000ll,
                             (unsigned long long*)(ctr + LATE), sync + 3, role == 0);
    } else {
        mlxs_copy<WORD, SWAP>(fl, meta, gtid, gnth);
    }
    __syncthreads();
    if (tid == 0) {  // the last block out resets the flag and the tickets for the next call
        __threadfence();
        if (atomicAdd(sync + 1, 1) == (int)gridDim.x - 1) {
            sync[1] = 0;
            sync[2] = 0;
            sync[3] = 0;  // (a bounded tier's reads answered)
            atomicExch(sync, 0);
        }
    }
"""


_C_TYPES = {
    np.dtype(np.int32): "int",
    np.dtype(np.int64): "long long",
    np.dtype(np.uint8): "unsigned char",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}
_KERNEL_NAMES = {"counters": "ctr", "t": "tp", "weights": "w", "clock": "tclock"}  # in the body
_READ_ONLY = ("pinned", "weights", "windows", "log1p_rec", "age_pow")
_HEAT = (("HEAT_DECAY", HEAT_DECAY), ("HEAT_LIMIT", HEAT_LIMIT), ("HEAT_SHIFT", HEAT_SHIFT))


def _declarations() -> str:
    """The kernel's view of ``p``: each of ``POINTERS``, typed by its array's dtype, and
    the counters' indices, so the kernel and the host cannot disagree on either."""
    arrays = {**layer_arrays(1, 1, 1), **constants([0.0]), **scratch_arrays()}
    lines = []
    for i, name in enumerate(POINTERS):
        c = ("const " if name in _READ_ONLY else "") + _C_TYPES[arrays[name].dtype]
        lines.append(f"    {c}* {_KERNEL_NAMES.get(name, name)} = ({c}*)p[{i}];")
    lines += [f"    constexpr int {n} = {i};" for i, n in enumerate(COUNTERS)]
    lines += [f"    constexpr double {n} = {float(v).hex()};" for n, v in _HEAT]
    return "\n".join(lines) + "\n"


PLAN = _declarations() + _PLAN_BODY.replace("TIER_PLAN", TIER_PLAN)


def plan_constants(
    num_experts: int, capacity: int, n_ids: int, weights, swap: bool = False, rows=None
) -> Consts:
    """The kernel's constants for a call of ``n_ids`` ids (``kernels.Kernels`` writes
    them into its source); ``swap``: the records come from a swap tier and trade places
    with their victims (``plan_reference``); ``rows`` (not None): a bounded tier of that
    many rows, maybe 0 (``device_tier.bounded_reference``: misses outside it read through
    the request ring)."""
    return (
        ("N", n_ids),
        ("E", num_experts),
        ("S", capacity),
        ("H", HISTORY),
        ("NREC", len(LOG1P_REC)),
        ("NAGE", len(AGE_POW)),
        ("NWIN", len(WINDOWS)),
        ("SCORE", int(any(float(w) != 0.0 for w in weights))),
        ("WAIT_NS", WAIT_NS),
        ("READ_WAIT_MS", READ_WAIT_MS),
        ("SWAP", 2 if rows is not None else int(swap)),
        ("R", rows or 0),
    )


def plan_kernel(word: int):
    """The plan kernel's variants (``kernels.Kernels``) for copy words of ``word`` bytes."""
    return copy_kernel("mlxs_plan", PLAN, word, *PLAN_NAMES, header=TIER_COPY)
