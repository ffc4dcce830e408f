"""The torch.distributed reference code, one module per parallelism axis (picotron's layout).

``data_parallel``: DDP by hand (``DataParallelNaive`` -> ``DataParallelBucket``); ``zero``:
ZeRO-1 around any torch.optim optimizer and FSDP2's ``fully_shard``; ``tensor_parallel``:
Megatron's column- and row-parallel MLP with the ``f`` / ``g`` operators; ``pipeline``: stages
on processes running a schedule from ``labsim.pipeline`` with point-to-point sends.  Each
module's ``demo(rank, world)`` runs under ``torchrun --nproc_per_node=N -m labsim.lab.worker
labsim.parallel.<axis>:demo`` (gloo on CPUs, NCCL on GPUs, the model on the rank's device) and
checks itself against one process.  Schedules as data and closed forms live in the values
layer (``labsim.pipeline``, ``labsim.memory``, ``labsim.collectives``).
"""
