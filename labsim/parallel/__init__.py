"""One module per parallelism axis: what each axis does, as data and closed forms (no simpy).

``pipeline``: pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as per-stage op lists, and the
closed-form bubble.
"""
