"""What a strategy holds and moves, said without running it: byte accounting (``memory.py``: what a rank holds, what
autograd saves) and what a strategy reports of itself to ``trainkit estimate`` and ``strategy="auto"``
(``reports.py``)."""
