"""The benchmark harness behind ``python -m memshare bench`` and ``benchmarks/run.py``.

``harness`` runs workloads x contenders and writes the tables, ``workloads``
defines both, ``_contender`` runs one contender in a process of its own,
``processes`` drives it, and ``memory`` samples a process tree's peak memory.
"""
