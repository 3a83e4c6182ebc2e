import os

# One intra-op thread per worker keeps the pipeline tests from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a folder named gpu matches it
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=["tags", "ordered"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both P2P transports: tag-matched (gloo's default) and order-matched (what NCCL runs), on gloo."""
    if request.param == "ordered":
        monkeypatch.setenv("FASTPIPE_P2P", "ordered")  # inherited by the spawned ranks
    else:
        monkeypatch.delenv("FASTPIPE_P2P", raising=False)
    return str(request.param)
