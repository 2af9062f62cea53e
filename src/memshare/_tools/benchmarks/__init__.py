"""The benchmark harness behind ``python -m memshare bench`` and ``benchmarks/run.py``.

``harness`` runs workloads x contenders (and holds the command line);
``workloads`` defines the workloads and their one registry, with the data of
those on DataFrames and dicts in ``workloads_data``, the pools on small
items in ``workloads_pool`` and the tasks that return their input in
``workloads_returns``; ``runners`` defines the contenders that run the
tasks and the parts of memshare's limit. ``_contender`` runs one contender in
a process of its own, ``processes`` drives it, and ``memory`` samples a
process tree's peak memory. ``machine`` reads sizes and the machine's memory
and load (and refuses a size it cannot hold), ``results`` turns measurements
into rows and ratios, ``report`` writes them as markdown and ``plots`` as
pictures.
"""
