"""Benchmarks: the benchmark workload (:mod:`.workloads`) and the attention providers
timed against each other (:mod:`.attention`, ``lapse bench attention``); decode steps
(:mod:`.decode`) and training steps (:mod:`.training`). Their settings are in
:mod:`.config`, which imports no torch; each name here loads with its submodule on first use.
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    ".workloads": ("Workload", "WorkloadSpec", "dense_causal_flops", "make_workload"),
})
