"""Pipeline parallelism: schedules as data (``schedules.py``), the executor that runs them between stages
(``executor.py``), point-to-point channels, and the split backward of zero-bubble schedules."""
