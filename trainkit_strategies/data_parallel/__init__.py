"""Data parallelism: every rank runs the whole model on its share of the batch.

``single`` (one process), ``ddp`` (bucketed all-reduce, optionally PowerSGD-compressed), the ZeRO stages 1 and 2
(``zero1``, ``zero2``: the optimizer state, and then the gradients, partitioned), ``zero_offload`` (ZeRO-Offload:
the partition and its Adam in host memory), and 1-bit Adam's compressed communication.
"""
