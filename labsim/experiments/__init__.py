"""Real PyTorch measurements the labs run and show, one module per topic.

Each function here measures something on this machine (a format's limits, what autocast does,
a checkpointing plan's peak, a DataLoader's busy fraction, all-reduce time on gloo processes,
the bytes ZeRO saves, int8 speed and accuracy) and returns a small result object; a notebook
cell calls it and shows the result.  They take the learner's functions as arguments where a
lab measures the learner's own code, and never run an exercise's reference (``labsim.checks``).
"""
