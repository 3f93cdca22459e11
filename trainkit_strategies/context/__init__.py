"""Context parallelism: each rank of a ``cp`` group holds a slice of every sequence, and attention runs across the
group (``ring.py``: ring attention, or K/V all-gathered), with the causal load balancing that gives every rank
equal work."""
