"""Benchmarks: the workload of issue 2 (:mod:`.workloads`) and the attention providers
timed against each other (:mod:`.attention`, ``lapse bench attention``)."""

from .workloads import Workload, WorkloadSpec, dense_causal_flops, make_workload

__all__ = ["Workload", "WorkloadSpec", "dense_causal_flops", "make_workload"]
