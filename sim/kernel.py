"""The compiled executor's loop (numba): ``executor=compiled`` (sim/compiled.py drives it).

It replays what the SimPy executor (sim/engine.py, stepping every iteration) and the cluster
(sim/cluster.py) do for the policies it covers (``iteration``: TGI's router, under
``reserve`` memory), on typed arrays instead of Python objects: the same events in the same
order (SimPy's: time, then priority, then the order they were scheduled in), the same float
operations in the same order, so every request's times and token gaps come out to the bit
(tests/test_compiled.py compares them). What needs the routing model's random generator (a
pool not built yet, a block of picks) is handed back to Python, which calls the very
``RoutingModel`` and ``LatencyModel`` methods the SimPy executor calls, and the loop goes on
where it stopped.

Everything here is a plain function of arrays; the state layout is in the ``G_``/``R_``
constants below, shared with sim/compiled.py.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# --- what run() returns
DONE, NEED_EXPERTS, NEED_PICKS, FLUSH, ERR_CAPACITY, ERR_BATCH_CAP, ERR_STALL = range(7)

# --- event kinds (heap), and SimPy's priorities
EV_ARRIVAL_INIT, EV_EXEC_INIT, EV_ARRIVAL, EV_ITER, EV_WAKE = range(5)
URGENT, NORMAL = 0, 1

# --- global int state g[...]
G_EID = 0  # SimPy's event counter
G_NEXT = 1  # the next request the arrival process admits
G_ARRIVALS_DONE = 2
G_HEAP = 3  # events in the heap
G_UNUSED = 4
G_FIN = 5  # finished requests (fin[]) so far
G_TL = 6  # timeline rows so far
G_ARG = 7  # a request index or a token count, for the status returned
G_ARR_EVENTS = 8  # timeouts the arrival process waited
G_PENDING = 9  # replica whose selected batch waits for its plan (-1: none)
G_PENDING_MODE = 10  # 1: Python computed its experts (gf[GF_SUM]); 2: retry in the loop
G_RR = 11  # round robin's next replica
G_TOP = 12  # the gap arena's first free slot
G_FLUSHED = 13  # fin[] up to here was handed to Python
G_NEED = 14  # picks needed (NEED_PICKS)
G_SIZE = 15

# --- global float state gf[...]
GF_NOW = 0
GF_MAKESPAN = 1
GF_SUM = 2  # experts' summed stage time computed by Python (NEED_EXPERTS)
GF_SIZE = 3

# --- per-replica int state ri[r, ...]
R_STATE = 0  # ST_*
R_PHASE = 1  # of the batch running: 1 prefill, 2 decode
R_W_HEAD, R_W_TAIL, R_W_N, R_W_LS, R_W_RESERVED = 2, 3, 4, 5, 6  # the waiting FIFO
R_WAITING_TOKENS, R_DECODE_NEXT = 7, 8  # TGI's counter; a join was just prefilled
R_USED, R_PEAK, R_IN_SYS, R_ITERS, R_EVENTS = 9, 10, 11, 12, 13
R_N_READY, R_READY_LS, R_N_BATCH = 14, 15, 16
R_SIZE = 17
ST_NEW, ST_RUNNING, ST_WAITING, ST_WAKING, ST_DONE = range(5)

# --- per-replica float state rf[r, ...]
RF_START, RF_BUSY = 0, 1
RF_SIZE = 2

# --- config ci[...], cf[...]
C_REPLICAS, C_ROUTER, C_LS_REPLICAS, C_MAX_BATCH, C_MAX_PREFILL = 0, 1, 2, 3, 4
C_MAX_WAITING, C_MAX_TOTAL, C_CAPACITY, C_LAYERS, C_POOL, C_POOLED_MAX = 5, 6, 7, 8, 9, 10
C_PER_PROMPT, C_FLUSH_EVERY, C_ARENA_FREE = 11, 12, 13
C_SIZE = 14
CF_RATIO = 0
CF_SIZE = 1
ROUTER_CODES = {"round_robin": 0, "least_outstanding": 1, "least_kv": 2, "ls_dedicated": 3,
                "ls_first": 4}  # fmt: skip
NO_CAP = 1 << 62  # a limit that is null (no cap)


# ------------------------------------------------------------------------------------ curves
# A curve is (batches, offs, xs, ys, slopes, beyond): row j is the Curve1D of points
# xs[offs[j]:offs[j + 1]] at row key batches[j]; a Curve1D is a curve of one row. beyond[r, j]
# is the largest input row j extrapolated on replica r (NaN: none); beyond[r, len(batches)]
# the largest row key beyond the last row (Curve2D.beyond_batch).


@njit(cache=True)
def _row(xs, ys, slopes, beyond, lo, hi, j, x):
    """Curve1D.scalar of row j at x, with its operations in its order (``beyond``: this
    replica's row of the curve's extrapolation maxima)."""
    last = xs[hi - 1]
    if x >= last:
        y = ys[hi - 1] + slopes[j] * (x - last)
        if x > last and (math.isnan(beyond[j]) or x > beyond[j]):
            beyond[j] = x
        return y
    if x <= xs[lo]:
        return ys[lo]
    a, b = lo, hi  # bisect_right(xs[lo:hi], x) - 1
    while a < b:
        mid = (a + b) // 2
        if x < xs[mid]:
            b = mid
        else:
            a = mid + 1
    i = a - 1
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


@njit(cache=True)
def curve(c, r, b, x):
    """Curve2D.__call__(b, x) on replica r's model (a Curve1D's scalar(x) when the curve has
    one row)."""
    batches, offs, xs, ys, slopes, beyond_all = c
    beyond = beyond_all[r]
    n = len(batches)
    if n == 1:
        return _row(xs, ys, slopes, beyond, offs[0], offs[1], 0, x)
    a, hi = 0, n  # bisect_right(batches, b) - 1, clamped to [0, n - 2]
    while a < hi:
        mid = (a + hi) // 2
        if b < batches[mid]:
            hi = mid
        else:
            a = mid + 1
    i = min(max(a - 1, 0), n - 2)
    x0, x1 = batches[i], batches[i + 1]
    y0 = _row(xs, ys, slopes, beyond, offs[i], offs[i + 1], i, x)
    y1 = _row(xs, ys, slopes, beyond, offs[i + 1], offs[i + 2], i + 1, x)
    if b <= x0:
        return y0
    if b >= x1:
        if b > x1 and (math.isnan(beyond[n]) or beyond[n] < b):
            beyond[n] = b
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
def _half(n):
    h = n // 2
    return h - h % 8


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
                h = _half(ns[top])
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
        top += 1
        los[top], ns[top], right[top] = los[top - 1], _half(m), False


# -------------------------------------------------------------------------------------- heap
@njit(cache=True)
def _less(ht, hp, he, i, j):
    if ht[i] != ht[j]:
        return ht[i] < ht[j]
    if hp[i] != hp[j]:
        return hp[i] < hp[j]
    return he[i] < he[j]


@njit(cache=True)
def _swap(ht, hp, he, hk, hr, i, j):
    ht[i], ht[j] = ht[j], ht[i]
    hp[i], hp[j] = hp[j], hp[i]
    he[i], he[j] = he[j], he[i]
    hk[i], hk[j] = hk[j], hk[i]
    hr[i], hr[j] = hr[j], hr[i]


@njit(cache=True)
def schedule(g, heap, t, prio, kind, r):
    """SimPy's ``schedule``: the event gets the next id."""
    ht, hp, he, hk, hr = heap
    n = g[G_HEAP]
    ht[n], hp[n], he[n], hk[n], hr[n] = t, prio, g[G_EID], kind, r
    g[G_EID] += 1
    g[G_HEAP] = n + 1
    while n > 0:
        parent = (n - 1) // 2
        if not _less(ht, hp, he, n, parent):
            break
        _swap(ht, hp, he, hk, hr, n, parent)
        n = parent


@njit(cache=True)
def _pop(g, heap):
    ht, hp, he, hk, hr = heap
    t, kind, r = ht[0], hk[0], hr[0]
    n = g[G_HEAP] - 1
    g[G_HEAP] = n
    if n > 0:
        _swap(ht, hp, he, hk, hr, 0, n)
        i = 0
        while True:
            left, right, best = 2 * i + 1, 2 * i + 2, i
            if left < n and _less(ht, hp, he, left, best):
                best = left
            if right < n and _less(ht, hp, he, right, best):
                best = right
            if best == i:
                break
            _swap(ht, hp, he, hk, hr, i, best)
            i = best
    return t, kind, r


# ----------------------------------------------------------------------------------- router
@njit(cache=True)
def _route(g, ci, ri, req_ls, i):
    n = ci[C_REPLICAS]
    router = ci[C_ROUTER]
    if router == 0:  # round_robin
        r = g[G_RR]
        g[G_RR] = (r + 1) % n
        return r
    if router == 2:  # least_kv: (used + waiting admissions) / capacity, ties to the lowest
        best, key = 0, 0.0
        for r in range(n):
            k = (ri[r, R_USED] + ri[r, R_W_RESERVED]) / ci[C_CAPACITY]
            if r == 0 or k < key:
                best, key = r, k
        return best
    lo, hi = 0, n
    if router == 3:  # ls_dedicated
        if req_ls[i]:
            hi = ci[C_LS_REPLICAS]
        else:
            lo = ci[C_LS_REPLICAS]
    if router == 4 and req_ls[i]:  # ls_first, an LS request: (LS queued, in system)
        best, q, k = 0, 0, 0
        for r in range(n):
            qr = ri[r, R_W_LS] + ri[r, R_READY_LS]
            if r == 0 or qr < q or (qr == q and ri[r, R_IN_SYS] < k):
                best, q, k = r, qr, ri[r, R_IN_SYS]
        return best
    best = lo  # fewest in system
    for r in range(lo + 1, hi):
        if ri[r, R_IN_SYS] < ri[best, R_IN_SYS]:
            best = r
    return best


# -------------------------------------------------------------------------------- the loop
@njit(cache=True)
def run(g, gf, ci, cf, heap, ri, rf, ready, batch, req, seqs, nxt, placed, arena, fin, tl,
        curves, expert, pools, picks):  # fmt: skip
    """Process events until the run ends (DONE), an error, or Python is needed (a pool, a
    block of picks, or a flush of finished requests: FLUSH); call again to go on."""
    req_t, req_prompt, req_out, req_ls = req
    while True:
        if g[G_PENDING] >= 0:  # a batch selected before we returned waits for its plan
            r = g[G_PENDING]
            status = _plan(g, gf, ci, ri, rf, batch, req, seqs, heap, curves, expert, pools,
                           picks, r, g[G_PENDING_MODE] == 1)  # fmt: skip
            if status != DONE:
                return status
            g[G_PENDING] = -1
        if g[G_FIN] - g[G_FLUSHED] >= ci[C_FLUSH_EVERY] or len(arena) - g[G_TOP] < ci[C_ARENA_FREE]:
            return FLUSH
        if g[G_HEAP] == 0:
            return DONE
        t, kind, r = _pop(g, heap)
        gf[GF_NOW] = t
        if kind == EV_ARRIVAL_INIT or kind == EV_ARRIVAL:
            status = _arrivals(g, gf, ci, heap, ri, req, nxt, placed, tl, kind == EV_ARRIVAL)
            if status != DONE:
                return status
            continue
        if kind == EV_ITER:
            ri[r, R_EVENTS] += 1
            rf[r, RF_BUSY] += t - rf[r, RF_START]
            _complete(g, ri, ready, batch, req, seqs, arena, fin, tl, t, r)
        elif kind == EV_WAKE:
            ri[r, R_EVENTS] += 1
        status = _executor(g, gf, ci, cf, heap, ri, rf, ready, batch, req, seqs, nxt, arena,
                           curves, expert, pools, picks, r)  # fmt: skip
        if status != DONE:
            return status


@njit(cache=True)
def _arrivals(g, gf, ci, heap, ri, req, nxt, placed, tl, waited):
    """The arrival process's step: admit the request it waited for, and those after it due
    now, then wait for the next (``sim.engine.replay``); after the last, close arrivals."""
    req_t = req[0]
    now = gf[GF_NOW]
    n = len(req_t)
    if waited:
        g[G_ARR_EVENTS] += 1
        status = _admit(g, ci, heap, ri, req, nxt, placed, tl, now, g[G_NEXT])
        if status != DONE:
            return status
        g[G_NEXT] += 1
    while g[G_NEXT] < n:
        i = g[G_NEXT]
        delay = req_t[i] - now
        if delay > 0:
            schedule(g, heap, now + delay, NORMAL, EV_ARRIVAL, -1)
            return DONE
        status = _admit(g, ci, heap, ri, req, nxt, placed, tl, now, i)
        if status != DONE:
            return status
        g[G_NEXT] += 1
    g[G_ARRIVALS_DONE] = 1
    for r in range(ci[C_REPLICAS]):
        if ri[r, R_STATE] == ST_WAITING:
            schedule(g, heap, now, NORMAL, EV_WAKE, r)
            ri[r, R_STATE] = ST_WAKING
    return DONE


@njit(cache=True)
def _admit(g, ci, heap, ri, req, nxt, placed, tl, now, i):
    """Cluster._place: the router's choice, Scheduler.arrive, the wake-up, the timeline."""
    req_t, req_prompt, req_out, req_ls = req
    r = _route(g, ci, ri, req_ls, i)
    placed[i] = r
    reserved = req_prompt[i] + req_out[i]
    if reserved > ci[C_CAPACITY]:
        g[G_ARG] = i
        return ERR_CAPACITY
    nxt[i] = -1
    if ri[r, R_W_N] == 0:
        ri[r, R_W_HEAD] = i
    else:
        nxt[ri[r, R_W_TAIL]] = i
    ri[r, R_W_TAIL] = i
    ri[r, R_W_N] += 1
    ri[r, R_W_LS] += req_ls[i]
    ri[r, R_W_RESERVED] += reserved
    ri[r, R_IN_SYS] += 1
    if ri[r, R_STATE] == ST_WAITING:
        schedule(g, heap, now, NORMAL, EV_WAKE, r)
        ri[r, R_STATE] = ST_WAKING
    _note(g, ri, tl, now, r)
    return DONE


@njit(cache=True)
def _note(g, ri, tl, now, r):
    tl_t, tl_r, tl_n = tl
    k = g[G_TL]
    tl_t[k], tl_r[k], tl_n[k] = now, r, ri[r, R_IN_SYS]
    g[G_TL] = k + 1


@njit(cache=True)
def _executor(g, gf, ci, cf, heap, ri, rf, ready, batch, req, seqs, nxt, arena, curves, expert,
              pools, picks, r):  # fmt: skip
    """The executor's step after an iteration or a wake-up: select the next batch and plan
    it, or wait (for an arrival, or for good once arrivals are closed)."""
    status = _select(g, ci, cf, ri, ready, batch, req, seqs, nxt, arena, r)
    if status == ERR_BATCH_CAP:
        return status
    if ri[r, R_PHASE] == 0:  # nothing to run
        if g[G_ARRIVALS_DONE]:
            if ri[r, R_IN_SYS]:
                g[G_ARG] = r
                return ERR_STALL
            ri[r, R_STATE] = ST_DONE
            gf[GF_MAKESPAN] = gf[GF_NOW]
        else:
            ri[r, R_STATE] = ST_WAITING
        return DONE
    ri[r, R_STATE] = ST_RUNNING
    g[G_PENDING] = r
    status = _plan(g, gf, ci, ri, rf, batch, req, seqs, heap, curves, expert, pools, picks, r,
                   False)  # fmt: skip
    if status == DONE:
        g[G_PENDING] = -1
    return status


@njit(cache=True)
def _select(g, ci, cf, ri, ready, batch, req, seqs, nxt, arena, r):
    """IterationFCFS.select under reserve memory: a join (a prefill of the head of the
    waiting FIFO) when TGI's rules allow one, else a decode of every running sequence."""
    req_t, req_prompt, req_out, req_ls = req
    ri[r, R_PHASE] = 0
    n_ready = ri[r, R_N_READY]
    if ri[r, R_W_N] > 0 and not (n_ready > 0 and ri[r, R_DECODE_NEXT]):
        status = _join(g, ci, cf, ri, ready, batch, req, seqs, nxt, arena, r)
        if status != DONE:
            return status
        if ri[r, R_PHASE] == 1:
            ri[r, R_DECODE_NEXT] = 1 if n_ready > 0 else 0
            return DONE
    ri[r, R_DECODE_NEXT] = 0
    if n_ready == 0:
        return DONE
    for k in range(n_ready):  # the ready sequences are in arrival order
        batch[r, k] = ready[r, k]
    ri[r, R_N_BATCH] = n_ready
    ri[r, R_N_READY] = 0
    ri[r, R_READY_LS] = 0
    ri[r, R_PHASE] = 2
    return DONE


@njit(cache=True)
def _join(g, ci, cf, ri, ready, batch, req, seqs, nxt, arena, r):
    """IterationFCFS._join: TGI's queue.next_batch on the waiting FIFO."""
    req_t, req_prompt, req_out, req_ls = req
    n_ready = ri[r, R_N_READY]
    room = ci[C_MAX_BATCH] - n_ready
    if room <= 0:
        return DONE
    if n_ready == 0 or ri[r, R_WAITING_TOKENS] >= ci[C_MAX_WAITING]:
        min_size = 1
    else:
        min_size = max(1, int(math.floor(n_ready * cf[CF_RATIO])))
    budget = ci[C_MAX_TOTAL]
    if budget != NO_CAP:
        for k in range(n_ready):
            q = ready[r, k]
            budget -= req_prompt[q] + req_out[q]
    free = ci[C_CAPACITY] - ri[r, R_USED]
    taken, tokens, reserved = 0, 0, 0
    i = ri[r, R_W_HEAD]
    for _ in range(ri[r, R_W_N]):  # take_prefill's dry run
        if taken >= room:
            break
        n = req_prompt[i]
        if tokens + n > ci[C_MAX_PREFILL] and taken > 0:
            break
        need = reserved + req_prompt[i] + req_out[i]
        if need > budget or need > free:
            break
        taken += 1
        tokens += n
        reserved = need
        i = nxt[i]
    if n_ready == 0 and taken == 0:
        head = ri[r, R_W_HEAD]
        if ci[C_MAX_TOTAL] != NO_CAP and req_prompt[head] + req_out[head] > ci[C_MAX_TOTAL]:
            g[G_ARG] = head
            return ERR_BATCH_CAP
    if taken < min_size:
        return DONE
    gen, first_t, last_t, fin_t, off, itl_max = seqs
    for k in range(taken):  # take them and admit them: their reservation, their gaps' room
        i = ri[r, R_W_HEAD]
        ri[r, R_W_HEAD] = nxt[i]
        ri[r, R_W_N] -= 1
        ri[r, R_W_LS] -= req_ls[i]
        charge = req_prompt[i] + req_out[i]
        ri[r, R_W_RESERVED] -= charge
        ri[r, R_USED] += charge
        if ri[r, R_USED] > ri[r, R_PEAK]:
            ri[r, R_PEAK] = ri[r, R_USED]
        off[i] = g[G_TOP]
        g[G_TOP] += req_out[i] - 1
        batch[r, k] = i
    ri[r, R_N_BATCH] = taken
    ri[r, R_PHASE] = 1
    return DONE


@njit(cache=True)
def _plan(g, gf, ci, ri, rf, batch, req, seqs, heap, curves, expert, pools, picks, r, given):
    """LatencyModel.plan of replica r's batch and the timeout to its end (``given``: the
    experts' summed time is gf[GF_SUM], computed by Python)."""
    req_t, req_prompt, req_out, req_ls = req
    gen = seqs[0]
    overhead, router, lm_head, attn_decode, attn_prefill = curves
    size = ri[r, R_N_BATCH]
    decode = ri[r, R_PHASE] == 2
    if decode:
        tokens = size
    else:
        tokens = 0
        for k in range(size):
            tokens += req_prompt[batch[r, k]]
    if given:
        esum = gf[GF_SUM]
    else:
        status, esum = _experts(g, ci, expert, pools, picks, r, tokens)
        if status != DONE:
            g[G_PENDING_MODE] = 2
            return status
    if decode:
        kv = 0
        for k in range(size):
            q = batch[r, k]
            kv = max(kv, req_prompt[q] + gen[q])
        attention = curve(attn_decode, r, size, kv - 1)
    elif ci[C_PER_PROMPT]:
        attention = 0.0
        for k in range(size):
            attention += curve(attn_prefill, r, 0, req_prompt[batch[r, k]])
    else:
        attention = curve(attn_prefill, r, size, tokens)
    layers = ci[C_LAYERS] * (attention + curve(router, r, 0, tokens))
    total = curve(overhead, r, 0, size) + (layers + esum) + curve(lm_head, r, 0, size)
    now = gf[GF_NOW]
    rf[r, RF_START] = now
    schedule(g, heap, now + total, NORMAL, EV_ITER, r)
    return DONE


@njit(cache=True)
def _experts(g, ci, expert, pools, picks, r, tokens):
    """(status, the experts' summed stage time) of one iteration of ``tokens`` tokens on
    replica r, as LatencyModel.experts draws them: a pick of the pool of that many tokens,
    or q picks of the largest pool and one of the remainder's, summed
    (RoutingModel.summed). NEED_EXPERTS when a pool is not built yet (Python builds it, as
    the model does, and plans the experts), NEED_PICKS when the block of picks drawn ahead
    runs out (g[G_NEED]: how many are needed)."""
    table, grid_x, grid_y, slope, beyond = expert
    counts, routed, sums, summed_ok = pools
    block, filled, taken = picks
    largest = ci[C_POOLED_MAX]
    if tokens <= largest:
        if not summed_ok[r, tokens]:
            g[G_ARG] = tokens
            return NEED_EXPERTS, 0.0
        if taken[r] + 1 > filled[r]:
            g[G_NEED] = 1
            return NEED_PICKS, 0.0
        p = block[r, taken[r]]
        taken[r] += 1
        return DONE, sums[r, tokens, p]
    q, rem = tokens // largest, tokens % largest
    if not routed[r, largest] or (rem and not routed[r, rem]):
        g[G_ARG] = tokens
        return NEED_EXPERTS, 0.0
    need = q + (1 if rem else 0)
    if taken[r] + need > filled[r]:
        g[G_NEED] = need
        return NEED_PICKS, 0.0
    width = counts.shape[3]
    c = np.zeros(width, dtype=np.int64)
    for j in range(q):
        p = block[r, taken[r] + j]
        for e in range(width):
            c[e] += counts[r, largest, p, e]
    taken[r] += q
    if rem:
        p = block[r, taken[r]]
        taken[r] += 1
        for e in range(width):
            c[e] += counts[r, rem, p, e]
    times = np.empty(width)
    last = len(table) - 1
    for e in range(width):
        x = c[e]
        if x <= last:
            times[e] = table[x]
        else:  # beyond the grid: Curve1D's linear extrapolation
            times[e] = grid_y + slope * (x - grid_x)
            if math.isnan(beyond[r]) or x > beyond[r]:
                beyond[r] = x
    return DONE, pairwise_sum(times, 0, width)


@njit(cache=True)
def _complete(g, ri, ready, batch, req, seqs, arena, fin, tl, now, r):
    """Scheduler.complete_iteration and the policy's on_complete; the finished requests go
    to fin[] and the timeline, as the executor's on_finish calls after the iteration."""
    req_t, req_prompt, req_out, req_ls = req
    gen, first_t, last_t, fin_t, off, itl_max = seqs
    prefill = ri[r, R_PHASE] == 1
    finished = 0
    n_ready = ri[r, R_N_READY]
    for k in range(ri[r, R_N_BATCH]):
        i = batch[r, k]
        if prefill:
            first_t[i] = now
        before = gen[i]
        gen[i] = before + 1
        if before:
            gap = np.float32(now - last_t[i])
            arena[off[i] + before - 1] = gap
            if before == 1 or gap > itl_max[i]:
                itl_max[i] = gap
        last_t[i] = now
        if before + 1 >= req_out[i]:
            fin_t[i] = now
            ri[r, R_USED] -= req_prompt[i] + req_out[i]
            fin[g[G_FIN]] = i
            g[G_FIN] += 1
            ri[r, R_IN_SYS] -= 1
            finished += 1
        else:
            ready[r, n_ready] = i
            n_ready += 1
            ri[r, R_READY_LS] += req_ls[i]
    ri[r, R_N_READY] = n_ready
    ri[r, R_N_BATCH] = 0
    ri[r, R_ITERS] += 1
    ri[r, R_WAITING_TOKENS] = 1 if prefill else ri[r, R_WAITING_TOKENS] + 1
    ri[r, R_PHASE] = 0
    for _ in range(finished):
        _note(g, ri, tl, now, r)


@njit(cache=True)
def gather(arena, off, lengths, which):
    """The gaps of requests ``which`` (their arena slices), one after another."""
    total = 0
    for i in which:
        total += lengths[i]
    out = np.empty(total, dtype=np.float32)
    k = 0
    for i in which:
        n = lengths[i]
        out[k : k + n] = arena[off[i] : off[i] + n]
        k += n
    return out


@njit(cache=True)
def compact(g, ci, ri, ready, batch, seqs, req, arena):
    """Move the gap slices of the requests in flight (ready or in a batch) to the arena's
    start, in their order there, and free the rest (finished requests were handed over)."""
    off = seqs[4]
    req_out = req[2]
    n = 0
    for r in range(ci[C_REPLICAS]):
        n += ri[r, R_N_READY] + ri[r, R_N_BATCH]
    live = np.empty(n, dtype=np.int64)
    k = 0
    for r in range(ci[C_REPLICAS]):
        for j in range(ri[r, R_N_READY]):
            live[k] = ready[r, j]
            k += 1
        for j in range(ri[r, R_N_BATCH]):
            live[k] = batch[r, j]
            k += 1
    starts = np.empty(n, dtype=np.int64)
    for j in range(n):
        starts[j] = off[live[j]]
    top = 0
    for j in np.argsort(starts):
        i = live[j]
        m = req_out[i] - 1
        if off[i] != top:
            arena[top : top + m] = arena[off[i] : off[i] + m].copy()
            off[i] = top
        top += m
    g[G_TOP] = top
