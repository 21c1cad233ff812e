"""The compiled executor's loop (numba): ``core=compiled`` (sim/compiled.py drives it).

It replays what the SimPy executor (sim/engine.py, stepping every iteration) and the cluster
(sim/cluster.py) do for the policies it covers (``iteration``: TGI's router; Algorithm 1:
``alg1``, ``layer``, ``qllm``; under ``reserve`` memory), on typed arrays instead of Python
objects: the same events in the same
order (SimPy's: time, then priority, then the order they were scheduled in), the same float
operations in the same order, so every request's times and token gaps come out to the bit
(tests/test_compiled.py compares them). What needs the routing model's random generator (a
pool not built yet, a block of picks) is handed back to Python, which calls the very
``RoutingModel`` and ``LatencyModel`` methods the SimPy executor calls, and the loop goes on
where it stopped. Its own fast-forward, decode runs (``run``), skips work at an iteration's
end that the policy would follow with the same batch, not events: the results stay
stepping's, events and all.

Everything here is a plain function of a few arrays (the layout is in the constants below,
shared with sim/compiled.py): a call between compiled functions costs some 8 ns per array
it passes, so the state lives in a handful of 2-D arrays rather than many 1-D ones.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# --- what run() returns
DONE, NEED_EXPERTS, NEED_PICKS, FLUSH, ERR_CAPACITY, ERR_BATCH_CAP, ERR_STALL = range(7)

# --- event kinds (heap), and SimPy's priorities
EV_ARRIVAL_INIT, EV_EXEC_INIT, EV_ARRIVAL, EV_ITER, EV_WAKE = range(5)
EV_SWITCH, EV_INTERRUPT, EV_BOUNDARY = 5, 6, 7  # a resume's switch; an arrival's interrupt;
# the run to a preemptible boundary (or the end) after it
URGENT, NORMAL = 0, 1
# heap rows H[k, ...]: time, priority, event id, kind, replica, tag (all float64: ids are
# < 2**53); an iteration's end whose tag is no longer its replica's R_TAG was interrupted
H_T, H_P, H_E, H_K, H_R, H_TAG = range(6)
H_COLS = 6

# --- global int state g[...]
G_EID = 0  # SimPy's event counter
G_NEXT = 1  # the next request the arrival process admits
G_ARRIVALS_DONE = 2
G_HEAP = 3  # events in the heap
G_FIN = 4  # finished requests (fin[]) so far
G_TL = 5  # timeline rows so far
G_ARG = 6  # a request index or a token count, for the status returned
G_ARR_EVENTS = 7  # timeouts the arrival process waited
G_PENDING = 8  # replica whose selected batch waits for its plan (-1: none)
G_PENDING_MODE = 9  # 1: Python computed its experts (gf[GF_SUM]); 2: retry in the loop
G_RR = 10  # round robin's next replica
G_TOP = 11  # the gap arena's first free slot
G_FLUSHED = 12  # fin[] up to here was handed to Python
G_NEED = 13  # picks needed (NEED_PICKS)
G_POPS = 14  # events taken off the heap (a decode run's iterations mostly skip it)
G_SIZE = 15

# --- global float state gf[...]
GF_NOW, GF_MAKESPAN, GF_SUM = 0, 1, 2  # GF_SUM: the experts' time Python computed
GF_SIZE = 3

# --- per-replica int state ri[r, ...]
R_STATE = 0  # ST_*
R_PHASE = 1  # of the batch running: 1 prefill, 2 decode
R_W_HEAD, R_W_TAIL, R_W_N, R_W_LS, R_W_RESERVED = 2, 3, 4, 5, 6  # the waiting FIFO
R_WAITING_TOKENS, R_DECODE_NEXT = 7, 8  # TGI's counter; a join was just prefilled
R_USED, R_PEAK, R_IN_SYS, R_ITERS, R_EVENTS = 9, 10, 11, 12, 13
R_N_READY, R_READY_LS, R_N_BATCH = 14, 15, 16
R_PICKS, R_TAKEN = 17, 18  # picks in its block (PB[r]); picks taken of them
# Algorithm 1 (alg1, layer, qllm): the BE waiting FIFO (the LS one is R_W_HEAD/TAIL, R_W_LS
# long); the decode queues as rings (LS: R_READY_LS long from R_RH_LS; BE: R_RN_BE from
# R_RH_BE); R_N_READY counts both
R_WH_BE, R_WT_BE, R_RH_LS, R_RH_BE, R_RN_BE = 19, 20, 21, 22, 23
# the running batch: cursor, new tokens, whether it holds LS work, its experts (the pool and
# pick, or -1: ET[r]), whether OFF[r, 0] holds its offsets
R_CURSOR, R_NEW_TOKENS, R_HAS_LS, R_EPOOL, R_EPICK, R_OFF_OK = 24, 25, 26, 27, 28, 29
# the suspended batch (at most one: see _select_alg1): size, phase, cursor, new tokens,
# whether it holds LS work, activation tokens held
R_S_N, R_S_PHASE, R_S_CURSOR, R_S_NEW, R_S_HAS_LS, R_S_HELD = 30, 31, 32, 33, 34, 35
# an arrival may interrupt the iteration; the iteration end's tag; the boundary the run
# after an interrupt stops at and whether it suspends there; preemptions so far
R_INTERRUPTIBLE, R_TAG, R_BOUNDARY, R_SUSPENDS, R_PREEMPTS = 36, 37, 38, 39, 40
# a decode run (see run): whether the batch's next selection repeats it until an arrival
# to this replica; iterations until one of its sequences finishes (this one counted); the
# longest context (prompt + generated) as of the iteration running; iterations ended whose
# per-sequence updates wait in RUNT[r] (their end times); iterations so run, in all; the
# batch's LS sequences, reservation, and (TGI) the size of the join its selection dry-runs
R_RUN, R_RUN_LEFT, R_KV, R_DEFER, R_RUN_ITERS, R_RUN_LS, R_RUN_RESERVED = range(41, 48)
R_RUN_TAKEN = 48
R_SIZE = 49
ST_NEW, ST_RUNNING, ST_WAITING, ST_WAKING, ST_DONE = range(5)
READY, BATCH, READY_BE, SUSPENDED = 0, 1, 2, 3  # lists[r, ...]: READY is alg1's LS ring

# --- per-replica float state rf[r, ...]
RF_START, RF_BUSY = 0, 1
# the running batch's plan: total, and its stage times (Plan: overhead, attention, router,
# lm_head); the offset its last lookup started from; the suspended batch's total
RF_TOTAL, RF_OV, RF_ATT, RF_RT, RF_LM, RF_LOOK_OFF, RF_S_TOTAL = 2, 3, 4, 5, 6, 7, 8
RF_SIZE = 9

# --- requests: REQ[i, ...] (int), SI[i, ...] (int state), SF[i, ...] (float state)
Q_PROMPT, Q_OUT, Q_LS = 0, 1, 2
S_GEN, S_OFF, S_NXT, S_PLACED = 0, 1, 2, 3  # tokens generated; gap slice; FIFO link; replica
S_PREEMPTIONS = 4  # times a batch holding it was suspended
SI_COLS = 5
S_FIRST, S_LAST, S_FIN, S_ITL = 0, 1, 2, 3  # first, last token, finish; largest gap (float32)

# --- config ci[...], cf[...]
C_REPLICAS, C_ROUTER, C_LS_REPLICAS, C_MAX_BATCH, C_MAX_PREFILL = 0, 1, 2, 3, 4
C_MAX_WAITING, C_MAX_TOTAL, C_CAPACITY, C_LAYERS = 5, 6, 7, 8
C_RUNS, C_POOLED_MAX = 9, 10  # whether decode batches run as decode runs (see run)
C_PER_PROMPT, C_FLUSH_EVERY, C_ARENA_FREE = 11, 12, 13
# MEMO[c, x] (NaN: not yet) holds curve c at x below these: its grid's end, or MEMO's width
C_MEMO_ROUTER, C_MEMO_SIZE = 14, 15
# the policy: 0 iteration (TGI), 1 Algorithm 1 (alg1, layer, qllm); its granularity
# (policies.core.Granularity); alg1's refill_be, fill_be_prefill, max_in_flight; layer's
# preempt_prefill; whether the profile has preempt_switch; stages of an iteration; experts
C_POLICY, C_GRAN, C_REFILL, C_FILL, C_MAX_IN_FLIGHT, C_PREEMPT_PREFILL = 16, 17, 18, 19, 20, 21
C_SWITCH, C_STAGES, C_EXPERTS = 22, 23, 24
C_SIZE = 25
G_ITERATION, G_ROUTER, G_LAYER, G_EXPERT = 1, 2, 3, 4
CF_RATIO, CF_GRID_X, CF_GRID_Y, CF_SLOPE = 0, 1, 2, 3  # the expert curve's end and slope
CF_ACT = 4  # activation tokens per token (a suspended batch holds them)
CF_SIZE = 5
ROUTER_CODES = {"round_robin": 0, "least_outstanding": 1, "least_kv": 2, "ls_dedicated": 3,
                "ls_first": 4}  # fmt: skip
NO_CAP = 1 << 62  # a limit that is null (no cap)

# --- curves. CV[c * 2], CV[c * 2 + 1]: curve c's first row and rows; CV[CV_ROWS]: rows in
# all; row j: CV[CV_ROW0 + 3 j + (0, 1, 2)] = its row key (Curve2D's batch size), where its
# points start in CF, how many: CF holds the xs, then the ys, then the slope. A Curve1D is a
# curve of one row. BEY[r, j]: the largest input row j extrapolated on replica r (NaN: none);
# BEY[r, CV[CV_ROWS] + c]: curve c's largest row key beyond its last row; BEY[r, CV[CV_ROWS] +
# CURVES]: the expert curve's largest count beyond its grid.
OVERHEAD, ROUTER, LM_HEAD, ATTN_DECODE, ATTN_PREFILL, SWITCH = range(6)
CURVES = 6
CV_ROWS = 2 * CURVES
CV_ROW0 = CV_ROWS + 1


@njit(cache=True)
def _row(CF, BEY, r, j, lo, n, x):
    """Curve1D.scalar of row j (n points from CF[lo]) at x, with its operations in its
    order, on replica r."""
    last = CF[lo + n - 1]
    if x >= last:
        y = CF[lo + 2 * n - 1] + CF[lo + 2 * n] * (x - last)
        if x > last and (math.isnan(BEY[r, j]) or x > BEY[r, j]):
            BEY[r, j] = x
        return y
    if x <= CF[lo]:
        return CF[lo + n]
    a, b = lo, lo + n  # bisect_right(xs, x) - 1
    while a < b:
        mid = (a + b) // 2
        if x < CF[mid]:
            b = mid
        else:
            a = mid + 1
    i = a - 1
    y0 = CF[i + n]
    return y0 + (CF[i + n + 1] - y0) * (x - CF[i]) / (CF[i + 1] - CF[i])


@njit(cache=True)
def curve(CF, CV, BEY, c, r, b, x):
    """Curve c's Curve2D.__call__(b, x) on replica r (a Curve1D's scalar(x) when it has one
    row)."""
    first, n = CV[2 * c], CV[2 * c + 1]
    if n == 1:  # a Curve1D (row key 0, read at b = 0), or a Curve2D of one row: held past it
        k = CV_ROW0 + 3 * first
        if b > CV[k]:
            col = CV[CV_ROWS] + c
            if math.isnan(BEY[r, col]) or BEY[r, col] < b:
                BEY[r, col] = b
        return _row(CF, BEY, r, first, CV[k + 1], CV[k + 2], x)
    a, hi = 0, n  # bisect_right(row keys, b) - 1, clamped to [0, n - 2]
    while a < hi:
        mid = (a + hi) // 2
        if b < CV[CV_ROW0 + 3 * (first + mid)]:
            hi = mid
        else:
            a = mid + 1
    i = first + min(max(a - 1, 0), n - 2)
    k0, k1 = CV_ROW0 + 3 * i, CV_ROW0 + 3 * (i + 1)
    x0, x1 = CV[k0], CV[k1]
    y0 = _row(CF, BEY, r, i, CV[k0 + 1], CV[k0 + 2], x)
    y1 = _row(CF, BEY, r, i + 1, CV[k1 + 1], CV[k1 + 2], x)
    if b <= x0:
        return y0
    if b >= x1:
        col = CV[CV_ROWS] + c
        if b > x1 and (math.isnan(BEY[r, col]) or BEY[r, col] < b):
            BEY[r, col] = b
        d = y1 - y0
        return y1 + (d if d >= 0.0 else 0.0) * (b - x1) / (x1 - x0)
    return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


@njit(cache=True)
def _leaf_sum(a, lo, n):
    """numpy's pairwise sum of a block of at most 128 values: 8 accumulators."""
    if n < 8:
        s = 0.0
        for i in range(lo, lo + n):
            s += a[i]
        return s
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    m = n - n % 8
    while i < m:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        s += a[lo + i]
        i += 1
    return s


@njit(cache=True)
def pairwise_sum(a, lo, n):
    """numpy's float64 sum of a[lo:lo + n]: its pairwise summation (blocks of 128 split in
    halves, a multiple of 8 on the left), the same float. Iterative: numba's cache does not
    load recursive functions safely."""
    if n <= 128:
        return _leaf_sum(a, lo, n)
    los = np.empty(64, dtype=np.int64)
    ns = np.empty(64, dtype=np.int64)
    right = np.zeros(64, dtype=np.bool_)  # the frame's left half is summed (in lefts)
    lefts = np.empty(64)
    top, los[0], ns[0], right[0] = 0, lo, n, False
    v, have = 0.0, False
    while True:
        if have:  # v is the sum of frame top + 1: hand it to frame top
            if top < 0:
                return v
            if not right[top]:
                lefts[top], right[top], have = v, True, False
                h = ns[top] // 2
                h -= h % 8
                top += 1
                los[top], ns[top], right[top] = los[top - 1] + h, ns[top - 1] - h, False
            else:
                v = lefts[top] + v
                top -= 1
            continue
        m = ns[top]
        if m <= 128:
            v, have = _leaf_sum(a, los[top], m), True
            top -= 1
            continue
        h = m // 2
        top += 1
        los[top], ns[top], right[top] = los[top - 1], h - h % 8, False


# -------------------------------------------------------------------------------------- heap
@njit(cache=True)
def schedule(g, H, t, prio, kind, r, tag=0):
    """SimPy's ``schedule``: the event gets the next id; the heap orders by (time,
    priority, id)."""
    n = g[G_HEAP]
    e = g[G_EID]
    g[G_EID] = e + 1
    g[G_HEAP] = n + 1
    while n > 0:  # sift up: move parents below the new event down
        parent = (n - 1) // 2
        pt, pp = H[parent, H_T], H[parent, H_P]
        if t > pt or (t == pt and (prio > pp or (prio == pp and e > H[parent, H_E]))):
            break
        for col in range(H_COLS):
            H[n, col] = H[parent, col]
        n = parent
    H[n, H_T], H[n, H_P], H[n, H_E], H[n, H_K], H[n, H_R] = t, prio, e, kind, r
    H[n, H_TAG] = tag


@njit(cache=True)
def _before(H, i, j):
    ti, tj = H[i, H_T], H[j, H_T]
    if ti != tj:
        return ti < tj
    if H[i, H_P] != H[j, H_P]:
        return H[i, H_P] < H[j, H_P]
    return H[i, H_E] < H[j, H_E]


@njit(cache=True)
def _pop(g, H):
    """Remove the first event; it is left in row H.shape[0] - 1 (the heap never fills)."""
    spare = H.shape[0] - 1
    for col in range(H_COLS):
        H[spare, col] = H[0, col]
    n = g[G_HEAP] - 1
    g[G_HEAP] = n
    if n > 0:
        for col in range(H_COLS):
            H[0, col] = H[n, col]
        i = 0
        while True:
            left, right, best = 2 * i + 1, 2 * i + 2, i
            if left < n and _before(H, left, best):
                best = left
            if right < n and _before(H, right, best):
                best = right
            if best == i:
                break
            for col in range(H_COLS):
                H[i, col], H[best, col] = H[best, col], H[i, col]
            i = best


# -------------------------------------------------------------------------------- the loop
@njit(cache=True)
def run(g, gf, ci, cf, H, ri, rf, lists, req_t, REQ, SI, SF, arena, fin, TL, CF, CV, BEY, MEMO,
        EXP, PC, PF, PS, PB, OFF, ET, RUNT):  # fmt: skip
    """Process events until the run ends (DONE), an error, or Python is needed (a pool, a
    block of picks, or a flush of finished requests: FLUSH); call again to go on.

    Decode runs: when a decode batch is selected that the policy would select again and
    again until one of its sequences finishes or a request arrives at its replica
    (``_run_left``), the iterations before that end skip the per-sequence work stepping
    does at each end (``_complete``, the selection, the context's maximum): their end times
    wait in RUNT[r] and ``_materialise`` applies them, gap by gap as ``_complete`` would,
    before anything reads or moves the batch's sequences (an iteration that does not
    repeat the run, a boundary). Every event still happens in SimPy's order, each iteration
    planned with its own draws, so results stay equal to the bit."""
    spare = H.shape[0] - 1
    while True:
        if g[G_PENDING] >= 0:  # a batch selected before we returned waits for its plan
            r = g[G_PENDING]
            status = _plan(g, gf, ci, cf, ri, rf, lists, REQ, SI, CF, CV, BEY, MEMO, EXP, PC, PF,
                           PS, PB, ET, r, g[G_PENDING_MODE] == 1)  # fmt: skip
            if status != DONE:
                return status
            g[G_PENDING] = -1
            _launch(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r)
        if g[G_FIN] - g[G_FLUSHED] >= ci[C_FLUSH_EVERY] or len(arena) - g[G_TOP] < ci[C_ARENA_FREE]:
            return FLUSH
        if g[G_HEAP] == 0:
            return DONE
        _pop(g, H)
        g[G_POPS] += 1
        t, kind, r = H[spare, H_T], int(H[spare, H_K]), int(H[spare, H_R])
        gf[GF_NOW] = t
        if kind == EV_ARRIVAL_INIT or kind == EV_ARRIVAL:
            status = _arrivals(g, gf, ci, cf, H, ri, rf, lists, req_t, REQ, SI, TL,
                               kind == EV_ARRIVAL)  # fmt: skip
            if status != DONE:
                return status
            continue
        if kind == EV_ITER:
            if H[spare, H_TAG] != ri[r, R_TAG]:  # interrupted: SimPy drops it unseen
                continue
            ri[r, R_EVENTS] += 1
            ri[r, R_INTERRUPTIBLE] = 0
            rf[r, RF_BUSY] += t - rf[r, RF_START]
            launched = False
            while (not launched and ri[r, R_RUN] and ri[r, R_RUN_LEFT] > 1
                   and (ci[C_POLICY] or _tgi_decodes(ci, cf, ri, r))):  # fmt: skip
                # a decode run goes on: no one finishes, the selection gives the same batch
                d = ri[r, R_DEFER]
                if d == RUNT.shape[1]:
                    _materialise(ri, lists, SI, SF, arena, RUNT, r)
                    d = 0
                RUNT[r, d] = t
                ri[r, R_DEFER] = d + 1
                ri[r, R_RUN_ITERS] += 1
                ri[r, R_RUN_LEFT] -= 1
                ri[r, R_ITERS] += 1
                ri[r, R_WAITING_TOKENS] += 1
                ri[r, R_KV] += 1
                status = _plan(g, gf, ci, cf, ri, rf, lists, REQ, SI, CF, CV, BEY, MEMO, EXP,
                               PC, PF, PS, PB, ET, r, False)  # fmt: skip
                if status != DONE:
                    g[G_PENDING] = r
                    return status
                end = t + (rf[r, RF_TOTAL] - 0.0)  # as _launch (or _begin, from cursor 0)
                if (g[G_HEAP] and end >= H[0, H_T]) or (
                    ri[r, R_W_LS] and not ri[r, R_HAS_LS] and _wants(ci, cf, ri, REQ, r)
                ):
                    _launch(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r)
                    launched = True
                else:  # no other event comes first: the iteration's end, as _launch
                    g[G_EID] += 1  # schedules it and the pop gives it, without the heap
                    rf[r, RF_START], rf[r, RF_LOOK_OFF] = t, 0.0
                    ri[r, R_CURSOR], ri[r, R_OFF_OK] = 0, 0
                    t = end
                    gf[GF_NOW] = t
                    ri[r, R_EVENTS] += 1
                    rf[r, RF_BUSY] += t - rf[r, RF_START]
            if launched:
                continue
            if ri[r, R_DEFER]:
                _materialise(ri, lists, SI, SF, arena, RUNT, r)
            _complete(g, ci, ri, lists, REQ, SI, SF, arena, fin, TL, t, r)
        elif kind == EV_WAKE:
            ri[r, R_EVENTS] += 1
        elif kind == EV_SWITCH:  # a resumed batch's saved state is back: its lookup starts
            ri[r, R_EVENTS] += 1
            if t > rf[r, RF_START]:
                rf[r, RF_BUSY] += t - rf[r, RF_START]
                rf[r, RF_START] = t
            _begin(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r)
            continue
        elif kind == EV_INTERRUPT:
            _interrupt(g, gf, ci, cf, H, ri, rf, EXP, PC, OFF, ET, r)
            continue
        elif kind == EV_BOUNDARY:
            ri[r, R_EVENTS] += 1
            rf[r, RF_BUSY] += t - rf[r, RF_START]
            if ri[r, R_DEFER]:
                _materialise(ri, lists, SI, SF, arena, RUNT, r)
            if ri[r, R_SUSPENDS]:
                ri[r, R_CURSOR] = ri[r, R_BOUNDARY]
                status = _suspend(g, cf, ri, rf, lists, REQ, SI, OFF, r)
                if status != DONE:
                    return status
            else:
                _complete(g, ci, ri, lists, REQ, SI, SF, arena, fin, TL, t, r)
        # the executor's step: select the next batch and plan it, or wait
        if ci[C_POLICY] == 0:
            status = _select(g, ci, cf, ri, lists, REQ, SI, r)
        else:
            status = _select_alg1(g, ci, ri, lists, REQ, SI, r)
        if status != DONE:
            return status
        phase = ri[r, R_PHASE]
        ri[r, R_RUN_LEFT] = _run_left(ci, ri, lists, REQ, SI, r) if phase == 2 else 0
        ri[r, R_RUN] = ri[r, R_RUN_LEFT] > 1
        if phase == 0:  # nothing to run
            if g[G_ARRIVALS_DONE]:
                if ri[r, R_IN_SYS]:
                    g[G_ARG] = r
                    return ERR_STALL
                ri[r, R_STATE] = ST_DONE
                gf[GF_MAKESPAN] = t
            else:
                ri[r, R_STATE] = ST_WAITING
            continue
        ri[r, R_STATE] = ST_RUNNING
        if phase == 3:  # a suspended batch resumes: its plan kept, its saved state restored
            if not _resume(g, ci, H, ri, rf, lists, CF, CV, BEY, OFF, t, r):
                _begin(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r)
            continue
        status = _plan(g, gf, ci, cf, ri, rf, lists, REQ, SI, CF, CV, BEY, MEMO, EXP, PC, PF, PS,
                       PB, ET, r, False)  # fmt: skip
        if status != DONE:
            g[G_PENDING] = r
            return status
        _launch(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r)


@njit(cache=True, inline="always")
def _launch(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r):
    """A fresh batch, planned, starts: one timeout to its end, or (a policy that preempts
    inside an iteration) ``_begin``'s lookup."""
    now = gf[GF_NOW]
    rf[r, RF_START] = now
    ri[r, R_CURSOR] = 0
    ri[r, R_OFF_OK] = 0
    if ci[C_GRAN] <= G_ITERATION:
        schedule(g, H, now + (rf[r, RF_TOTAL] - 0.0), NORMAL, EV_ITER, r, ri[r, R_TAG])
    else:
        _begin(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r)


@njit(cache=True)
def _begin(g, gf, ci, cf, H, ri, rf, REQ, EXP, PC, OFF, ET, r):
    """Simulation._run_lookup from the batch's cursor: if the policy already wants the
    processor back (an arrival during a switch), run to the next preemptible boundary
    (``_to_next_allowed``); else one timeout to the end, which an arrival may interrupt."""
    now = gf[GF_NOW]
    cursor = ri[r, R_CURSOR]
    end = ci[C_STAGES]
    if ri[r, R_W_LS] and not ri[r, R_HAS_LS] and _wants(ci, cf, ri, REQ, r):
        _offsets(ci, cf, ri, rf, EXP, PC, OFF, ET, r)
        start = now - OFF[r, 0, cursor]
        target = _allowed_after(ci, cursor)
        ahead = target >= 0
        if not ahead:
            target = end
        delay = max(0.0, start + OFF[r, 0, target] - now)
        ri[r, R_BOUNDARY], ri[r, R_SUSPENDS] = target, 1 if ahead else 0
        schedule(g, H, now + delay, NORMAL, EV_BOUNDARY, r)
        return
    offset = OFF[r, 0, cursor] if cursor else 0.0
    rf[r, RF_LOOK_OFF] = offset
    rf[r, RF_START] = now
    ri[r, R_INTERRUPTIBLE] = 1
    schedule(g, H, now + (rf[r, RF_TOTAL] - offset), NORMAL, EV_ITER, r, ri[r, R_TAG])


@njit(cache=True)
def _allowed_after(ci, cursor):
    """The first boundary the policy's granularity may preempt at after ``cursor`` (inner
    boundaries only), or -1 (``Plan.preemptible``'s list)."""
    gran, stages = ci[C_GRAN], ci[C_STAGES]
    per = 2 + ci[C_EXPERTS]
    if gran == G_EXPERT:
        return cursor + 1 if cursor + 1 <= stages - 1 else -1
    for layer in range(ci[C_LAYERS]):
        first = 1 + layer * per
        if gran == G_ROUTER:
            if first + 2 > cursor:
                return first + 2
        else:
            for b in range(first, first + 3):
                if b > cursor:
                    return b
    if gran == G_LAYER and 1 + ci[C_LAYERS] * per > cursor:
        return 1 + ci[C_LAYERS] * per
    return -1


@njit(cache=True)
def _wants(ci, cf, ri, REQ, r):
    """Scheduler.should_preempt under LayerPreemptive.wants_preempt (no starvation guard,
    no eviction): a running batch without LS work gives way once an LS job waits, may be
    admitted, and its reservation plus the batch's saved activations fit."""
    if ci[C_GRAN] <= G_ITERATION or ri[r, R_PHASE] == 0 or ri[r, R_HAS_LS]:
        return False
    if ri[r, R_W_LS] == 0 or (not ci[C_PREEMPT_PREFILL] and ri[r, R_PHASE] == 1):
        return False
    if _in_flight(ri, r) + ri[r, R_N_BATCH] >= ci[C_MAX_IN_FLIGHT]:
        return False
    head = ri[r, R_W_HEAD]
    need = REQ[head, Q_PROMPT] + REQ[head, Q_OUT] + math.ceil(ri[r, R_NEW_TOKENS] * cf[CF_ACT])
    return ri[r, R_USED] + need <= ci[C_CAPACITY]


@njit(cache=True, inline="always")
def _in_flight(ri, r):
    """Algorithm1.in_flight without the running batch: decode-ready and suspended."""
    return ri[r, R_N_READY] + ri[r, R_S_N]


@njit(cache=True)
def _offsets(ci, cf, ri, rf, EXP, PC, OFF, ET, r):
    """Plan.offsets of the running batch in OFF[r, 0] (np.cumsum's sums, in its order; the
    last is the plan's total), if not there yet."""
    if ri[r, R_OFF_OK]:
        return
    layers, experts = ci[C_LAYERS], ci[C_EXPERTS]
    att, rt = rf[r, RF_ATT], rf[r, RF_RT]
    pool, pick = ri[r, R_EPOOL], ri[r, R_EPICK]
    last = len(EXP) - 1
    acc = 0.0
    OFF[r, 0, 0] = 0.0
    acc += rf[r, RF_OV]
    OFF[r, 0, 1] = acc
    k = 2
    for layer in range(layers):
        acc += att
        OFF[r, 0, k] = acc
        acc += rt
        OFF[r, 0, k + 1] = acc
        k += 2
        for e in range(experts):
            if pool >= 0:  # a pool sample's times: _expert_times at its counts (<= 64)
                c = PC[r, pool, pick, layer * experts + e]
                t = EXP[c] if c <= last else cf[CF_GRID_Y] + cf[CF_SLOPE] * (c - cf[CF_GRID_X])
            else:
                t = ET[r, layer * experts + e]
            acc += t
            OFF[r, 0, k] = acc
            k += 1
    OFF[r, 0, k] = rf[r, RF_TOTAL]  # acc + lm_head, replaced by the total as Plan does
    ri[r, R_OFF_OK] = 1


@njit(cache=True)
def _interrupt(g, gf, ci, cf, H, ri, rf, EXP, PC, OFF, ET, r):
    """An arrival interrupted the iteration: run to the next preemptible boundary at or
    after the time elapsed (``Plan.next_boundary``) and suspend there, or to the end."""
    now = gf[GF_NOW]
    elapsed = rf[r, RF_LOOK_OFF] + (now - rf[r, RF_START])
    _offsets(ci, cf, ri, rf, EXP, PC, OFF, ET, r)
    b = _allowed_after(ci, 0)
    while b >= 0 and OFF[r, 0, b] < elapsed:
        b = _allowed_after(ci, b)
    if b < 0:
        ri[r, R_SUSPENDS] = 0
        schedule(g, H, now + (rf[r, RF_TOTAL] - elapsed), NORMAL, EV_BOUNDARY, r)
    else:
        ri[r, R_BOUNDARY], ri[r, R_SUSPENDS] = b, 1
        schedule(g, H, now + (OFF[r, 0, b] - elapsed), NORMAL, EV_BOUNDARY, r)


@njit(cache=True)
def _suspend(g, cf, ri, rf, lists, REQ, SI, OFF, r):
    """Scheduler.preempt: the running batch is suspended at its cursor, keeping its plan;
    its saved activations are held in memory."""
    if ri[r, R_S_N]:  # never under the policies this loop runs (see _select_alg1)
        g[G_ARG] = r
        return ERR_STALL
    n = ri[r, R_N_BATCH]
    held = math.ceil(ri[r, R_NEW_TOKENS] * cf[CF_ACT])
    ri[r, R_USED] += held
    if ri[r, R_USED] > ri[r, R_PEAK]:
        ri[r, R_PEAK] = ri[r, R_USED]
    for k in range(n):
        i = lists[r, BATCH, k]
        lists[r, SUSPENDED, k] = i
        SI[i, S_PREEMPTIONS] += 1
    for k in range(OFF.shape[2]):
        OFF[r, 1, k] = OFF[r, 0, k]
    rf[r, RF_S_TOTAL] = rf[r, RF_TOTAL]
    ri[r, R_S_N], ri[r, R_S_PHASE], ri[r, R_S_CURSOR] = n, ri[r, R_PHASE], ri[r, R_CURSOR]
    ri[r, R_S_NEW], ri[r, R_S_HAS_LS], ri[r, R_S_HELD] = ri[r, R_NEW_TOKENS], ri[r, R_HAS_LS], held
    ri[r, R_N_BATCH] = 0
    ri[r, R_PHASE] = 0
    ri[r, R_PREEMPTS] += 1
    return DONE


@njit(cache=True)
def _resume(g, ci, H, ri, rf, lists, CF, CV, BEY, OFF, now, r):
    """Scheduler.next_batch of the suspended batch: it runs again from its cursor, its plan
    kept, its activations released; it first pays the profile's switch cost (returns
    whether it does: the lookup starts when that timeout ends)."""
    n = ri[r, R_S_N]
    for k in range(n):
        lists[r, BATCH, k] = lists[r, SUSPENDED, k]
    for k in range(OFF.shape[2]):
        OFF[r, 0, k] = OFF[r, 1, k]
    ri[r, R_OFF_OK] = 1
    rf[r, RF_TOTAL] = rf[r, RF_S_TOTAL]
    ri[r, R_N_BATCH], ri[r, R_PHASE], ri[r, R_CURSOR] = n, ri[r, R_S_PHASE], ri[r, R_S_CURSOR]
    ri[r, R_NEW_TOKENS], ri[r, R_HAS_LS] = ri[r, R_S_NEW], ri[r, R_S_HAS_LS]
    ri[r, R_USED] -= ri[r, R_S_HELD]
    ri[r, R_S_N] = 0
    rf[r, RF_START] = now
    switch = curve(CF, CV, BEY, SWITCH, r, 0, ri[r, R_NEW_TOKENS]) if ci[C_SWITCH] else 0.0
    if switch > 0:
        schedule(g, H, now + switch, NORMAL, EV_SWITCH, r)
        return True
    return False


@njit(cache=True)
def _arrivals(g, gf, ci, cf, H, ri, rf, lists, req_t, REQ, SI, TL, waited):
    """The arrival process's step: admit the request it waited for, and those after it due
    now, then wait for the next (``sim.engine.replay``); after the last, close arrivals."""
    now = gf[GF_NOW]
    n = len(req_t)
    if waited:
        g[G_ARR_EVENTS] += 1
        status = _admit(g, ci, cf, H, ri, REQ, SI, TL, now, g[G_NEXT])
        if status != DONE:
            return status
        g[G_NEXT] += 1
    while g[G_NEXT] < n:
        i = g[G_NEXT]
        delay = req_t[i] - now
        if delay > 0:
            schedule(g, H, now + delay, NORMAL, EV_ARRIVAL, -1)
            return DONE
        status = _admit(g, ci, cf, H, ri, REQ, SI, TL, now, i)
        if status != DONE:
            return status
        g[G_NEXT] += 1
    g[G_ARRIVALS_DONE] = 1
    for r in range(ci[C_REPLICAS]):
        if ri[r, R_STATE] == ST_WAITING:
            schedule(g, H, now, NORMAL, EV_WAKE, r)
            ri[r, R_STATE] = ST_WAKING
    return DONE


@njit(cache=True)
def _admit(g, ci, cf, H, ri, REQ, SI, TL, now, i):
    """Cluster._place: the router's choice, Scheduler.arrive, the wake-up or the interrupt
    (Simulation.admit), the timeline."""
    n, router = ci[C_REPLICAS], ci[C_ROUTER]
    ls = REQ[i, Q_LS]
    if router == 0:  # round_robin
        r = g[G_RR]
        g[G_RR] = (r + 1) % n
    elif router == 2:  # least_kv: (used + waiting admissions) / capacity, ties to the lowest
        r, key = 0, 0.0
        for j in range(n):
            k = (ri[j, R_USED] + ri[j, R_W_RESERVED]) / ci[C_CAPACITY]
            if j == 0 or k < key:
                r, key = j, k
    elif router == 4 and ls:  # ls_first, an LS request: (LS queued, in system)
        r, q, k = 0, 0, 0
        for j in range(n):
            qj = ri[j, R_W_LS] + ri[j, R_READY_LS]
            if j == 0 or qj < q or (qj == q and ri[j, R_IN_SYS] < k):
                r, q, k = j, qj, ri[j, R_IN_SYS]
    else:  # fewest in system (least_outstanding, ls_dedicated within its group, ls_first BE)
        lo, hi = 0, n
        if router == 3:
            if ls:
                hi = ci[C_LS_REPLICAS]
            else:
                lo = ci[C_LS_REPLICAS]
        r = lo
        for j in range(lo + 1, hi):
            if ri[j, R_IN_SYS] < ri[r, R_IN_SYS]:
                r = j
    SI[i, S_PLACED] = r
    reserved = REQ[i, Q_PROMPT] + REQ[i, Q_OUT]
    if reserved > ci[C_CAPACITY]:
        g[G_ARG] = i
        return ERR_CAPACITY
    SI[i, S_NXT] = -1
    if ci[C_POLICY] == 1 and not ls:  # Algorithm 1's BE waiting FIFO
        if ri[r, R_W_N] - ri[r, R_W_LS] == 0:
            ri[r, R_WH_BE] = i
        else:
            SI[ri[r, R_WT_BE], S_NXT] = i
        ri[r, R_WT_BE] = i
    elif (ri[r, R_W_LS] if ci[C_POLICY] == 1 else ri[r, R_W_N]) == 0:
        ri[r, R_W_HEAD] = i  # the waiting FIFO (Algorithm 1's LS one) was empty
        ri[r, R_W_TAIL] = i
    else:
        SI[ri[r, R_W_TAIL], S_NXT] = i
        ri[r, R_W_TAIL] = i
    ri[r, R_W_N] += 1
    ri[r, R_W_LS] += ls
    ri[r, R_W_RESERVED] += reserved
    ri[r, R_IN_SYS] += 1
    if ri[r, R_RUN] and not _repeats(ci, ri, REQ, SI, r):  # the run ends with this iteration
        ri[r, R_RUN] = 0
    if ri[r, R_STATE] == ST_WAITING:
        schedule(g, H, now, NORMAL, EV_WAKE, r)
        ri[r, R_STATE] = ST_WAKING
    elif ri[r, R_INTERRUPTIBLE] and _wants(ci, cf, ri, REQ, r):
        ri[r, R_INTERRUPTIBLE] = 0
        ri[r, R_TAG] += 1  # the iteration's end is dropped
        schedule(g, H, now, URGENT, EV_INTERRUPT, r)
        ri[r, R_EVENTS] += 1
    k = g[G_TL]
    TL[k, 0], TL[k, 1], TL[k, 2] = now, r, ri[r, R_IN_SYS]
    g[G_TL] = k + 1
    return DONE


@njit(cache=True)
def _select(g, ci, cf, ri, lists, REQ, SI, r):
    """IterationFCFS.select under reserve memory: a join (TGI's queue.next_batch: a prefill
    of the head of the waiting FIFO) when its rules allow one, else a decode of every
    running sequence. Sets R_PHASE (0: nothing to run)."""
    ri[r, R_PHASE] = 0
    n_ready = ri[r, R_N_READY]
    if ri[r, R_W_N] > 0 and not (n_ready > 0 and ri[r, R_DECODE_NEXT]):
        room = ci[C_MAX_BATCH] - n_ready
        if room > 0:
            if n_ready == 0 or ri[r, R_WAITING_TOKENS] >= ci[C_MAX_WAITING]:
                min_size = 1
            else:
                min_size = max(1, int(math.floor(n_ready * cf[CF_RATIO])))
            budget = ci[C_MAX_TOTAL]
            if budget != NO_CAP:
                for k in range(n_ready):
                    q = lists[r, READY, k]
                    budget -= REQ[q, Q_PROMPT] + REQ[q, Q_OUT]
            taken = _tgi_dry_run(ci, ri, REQ, SI, r, room, budget)
            if n_ready == 0 and taken == 0:
                head = ri[r, R_W_HEAD]
                total = REQ[head, Q_PROMPT] + REQ[head, Q_OUT]
                if ci[C_MAX_TOTAL] != NO_CAP and total > ci[C_MAX_TOTAL]:
                    g[G_ARG] = head
                    return ERR_BATCH_CAP
            if taken >= min_size:  # take them, admit them: their reservation, gaps' room
                for k in range(taken):
                    i = ri[r, R_W_HEAD]
                    ri[r, R_W_HEAD] = SI[i, S_NXT]
                    ri[r, R_W_LS] -= REQ[i, Q_LS]
                    _admit_seq(g, ri, lists, REQ, SI, r, i, k)
                ri[r, R_N_BATCH] = taken
                ri[r, R_PHASE] = 1
                ri[r, R_DECODE_NEXT] = 1 if n_ready > 0 else 0
                return DONE
    ri[r, R_DECODE_NEXT] = 0
    if n_ready == 0:
        return DONE
    for k in range(n_ready):  # the ready sequences are in arrival order
        lists[r, BATCH, k] = lists[r, READY, k]
    ri[r, R_N_BATCH] = n_ready
    ri[r, R_N_READY] = 0
    ri[r, R_READY_LS] = 0
    ri[r, R_PHASE] = 2
    return DONE


@njit(cache=True)
def _tgi_dry_run(ci, ri, REQ, SI, r, room, budget):
    """TGI's take_prefill dry run: how many from the head of the waiting FIFO a join
    would take, within ``room`` sequences, the prefill tokens, ``budget`` and memory."""
    free = ci[C_CAPACITY] - ri[r, R_USED]
    taken, tokens, reserved = 0, 0, 0
    i = ri[r, R_W_HEAD]
    for _ in range(ri[r, R_W_N]):
        if taken >= room:
            break
        n = REQ[i, Q_PROMPT]
        if tokens + n > ci[C_MAX_PREFILL] and taken > 0:
            break
        need = reserved + n + REQ[i, Q_OUT]
        if need > budget or need > free:
            break
        taken += 1
        tokens += n
        reserved = need
        i = SI[i, S_NXT]
    return taken


@njit(cache=True)
def _take_prefill(g, ci, ri, lists, REQ, SI, r, ls, k0, max_seqs, budget, alone):
    """Scheduler.take_prefill from a class's waiting FIFO (reserve memory): admit from its
    head while the batch size, the prefill token budget and memory allow, into the batch
    from position k0; returns how many (``alone``: a first prompt over the budget is
    admitted alone)."""
    n_wait = ri[r, R_W_LS] if ls else ri[r, R_W_N] - ri[r, R_W_LS]
    i = ri[r, R_W_HEAD] if ls else ri[r, R_WH_BE]
    free = ci[C_CAPACITY] - ri[r, R_USED]
    taken, tokens, reserved = 0, 0, 0
    for _ in range(n_wait):  # the dry run
        if taken >= max_seqs:
            break
        n = REQ[i, Q_PROMPT]
        if tokens + n > budget and (taken > 0 or not alone):
            break
        need = reserved + n + REQ[i, Q_OUT]
        if need > free:
            break
        taken += 1
        tokens += n
        reserved = need
        i = SI[i, S_NXT]
    for k in range(taken):  # take them, admit them: their reservation, their gaps' room
        if ls:
            i = ri[r, R_W_HEAD]
            ri[r, R_W_HEAD] = SI[i, S_NXT]
            ri[r, R_W_LS] -= 1
        else:
            i = ri[r, R_WH_BE]
            ri[r, R_WH_BE] = SI[i, S_NXT]
        _admit_seq(g, ri, lists, REQ, SI, r, i, k0 + k)
    return taken


@njit(cache=True)
def _admit_seq(g, ri, lists, REQ, SI, r, i, k):
    """Scheduler.admit of request i, taken out of its waiting FIFO, into position k of the
    batch: its reservation (prompt + output), and room for its gaps in the arena."""
    ri[r, R_W_N] -= 1
    charge = REQ[i, Q_PROMPT] + REQ[i, Q_OUT]
    ri[r, R_W_RESERVED] -= charge
    ri[r, R_USED] += charge
    if ri[r, R_USED] > ri[r, R_PEAK]:
        ri[r, R_PEAK] = ri[r, R_USED]
    SI[i, S_OFF] = g[G_TOP]
    g[G_TOP] += REQ[i, Q_OUT] - 1
    lists[r, BATCH, k] = i


@njit(cache=True)
def _take_ready(ri, lists, r, ls, k0, most):
    """Up to ``most`` sequences from the head of a class's decode queue into the batch from
    position k0; returns how many."""
    width = lists.shape[2]
    row, head, count = (READY, R_RH_LS, R_READY_LS) if ls else (READY_BE, R_RH_BE, R_RN_BE)
    n = max(0, min(most, ri[r, count]))
    h = ri[r, head]
    for k in range(n):
        lists[r, BATCH, k0 + k] = lists[r, row, (h + k) % width]
    ri[r, head] = (h + n) % width
    ri[r, count] -= n
    ri[r, R_N_READY] -= n
    return n


@njit(cache=True)
def _select_alg1(g, ci, ri, lists, REQ, SI, r):
    """Algorithm1.select without the starvation guard or eviction (R_PHASE: 0 nothing, 1 a
    prefill, 2 a decode, 3 the suspended batch resumes). A batch without LS work starts
    (steps 5-7) only when no batch is suspended, so at most one ever is."""
    size, budget = ci[C_MAX_BATCH], ci[C_MAX_PREFILL]
    slots = ci[C_MAX_IN_FLIGHT] - _in_flight(ri, r)
    ri[r, R_PHASE] = 0
    if ri[r, R_READY_LS] >= size:  # 1. a full batch of LS decodes
        n = _take_ready(ri, lists, r, True, 0, size)
        ri[r, R_N_BATCH], ri[r, R_PHASE], ri[r, R_HAS_LS] = n, 2, 1
        return DONE
    if ri[r, R_W_LS] > 0 and slots > 0:  # 2. LS prefills, filled with BE prompts
        most = min(size, slots)
        n = _take_prefill(g, ci, ri, lists, REQ, SI, r, True, 0, most, budget, True)
        if n:
            room = most - n
            # filled with BE prompts unless an LS prompt is left waiting for KV memory
            if ci[C_FILL] and room > 0 and not _ls_head_blocked(ci, ri, REQ, r):
                used = 0
                for k in range(n):
                    used += REQ[lists[r, BATCH, k], Q_PROMPT]
                n += _take_prefill(g, ci, ri, lists, REQ, SI, r, False, n, room, budget - used,
                                   False)  # fmt: skip
            ri[r, R_N_BATCH], ri[r, R_PHASE], ri[r, R_HAS_LS] = n, 1, 1
            return DONE
    if ri[r, R_READY_LS] > 0:  # 4. LS decodes, filled with BE decodes
        n = _take_ready(ri, lists, r, True, 0, ri[r, R_READY_LS])
        n += _take_ready(ri, lists, r, False, n, size - n)
        ri[r, R_N_BATCH], ri[r, R_PHASE], ri[r, R_HAS_LS] = n, 2, 1
        return DONE
    if ri[r, R_S_N]:  # 5. the suspended batch
        ri[r, R_PHASE] = 3
        return DONE
    # 6. BE prefills while decode batches are short, none while an LS prompt waits (here:
    # for KV memory; no BE prompt is admitted ahead of it)
    room = min(size - ri[r, R_RN_BE], slots)
    if ri[r, R_W_LS] == 0 and room > 0 and (ci[C_REFILL] or ri[r, R_RN_BE] == 0):
        n = _take_prefill(g, ci, ri, lists, REQ, SI, r, False, 0, room, budget, True)
        if n:
            ri[r, R_N_BATCH], ri[r, R_PHASE], ri[r, R_HAS_LS] = n, 1, 0
            return DONE
    n = _take_ready(ri, lists, r, False, 0, size)  # 7. BE decodes
    if n:
        ri[r, R_N_BATCH], ri[r, R_PHASE], ri[r, R_HAS_LS] = n, 2, 0
    return DONE


@njit(cache=True, inline="always")
def _ls_head_blocked(ci, ri, REQ, r):
    """Whether an LS prompt waits and its reservation does not fit in KV memory."""
    if ri[r, R_W_LS] == 0:
        return False
    head = ri[r, R_W_HEAD]
    return ri[r, R_USED] + REQ[head, Q_PROMPT] + REQ[head, Q_OUT] > ci[C_CAPACITY]


@njit(cache=True, inline="always")
def _plan(g, gf, ci, cf, ri, rf, lists, REQ, SI, CF, CV, BEY, MEMO, EXP, PC, PF, PS, PB, ET, r,
          given):  # fmt: skip
    """LatencyModel.plan of replica r's batch: its total and stage times in rf[r] (``given``:
    the experts' summed time is gf[GF_SUM], computed by Python, and their times ET[r])."""
    size = ri[r, R_N_BATCH]
    decode = ri[r, R_PHASE] == 2
    if decode:
        tokens = size
    else:
        tokens = 0
        for k in range(size):
            tokens += REQ[lists[r, BATCH, k], Q_PROMPT]
    if given:
        esum = gf[GF_SUM]
    else:
        status, esum = _experts(g, ci, cf, ri, BEY, EXP, PC, PF, PS, PB, ET, r, tokens)
        if status != DONE:
            g[G_PENDING_MODE] = 2
            return status
    if decode:
        if ri[r, R_DEFER]:  # a decode run: its sequences' counts wait, the maximum is kept
            kv = ri[r, R_KV]
        else:
            kv = 0
            for k in range(size):
                q = lists[r, BATCH, k]
                kv = max(kv, REQ[q, Q_PROMPT] + SI[q, S_GEN])
            ri[r, R_KV] = kv
        attention = curve(CF, CV, BEY, ATTN_DECODE, r, size, kv - 1)
    elif ci[C_PER_PROMPT]:
        attention = 0.0
        for k in range(size):
            attention += curve(CF, CV, BEY, ATTN_PREFILL, r, 0,
                               REQ[lists[r, BATCH, k], Q_PROMPT])  # fmt: skip
    else:
        attention = curve(CF, CV, BEY, ATTN_PREFILL, r, size, tokens)
    # the three curves of one input, memoised within their grids (no extrapolation to note)
    if tokens < ci[C_MEMO_ROUTER] and not math.isnan(MEMO[ROUTER, tokens]):
        router = MEMO[ROUTER, tokens]
    else:
        router = curve(CF, CV, BEY, ROUTER, r, 0, tokens)
        if tokens < ci[C_MEMO_ROUTER]:
            MEMO[ROUTER, tokens] = router
    if size < ci[C_MEMO_SIZE] and not math.isnan(MEMO[OVERHEAD, size]):
        overhead, lm_head = MEMO[OVERHEAD, size], MEMO[LM_HEAD, size]
    else:
        overhead = curve(CF, CV, BEY, OVERHEAD, r, 0, size)
        lm_head = curve(CF, CV, BEY, LM_HEAD, r, 0, size)
        if size < ci[C_MEMO_SIZE]:
            MEMO[OVERHEAD, size], MEMO[LM_HEAD, size] = overhead, lm_head
    layers = ci[C_LAYERS] * (attention + router)
    rf[r, RF_TOTAL] = overhead + (layers + esum) + lm_head
    rf[r, RF_OV], rf[r, RF_ATT], rf[r, RF_RT], rf[r, RF_LM] = overhead, attention, router, lm_head
    ri[r, R_NEW_TOKENS] = tokens
    return DONE


@njit(cache=True, inline="always")
def _experts(g, ci, cf, ri, BEY, EXP, PC, PF, PS, PB, ET, r, tokens):
    """(status, the experts' summed stage time) of one iteration of ``tokens`` tokens on
    replica r, as LatencyModel.experts draws them: a pick of the pool of that many tokens,
    or q picks of the largest pool and one of the remainder's, summed
    (RoutingModel.summed). NEED_EXPERTS when a pool is not built yet (Python builds it, as
    the model does, and plans the experts), NEED_PICKS when the block of picks drawn ahead
    runs out (g[G_NEED]: how many are needed)."""
    largest = ci[C_POOLED_MAX]
    taken = ri[r, R_TAKEN]
    if tokens <= largest:
        if not PF[r, tokens, 1]:
            g[G_ARG] = tokens
            return NEED_EXPERTS, 0.0
        if taken + 1 > ri[r, R_PICKS]:
            g[G_NEED] = 1
            return NEED_PICKS, 0.0
        ri[r, R_TAKEN] = taken + 1
        ri[r, R_EPOOL], ri[r, R_EPICK] = tokens, PB[r, taken]
        return DONE, PS[r, tokens, PB[r, taken]]
    q, rem = tokens // largest, tokens % largest
    if not PF[r, largest, 0] or (rem and not PF[r, rem, 0]):
        g[G_ARG] = tokens
        return NEED_EXPERTS, 0.0
    need = q + (1 if rem else 0)
    if taken + need > ri[r, R_PICKS]:
        g[G_NEED] = need
        return NEED_PICKS, 0.0
    width = PC.shape[3]
    c = np.zeros(width, dtype=np.int64)
    for j in range(q):
        p = PB[r, taken + j]
        for e in range(width):
            c[e] += PC[r, largest, p, e]
    if rem:
        p = PB[r, taken + q]
        for e in range(width):
            c[e] += PC[r, rem, p, e]
    ri[r, R_TAKEN] = taken + need
    times = np.empty(width)
    last = len(EXP) - 1
    col = BEY.shape[1] - 1
    for e in range(width):
        x = c[e]
        if x <= last:
            times[e] = EXP[x]
        else:  # beyond the grid: Curve1D's linear extrapolation
            times[e] = cf[CF_GRID_Y] + cf[CF_SLOPE] * (x - cf[CF_GRID_X])
            if math.isnan(BEY[r, col]) or x > BEY[r, col]:
                BEY[r, col] = x
    ri[r, R_EPOOL] = -1
    if (ci[C_GRAN] > G_ITERATION and not ri[r, R_HAS_LS]
            and (ri[r, R_PHASE] == 2 or ci[C_PREEMPT_PREFILL])):  # fmt: skip
        # the stage times, for a preemption inside the iteration (of a batch without LS
        # work: the only kind preempted; a prefill only under preempt_prefill)
        for e in range(width):
            ET[r, e] = times[e]
    return DONE, pairwise_sum(times, 0, width)


@njit(cache=True)
def _run_left(ci, ri, lists, REQ, SI, r):
    """The decode batch just selected on replica r, as a run: the iterations until one of
    its sequences finishes (this one counted), if the policy would select exactly this
    batch again after each of them, as long as nothing it reads changes (``_repeats``);
    else 0. Keeps what ``_repeats`` needs of the batch (R_RUN_LS, R_RUN_RESERVED)."""
    if not ci[C_RUNS] or ri[r, R_N_READY]:  # not every decode-ready sequence is in it
        return 0
    left, reserved, n_ls = NO_CAP, 0, 0
    for k in range(ri[r, R_N_BATCH]):
        i = lists[r, BATCH, k]
        left = min(left, REQ[i, Q_OUT] - SI[i, S_GEN])
        reserved += REQ[i, Q_PROMPT] + REQ[i, Q_OUT]
        n_ls += REQ[i, Q_LS]
    ri[r, R_RUN_LS], ri[r, R_RUN_RESERVED] = n_ls, reserved
    return left if left > 1 and _repeats(ci, ri, REQ, SI, r) else 0


@njit(cache=True)
def _repeats(ci, ri, REQ, SI, r):
    """Whether the selection after the end of replica r's decode batch (every decode-ready
    sequence in it, none of it finishing) gives the batch back, as long as nothing else
    changes: the waiting requests it looks at cannot be admitted. Under TGI's rules, a
    join that takes fewer than its minimum size waits until the waiting-tokens counter
    lowers that minimum (R_RUN_TAKEN: the join's size; ``_tgi_decodes`` asks at each end).
    Only an arrival at the replica (``_admit`` asks again) or a finish (which ends the
    run) changes the rest."""
    n, n_ls = ri[r, R_N_BATCH], ri[r, R_RUN_LS]
    if ci[C_POLICY] == 0:  # _select after the batch's end, n ready, the last a decode
        room = ci[C_MAX_BATCH] - n
        taken = 0
        if ri[r, R_W_N] > 0 and room > 0:
            budget = ci[C_MAX_TOTAL]
            if budget != NO_CAP:
                budget -= ri[r, R_RUN_RESERVED]
            taken = _tgi_dry_run(ci, ri, REQ, SI, r, room, budget)
        ri[r, R_RUN_TAKEN] = taken
        return True
    # _select_alg1 with this batch decode-ready: steps 1, 4 and 7 give it back whole; steps
    # 2 and 6 give a prefill when their queue's head fits (a first prompt goes alone)
    size, free = ci[C_MAX_BATCH], ci[C_CAPACITY] - ri[r, R_USED]
    slots = ci[C_MAX_IN_FLIGHT] - n - ri[r, R_S_N]
    if n_ls >= size:
        return True
    if ri[r, R_W_LS] > 0 and slots > 0:
        head = ri[r, R_W_HEAD]
        if REQ[head, Q_PROMPT] + REQ[head, Q_OUT] <= free:
            return False
    if n_ls > 0:
        return True
    # (step 5 does not come into it: a batch without LS work is selected only when none is
    # suspended, and none is while it runs: a suspension ends it)
    # (no LS prompt waits: step 6 is closed while one does)
    if ci[C_REFILL] and min(size - n, slots) > 0 and ri[r, R_W_LS] == 0 and ri[r, R_W_N] > 0:
        head = ri[r, R_WH_BE]
        if REQ[head, Q_PROMPT] + REQ[head, Q_OUT] <= free:
            return False
    return True


@njit(cache=True, inline="always")
def _tgi_decodes(ci, cf, ri, r):
    """Whether TGI's selection after this end of the decode run picks the decode again: its
    join takes R_RUN_TAKEN, fewer than the minimum size at the counter's next value."""
    taken = ri[r, R_RUN_TAKEN]
    if taken == 0:
        return True
    if ri[r, R_WAITING_TOKENS] + 1 >= ci[C_MAX_WAITING]:
        return False  # min size 1
    return taken < max(1, int(math.floor(ri[r, R_N_BATCH] * cf[CF_RATIO])))


@njit(cache=True)
def _materialise(ri, lists, SI, SF, arena, RUNT, r):
    """Apply the ended iterations of replica r's decode run that wait in RUNT[r] to its
    batch's sequences, as ``_complete`` would have at each end: a token each, the gap
    since the last (float32, from the same float64 ends), the largest gap, the last
    token's time."""
    m = ri[r, R_DEFER]
    for k in range(ri[r, R_N_BATCH]):
        i = lists[r, BATCH, k]
        before, last, itl, off = SI[i, S_GEN], SF[i, S_LAST], SF[i, S_ITL], SI[i, S_OFF]
        for j in range(m):
            now = RUNT[r, j]
            if before:
                gap = np.float32(now - last)
                arena[off + before - 1] = gap
                if before == 1 or gap > itl:
                    itl = gap
            last = now
            before += 1
        SI[i, S_GEN], SF[i, S_LAST], SF[i, S_ITL] = before, last, itl
    ri[r, R_DEFER] = 0


@njit(cache=True, inline="always")
def _complete(g, ci, ri, lists, REQ, SI, SF, arena, fin, TL, now, r):
    """Scheduler.complete_iteration and the policy's on_complete; the finished requests go
    to fin[] and the timeline, as the executor's on_finish calls after the iteration."""
    prefill = ri[r, R_PHASE] == 1
    finished = 0
    n_ready = ri[r, R_N_READY]
    for k in range(ri[r, R_N_BATCH]):
        i = lists[r, BATCH, k]
        if prefill:
            SF[i, S_FIRST] = now
        before = SI[i, S_GEN]
        SI[i, S_GEN] = before + 1
        if before:
            gap = np.float32(now - SF[i, S_LAST])
            arena[SI[i, S_OFF] + before - 1] = gap
            if before == 1 or gap > SF[i, S_ITL]:
                SF[i, S_ITL] = gap
        SF[i, S_LAST] = now
        if before + 1 >= REQ[i, Q_OUT]:
            SF[i, S_FIN] = now
            ri[r, R_USED] -= REQ[i, Q_PROMPT] + REQ[i, Q_OUT]
            fin[g[G_FIN]] = i
            g[G_FIN] += 1
            ri[r, R_IN_SYS] -= 1
            finished += 1
        elif ci[C_POLICY] == 0:
            lists[r, READY, n_ready] = i
            n_ready += 1
            ri[r, R_READY_LS] += REQ[i, Q_LS]
        else:  # Algorithm 1: its class's decode queue, in the order tokens were produced
            width = lists.shape[2]
            if REQ[i, Q_LS]:
                lists[r, READY, (ri[r, R_RH_LS] + ri[r, R_READY_LS]) % width] = i
                ri[r, R_READY_LS] += 1
            else:
                lists[r, READY_BE, (ri[r, R_RH_BE] + ri[r, R_RN_BE]) % width] = i
                ri[r, R_RN_BE] += 1
            n_ready += 1
    ri[r, R_N_READY] = n_ready
    ri[r, R_N_BATCH] = 0
    ri[r, R_ITERS] += 1
    ri[r, R_WAITING_TOKENS] = 1 if prefill else ri[r, R_WAITING_TOKENS] + 1
    ri[r, R_PHASE] = 0
    k = g[G_TL]
    for _ in range(finished):  # on_finish's timeline rows, after the whole iteration
        TL[k, 0], TL[k, 1], TL[k, 2] = now, r, ri[r, R_IN_SYS]
        k += 1
    g[G_TL] = k


@njit(cache=True)
def gather(arena, SI, lengths, which):
    """The gaps of requests ``which`` (their arena slices), one after another."""
    total = 0
    for i in which:
        total += lengths[i]
    out = np.empty(total, dtype=np.float32)
    k = 0
    for i in which:
        n = lengths[i]
        o = SI[i, S_OFF]
        out[k : k + n] = arena[o : o + n]
        k += n
    return out


@njit(cache=True)
def compact(g, ci, ri, lists, REQ, SI, arena):
    """Move the gap slices of the requests in flight (decode-ready, in a batch, suspended)
    to the arena's start, in their order there, and free the rest (finished requests were
    handed over)."""
    width = lists.shape[2]
    n = 0
    for r in range(ci[C_REPLICAS]):
        n += ri[r, R_N_READY] + ri[r, R_N_BATCH] + ri[r, R_S_N]
    live = np.empty(n, dtype=np.int64)
    k = 0
    for r in range(ci[C_REPLICAS]):
        if ci[C_POLICY] == 0:
            for j in range(ri[r, R_N_READY]):
                live[k] = lists[r, READY, j]
                k += 1
        else:
            for j in range(ri[r, R_READY_LS]):
                live[k] = lists[r, READY, (ri[r, R_RH_LS] + j) % width]
                k += 1
            for j in range(ri[r, R_RN_BE]):
                live[k] = lists[r, READY_BE, (ri[r, R_RH_BE] + j) % width]
                k += 1
        for j in range(ri[r, R_N_BATCH]):
            live[k] = lists[r, BATCH, j]
            k += 1
        for j in range(ri[r, R_S_N]):
            live[k] = lists[r, SUSPENDED, j]
            k += 1
    starts = np.empty(n, dtype=np.int64)
    for j in range(n):
        starts[j] = SI[live[j], S_OFF]
    top = 0
    for j in np.argsort(starts):
        i = live[j]
        m = REQ[i, Q_OUT] - 1
        o = SI[i, S_OFF]
        if o != top:
            arena[top : top + m] = arena[o : o + m].copy()
            SI[i, S_OFF] = top
        top += m
    g[G_TOP] = top
