"""A stage's gradient buckets beside its ops' tensor-parallel bytes, as two fluids.

``labsim.step.alone`` evaluates a schedule op by op; when an op's TP collectives and its
stage's gradient buckets share a pipe (``labsim.network.shared_growth``), each moves slower
while both move.  ``BucketStream`` is the stage's queue of buckets, ``beside_stream`` the op
with the buckets that move beside it, ``buckets_of_op`` the buckets an op releases.
"""

from __future__ import annotations

from collections import deque

from labsim.network import Placed


class BucketStream:
    """A stage's gradient buckets in the closed form, reduced in order: each from the later
    of its ready time and the end of the one before, then its latency, then its bytes.
    ``jobs``: the buckets not done, each (ready, latency, seconds alone, growth of the
    stage's TP bytes and of its own bytes while both move: ``shared_growth``); the first
    has begun once ``at`` (when its bytes start) is set, with ``left`` seconds of its bytes
    alone to go as of ``t``; ``free``: the end of the last one done."""

    __slots__ = ("t", "free", "jobs", "at", "left")

    def __init__(self) -> None:
        self.t = self.free = self.left = 0.0
        self.jobs: deque[tuple[float, float, float, float, float]] = deque()
        self.at: float | None = None

    def shares(self) -> bool:
        """Whether the stage's TP bytes slow a bucket queued (the first or the last)."""
        return bool(self.jobs[0][3] or self.jobs[-1][3])

    def begin(self) -> None:
        """The first job starts: its latency from the later of its ready time and ``free``."""
        ready, latency, tau, _, _ = self.jobs[0]
        self.at = (ready if ready > self.free else self.free) + latency
        self.left = tau - latency

    def end(self) -> float:
        """When the stream is done, every job left moving alone from ``t``."""
        free = self.free
        rest = iter(self.jobs)
        if self.at is not None:  # the first has begun
            next(rest)
            free = (self.at if self.at > self.t else self.t) + self.left
        for ready, _, tau, _, _ in rest:
            free = (free if free > ready else ready) + tau
        return free


def beside_stream(st: BucketStream, start: float, work: float, hidden: float, tp_latency: float,
                   tp_moving: float) -> float:
    """End of an op whose TP bytes share pipes with the stage's bucket stream ``st`` (which
    it advances to that end): the event engine's two flows as fluids.

    The op starts at ``start`` and computes ``work`` s; its TP collectives wait
    ``tp_latency`` s in all and move bytes for ``tp_moving`` s alone, a ``hidden`` share of
    each from the op's start and the rest after the compute (and after that share).  Each
    bucket starts at the later of its ready time and the end of the one before, waits its
    latency, then moves its bytes.  While both move, each takes ``1 + g`` times as long
    (the bucket's growths)."""
    h, jobs, inf = hidden, st.jobs, float("inf")
    seg_at, seg_left = ((start + h * tp_latency, h * tp_moving) if h
                        else (start + work + tp_latency, tp_moving))
    first = bool(h)  # moving the hidden share
    if jobs and st.at is None:
        st.begin()
    t, at, left = st.t, st.at, st.left
    tp_shared = b_shared = 1.0  # the head bucket's rates while both move
    if jobs:
        tp_shared, b_shared = 1 / (1 + jobs[0][3]), 1 / (1 + jobs[0][4])
    while True:
        b_on = bool(jobs) and t >= at
        tp_on = t >= seg_at
        tp_rate, b_rate = (tp_shared, b_shared) if tp_on and b_on else (1.0, 1.0)
        t_tp = t + seg_left / tp_rate if tp_on else seg_at
        t_b = (t + left / b_rate if b_on else at) if jobs else inf
        t_next = min(t_tp, t_b)
        if tp_on:
            seg_left = 0.0 if t_next == t_tp else seg_left - (t_next - t) * tp_rate
        if b_on:
            left = 0.0 if t_next == t_b else left - (t_next - t) * b_rate
        t = t_next
        if b_on and t == t_b:  # a bucket done: the next one starts
            st.free = t
            jobs.popleft()
            if jobs:
                st.begin()
                at, left = st.at, st.left
                tp_shared, b_shared = 1 / (1 + jobs[0][3]), 1 / (1 + jobs[0][4])
        if tp_on and t == t_tp:
            if not first:
                break
            first = False
            seg_at = max(start + work, t) + (1 - h) * tp_latency
            seg_left = (1 - h) * tp_moving
    st.t = t
    st.at, st.left = (at, left) if jobs else (None, 0.0)
    return t


def buckets_of_op(st: BucketStream, start: float, end: float, work: float, hidden: float,
                   tp: Placed | None, calls: int, bucket: Placed, n_buckets: int,
                   planned: float, growth: tuple[float, float], beside: dict) -> float:
    """A backward op that reduces ``n_buckets`` gradient buckets, ready evenly over its
    ``planned`` seconds: they join the stage's stream ``st`` (which has buckets queued, or
    whose buckets the stage's TP bytes slow: ``growth``), and the op's end (``end`` alone)
    is priced beside the stream when its TP bytes share pipes with the buckets.  An op that
    finds the stream idle by its first bucket meets it alike whenever it starts: that
    meeting is priced once from 0 (``beside``, by the op's inputs) and shifted."""
    jobs = st.jobs
    if not jobs and tp is not None:
        key = (id(tp.cost), calls, work, planned, id(bucket.cost), n_buckets)
        known = beside.get(key)
        if known is None:  # the same op at 0, its buckets ready at the same offsets
            spec = bucket.latency_s, bucket.alone_s, *growth
            offsets = [planned * (k + 1) / n_buckets for k in range(n_buckets)]
            origin = BucketStream()
            origin.jobs.extend([(x, *spec) for x in offsets])
            after = beside_stream(origin, 0.0, work, hidden, tp.latency_s * calls,
                                   (tp.alone_s - tp.latency_s) * calls)
            known = beside[key] = (offsets[0], after, origin.free, origin.at, origin.left,
                                   [(x, *spec) for x in offsets[n_buckets - len(origin.jobs):]],
                                   n_buckets > len(origin.jobs))
        first, after, free, at, left, rest, done = known  # the op's end and the stream, from 0
        if st.free <= start + first:  # idle by the op's first bucket: shifted
            jobs.extend([(start + x, *job) for x, *job in rest])
            st.t = start + after
            if done:
                st.free = start + free
            st.at, st.left = (None, 0.0) if at is None else (start + at, left)
            return st.t
    spec = bucket.latency_s, bucket.alone_s, *growth
    jobs.extend([(start + planned * (k + 1) / n_buckets, *spec) for k in range(n_buckets)])
    if tp is None or not st.shares():
        return end
    return beside_stream(st, start, work, hidden, tp.latency_s * calls,
                          (tp.alone_s - tp.latency_s) * calls)


