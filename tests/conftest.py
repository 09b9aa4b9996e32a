import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Import megatron once in the pytest process so forked ranks start in milliseconds.
import megatron.core  # noqa: E402,F401
import pytest  # noqa: E402

from megatron_hetermoe.parallel import cpu_backend  # noqa: E402

cpu_backend.apply()


@pytest.fixture(scope="session")
def tiny():
    from megatron_hetermoe.config import ModelConfig

    return ModelConfig.load("tiny")
