"""Developer tool (GPU): a decode step's cache write in the query/key launch (`PagedOscarLayer.prepare_decode`, one
launch) against the query/key launch followed by the write launch (`AttendingLayer.prepare_decode`), timed as whole
CUDA-graph decode steps, in turn in one process. Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_decode_write_fusion.py [--contexts 100000,30000] [--batch 1]
"""
import sys

sys.path.insert(0, "scripts")
from check_static_decode import ablation_arguments, sweep  # noqa: E402
from oscarkv.integrations.paged import AttendingLayer, PagedOscarLayer  # noqa: E402

shipped = PagedOscarLayer.prepare_decode


def using(prepare):
    def use():
        PagedOscarLayer.prepare_decode = prepare
    return use


sweep(ablation_arguments(), {"one launch": using(shipped), "two launches": using(AttendingLayer.prepare_decode)})
PagedOscarLayer.prepare_decode = shipped
