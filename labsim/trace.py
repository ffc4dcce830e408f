"""``Trace``: the one output contract of every simulation.

A trace is plain data: a list of spans, each saying that ``rank`` was busy on ``stream``
doing ``kind`` from ``start_s`` to ``end_s``.  Plots, widgets, summaries and tests all read
it; nothing here imports simpy or matplotlib.  ``to_chrome`` writes the Chrome trace-event
JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open: one complete ("X") event per
span, ranks as processes and streams as threads.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("compute", "forward", "backward", "recompute", "optimizer", "comm", "send", "recv",
         "wait", "load", "idle")


@dataclass(frozen=True)
class Span:
    """``rank`` busy on ``stream`` with ``kind`` work from ``start_s`` to ``end_s`` (seconds).

    ``nbytes`` is the payload of a communication span (0 for compute), ``label`` a short
    human description ("fwd mb3", "ring step 2/7"), ``args`` any extra detail for the trace
    viewer.
    """

    rank: int
    stream: str
    kind: str
    start_s: float
    end_s: float
    label: str = ""
    nbytes: float = 0.0
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class Trace:
    """An ordered collection of ``Span`` with summaries and Chrome-trace export."""

    def __init__(self, spans: Iterable[Span] = (), detail: str = "full",
                 rank_label: str = "rank") -> None:
        self.spans: list[Span] = list(spans)
        self.detail = detail  # "full" (every transfer), or a coarser summary level
        self.rank_label = rank_label  # what a rank is: "rank", "pipeline stage", "worker"...

    def add(self, rank: int, stream: str, kind: str, start_s: float, end_s: float,
            label: str = "", nbytes: float = 0.0, **args: object) -> Span:
        if end_s < start_s:
            raise ValueError(f"span ends before it starts: {start_s} > {end_s}")
        span = Span(rank, stream, kind, start_s, end_s, label, nbytes, dict(args))
        self.spans.append(span)
        return span

    def extend(self, spans: Iterable[Span]) -> None:
        self.spans.extend(spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    def __repr__(self) -> str:
        return (f"Trace({len(self.spans)} spans, ranks={len(self.ranks)}, "
                f"makespan={self.makespan_s:.6g} s, detail={self.detail!r})")

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans})

    @property
    def start_s(self) -> float:
        return min((s.start_s for s in self.spans), default=0.0)

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    @property
    def makespan_s(self) -> float:
        return self.end_s - self.start_s

    def filter(self, *, rank: int | None = None, stream: str | None = None,
               kind: str | None = None) -> Trace:
        """The spans matching every given field."""
        return Trace(
            (s for s in self.spans
             if (rank is None or s.rank == rank) and (stream is None or s.stream == stream)
             and (kind is None or s.kind == kind)),
            self.detail, self.rank_label,
        )

    def busy_s(self, rank: int | None = None, kind: str | None = None) -> float:
        """Total span duration (overlaps on different streams counted separately)."""
        return sum(s.duration_s for s in self.filter(rank=rank, kind=kind))

    def time_by_kind(self, rank: int | None = None) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for s in self.filter(rank=rank):
            totals[s.kind] += s.duration_s
        return dict(totals)

    def total_bytes(self, kind: str | None = None) -> float:
        return sum(s.nbytes for s in self.filter(kind=kind))

    def to_dicts(self) -> list[dict]:
        return [asdict(s) for s in self.spans]

    def lanes(self) -> dict[tuple[int, str], list[list[Span]]]:
        """The spans of each (rank, stream) split into lanes, each a time-ordered list of spans
        that do not overlap: concurrent flows of one stream (a rank's eight ring channels) get
        a lane each, as a trace viewer needs, since it draws overlap on one track as nesting."""
        out: dict[tuple[int, str], list[list[Span]]] = {}
        for s in sorted(self.spans, key=lambda sp: (sp.rank, sp.stream, sp.start_s, -sp.end_s)):
            lanes = out.setdefault((s.rank, s.stream), [])
            for lane in lanes:
                if lane[-1].end_s <= s.start_s:
                    lane.append(s)
                    break
            else:
                lanes.append([s])
        return out

    def to_chrome(self, path: str | Path | None = None) -> dict:
        """Chrome trace-event JSON (one "X" event per span, times in µs) that Perfetto and
        chrome://tracing open: a process per rank (named by ``rank_label``), a thread per
        stream and lane (``lanes``); written to ``path`` atomically when given."""
        events: list[dict] = []
        for rank in self.ranks:
            events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                           "args": {"name": f"{self.rank_label} {rank}"}})
        tids: dict[int, int] = defaultdict(int)
        for (rank, stream), lanes in self.lanes().items():
            for i, lane in enumerate(lanes):
                tids[rank] += 1
                name = stream if len(lanes) == 1 else f"{stream} {i + 1}/{len(lanes)}"
                events.append({"name": "thread_name", "ph": "M", "pid": rank,
                               "tid": tids[rank], "args": {"name": name}})
                for s in lane:
                    args = dict(s.args)
                    if s.nbytes:
                        args["bytes"] = s.nbytes
                    events.append({
                        "name": s.label or s.kind, "cat": s.kind, "ph": "X",
                        "ts": s.start_s * 1e6, "dur": s.duration_s * 1e6,
                        "pid": rank, "tid": tids[rank], "args": args,
                    })
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"detail": self.detail}}
        if path is not None:
            path = Path(path)
            if not path.parent.is_dir():
                raise ValueError(f"cannot write the trace to {str(path)!r}: the folder "
                                 f"{str(path.parent)!r} does not exist")
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(doc), encoding="utf-8")
            tmp.replace(path)
        return doc
