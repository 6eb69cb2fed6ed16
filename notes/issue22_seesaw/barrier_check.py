#!/usr/bin/env python3
"""Desk check of mla_decode_wgmma_seesaw.cu's named-barrier protocol (CPU, no GPU): the three warpgroups' programs
as the source runs them (the same loops, conditions and barrier IDs / counts), executed under many random
interleavings for every tile count 0..MAXN, both KVWALL_SS_ORDER settings. A warpgroup is one party of 128 threads.

Checked: no deadlock; every barrier phase completes with exactly its count (no party arrives twice in one phase:
two phases' arrivals never mix); nothing left pending at the end; and, with vector clocks through the barriers
(arrivers -> syncers), every shared-memory hand-off is ordered: conversion -> scores (RAW), scores / P V / ldmatrix
of tile j -> conversion of tile j + 2 (WAR), P_j / m_j / alpha_j written -> read by the other consumer (RAW),
read -> the next write of the same slot (WAR), the consumers' row sums and the producer's flag -> the final write.

    python3 notes/issue22_seesaw/barrier_check.py        # exits 1 on the first violation
"""

from __future__ import annotations

import random
import sys

QB, READY0, READY1, FREE0, FREE1, SMD0, SMD1, END, SDONE, SDEAD0 = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
COUNT = {QB: 256, READY0: 256, READY1: 256, FREE0: 384, FREE1: 384, SMD0: 256, SMD1: 256, END: 384, SDONE: 256,
         SDEAD0: 128}
# SDEAD0 is consumer 0's own four warps (one party here: it always completes at once). What it orders -- every warp
# of consumer 0 past its S_i wgmma wait before any warp's stmatrix of P_i over the rope rows -- lies inside a party,
# below this model's grain (a warpgroup is one party); it is in the phase counts so that the model's barrier list
# stays the source's.
ROLES = ("c0", "c1", "p")


def producer(n):
    # fetch / load tile 0, fetch tile 1 (no barriers); the loop of the source
    for i in range(n):
        if i >= 2:
            yield ("sync", FREE1 if i & 1 else FREE0)
        yield ("ev", ("write_buf", i % 2, i))          # conversion of tile i into buffer i % 2 (all 9 chunks)
        yield ("arrive", READY1 if i & 1 else READY0)
    yield ("ev", ("write_flag",))
    yield ("arrive", END)                               # bar.red.or: counts as arrive + wait
    yield ("sync_end", END)


def consumer(C, n, order, wg_sync=True):
    ready = READY1 if C else READY0
    free_own, free_oth = (FREE1, FREE0) if C else (FREE0, FREE1)
    smd_own, smd_oth = (SMD1, SMD0) if C else (SMD0, SMD1)
    yield ("ev", ("write_init",))                       # Q, s_rc, s_m slot 1 = -inf
    yield ("sync", QB)

    def scores(i):
        yield ("sync", ready)
        yield ("ev", ("read_buf", C, i))                # S_i reads buffer C (K, all chunks incl. rope)

    def softmax(i):
        yield ("ev", ("read_m", 1 - C, i - 1))          # m_{i-1} from slot 1 - C (init for i = 0)
        if C == 0 and wg_sync:
            yield ("sync", SDEAD0)                      # all four warps past S_i's wait (KVWALL_SS_WG_SYNC)
        yield ("ev", ("write_P", C, i))                 # stmatrix P_i into chunk 8 of buffer C
        yield ("ev", ("write_m", C, i))                 # m_i, alpha_i into slot C
        yield ("arrive", smd_own)

    def pv_own(i, reload):
        if reload:
            yield ("ev", ("read_P", C, i))
        yield ("ev", ("read_buf", C, i))                # V_i[:, 256C ..]
        if i + 2 < n:
            yield ("arrive", free_own)

    def pv_other(j):
        yield ("ev", ("read_m", 1 - C, j))              # alpha_j (same slot as m_j)
        yield ("ev", ("read_P", 1 - C, j))              # ldmatrix P_j
        yield ("ev", ("read_buf", 1 - C, j))            # V_j[:, 256C ..]
        if j + 2 < n:
            yield ("arrive", free_oth)

    if C == 0:
        for i in range(0, n, 2):
            yield from scores(i)
            yield from softmax(i)
            if order and i + 1 < n:
                yield ("sync", SDONE)
            yield from pv_own(i, False)
            if i + 1 < n:
                yield ("sync", smd_oth)
                yield from pv_other(i + 1)
    else:
        for i in range(1, n, 2):
            yield from scores(i)
            if order:
                yield ("arrive", SDONE)
            yield ("sync", smd_oth)
            yield from softmax(i)
            yield from pv_other(i - 1)
            yield from pv_own(i, True)
        if n & 1:
            yield ("sync", smd_oth)
            yield from pv_other(n - 1)
    yield ("ev", ("write_l", C))
    yield ("arrive", END)
    yield ("sync_end", END)
    yield ("ev", ("read_final",))                       # reads s_l[0..1], s_m, the flag; writes the output


def run(n, order, rng):
    progs = {"c0": consumer(0, n, order), "c1": consumer(1, n, order), "p": producer(n)}
    vc = {r: {q: 0 for q in ROLES} for r in ROLES}
    pending = {r: None for r in ROLES}                  # the op a role is blocked on / about to run
    done = set()
    # barrier phase state: parties arrived (set), joined clock, waiting syncers
    bars = {b: {"in": set(), "clock": {q: 0 for q in ROLES}, "wait": set(), "phases": 0} for b in COUNT}
    events = []                                         # (role, clock snapshot, event)

    def tick(r):
        vc[r][r] += 1

    def join(a, b):
        return {q: max(a[q], b[q]) for q in ROLES}

    def arrive(r, b, waits):
        st = bars[b]
        if r in st["in"]:
            raise AssertionError(f"n={n} order={order}: {r} arrives twice in one phase of barrier {b}")
        st["in"].add(r)
        st["clock"] = join(st["clock"], vc[r])
        if waits:
            st["wait"].add(r)
        if 128 * len(st["in"]) > COUNT[b]:
            raise AssertionError(f"n={n}: barrier {b} over its count")
        if 128 * len(st["in"]) == COUNT[b]:             # the phase completes: syncers take the arrivers' clock
            for w in st["wait"]:
                vc[w] = join(vc[w], st["clock"])
                pending[w] = None
            st.update({"in": set(), "clock": {q: 0 for q in ROLES}, "wait": set(), "phases": st["phases"] + 1})
            return True
        return False

    while len(done) < 3:
        runnable = [r for r in ROLES if r not in done and pending[r] is None]
        if not runnable:
            raise AssertionError(f"n={n} order={order}: DEADLOCK, blocked: "
                                 f"{ {r: pending[r] for r in ROLES if r not in done} }")
        r = rng.choice(runnable)
        try:
            op = next(progs[r])
        except StopIteration:
            done.add(r)
            continue
        tick(r)
        kind = op[0]
        if kind == "ev":
            events.append((r, dict(vc[r]), op[1]))
        elif kind == "arrive":
            if op[1] == END:
                pending[r] = ("end",)
                arrive(r, END, True)
                continue
            arrive(r, op[1], False)
        elif kind == "sync":
            pending[r] = op
            arrive(r, op[1], True)
        elif kind == "sync_end":
            pass                                         # the wait was registered with the END arrive
    for b, st in bars.items():
        if st["in"]:
            raise AssertionError(f"n={n} order={order}: barrier {b} left with pending arrivals {st['in']}")
    return events, {b: st["phases"] for b, st in bars.items()}


def hb(e1, e2):
    (r1, c1, _), (_, c2, _) = e1, e2
    return c1[r1] <= c2[r1]


def check_order(n, events):
    by = {}
    for e in events:
        by.setdefault(e[2], []).append(e)

    def need(a, b, what):
        if not hb(a, b):
            raise AssertionError(f"n={n}: not ordered: {what}: {a[2]} ({a[0]}) before {b[2]} ({b[0]})")

    for i in range(n):
        b = i % 2
        w = by[("write_buf", b, i)][0]
        for rd in by.get(("read_buf", b, i), []):
            need(w, rd, f"conversion of tile {i} -> its readers")
        if i + 2 < n:
            w2 = by[("write_buf", b, i + 2)][0]
            for rd in by.get(("read_buf", b, i), []) + by.get(("read_P", b, i), []):
                need(rd, w2, f"readers of tile {i} -> conversion of tile {i + 2}")
        wp = by[("write_P", b, i)][0]
        for rd in by.get(("read_P", b, i), []):
            need(wp, rd, f"P_{i} written -> read")
            if i + 2 < n:
                need(rd, by[("write_P", b, i + 2)][0], f"P_{i} read -> P_{i + 2} written")
        wm = by[("write_m", b, i)][0]
        for rd in by.get(("read_m", b, i), []):
            need(wm, rd, f"m_{i}/alpha_{i} written -> read")
            if i + 2 < n:
                need(rd, by[("write_m", b, i + 2)][0], f"m_{i} read -> m_{i + 2} written")
        # the conversion of tile i + 2 must follow the scores of tile i (chunk 8 held P_i after them)
        if i + 2 < n:
            need(wp, by[("write_buf", b, i + 2)][0], f"P_{i} written -> rope of tile {i + 2} converted")
    for rd in by.get(("read_m", 1, -1), []):             # tile 0 reads the initialized slot 1
        for w in by[("write_init",)]:
            need(w, rd, "prologue -> tile 0's softmax")
    finals = by[("read_final",)]
    for f in finals:
        for w in by[("write_l", 0)] + by[("write_l", 1)] + by[("write_flag",)]:
            need(w, f, "row sums / flag -> final write")
        if n:
            need(by[("write_m", (n - 1) % 2, n - 1)][0], f, "last m -> final write")


def main() -> int:
    rng = random.Random(0)
    maxn, trials = 12, 400
    for order in (0, 1):
        for n in range(0, maxn + 1):
            for _ in range(trials):
                events, phases = run(n, order, rng)
                check_order(n, events)
            ready = (n + 1) // 2, n // 2
            expect = {READY0: ready[0], READY1: ready[1], SMD0: ready[0], SMD1: ready[1],
                      FREE0: max(0, (n - 2 + 1) // 2), FREE1: max(0, (n - 2) // 2), QB: 1, END: 1,
                      SDONE: n // 2 if order else 0, SDEAD0: (n + 1) // 2}
            if phases != expect:
                print(f"FAIL n={n} order={order}: phases {phases} != {expect}")
                return 1
        print(f"order={order}: tiles 0..{maxn}, {trials} random interleavings each: no deadlock, no mixed phase, "
              "nothing pending, every hand-off ordered; phases per barrier as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
