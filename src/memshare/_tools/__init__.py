"""The command-line tools: ``python -m memshare {doctor,clean,bench}`` and the benchmark harness.

No runtime module imports this package: sharing arrays never loads the
tools, and the tools use the runtime only through its modules' names.
"""
