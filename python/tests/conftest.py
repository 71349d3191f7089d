import pytest
import torch

import ferrite

HAS_CUDA = torch.cuda.is_available() and ferrite.cuda_status()[0] > 0

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch and ferrite both see one)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_report_header(config):
    n, why = ferrite.cuda_status()
    return [f"ferrite {ferrite.__version__}, torch {torch.__version__}, ferrite CUDA devices: {n}" + (f" ({why})" if why else "")]
