"""How long each explorer takes to redraw after a control change (figure function + PNG).

    python benchmarks/widgets.py

A values-only explorer (memory, ZeRO: closed forms and bars) should redraw well under half a
second; simulated ones (collectives, data parallel, loader) take what their simulation takes.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import labsim.widgets as widgets  # noqa: E402

EXPLORERS = ["memory_explorer", "explore_zero", "explore_collectives", "explore_dataloader",
             "explore_data_parallel"]


def main() -> None:
    print(f"{'explorer':<24} {'redraw median':>14} {'max':>8}")
    for name in EXPLORERS:
        explorer = getattr(widgets, name)()
        slider = next(c for c in explorer.controls.values() if "Slider" in type(c).__name__)
        options = list(getattr(slider, "options", None) or range(slider.min, slider.max + 1))
        times = []
        for value in (options * 2)[:8]:
            start = time.perf_counter()
            slider.value = value  # outside a kernel: the redraw runs here, synchronously
            _ = explorer.png
            times.append(time.perf_counter() - start)
        print(f"{name:<24} {statistics.median(times) * 1e3:11.0f} ms {max(times) * 1e3:6.0f} ms")


if __name__ == "__main__":
    main()
