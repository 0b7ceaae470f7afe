import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray (tests/distributed/test_env_ray.py, the recipe's Ray backend) keeps every session's logs and sockets under its temp folder;
# the tests' sessions go to a folder of this run, removed at its end. (Short: Ray's socket paths must stay < 108 bytes.)
if "RAY_TMPDIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="exray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    atexit.register(shutil.rmtree, os.environ["RAY_TMPDIR"], True)
if os.environ.get("EXREPLAY_TEST_DEVICE", "cpu") == "cuda":
    # cuBLAS picks among reduction orders unless its workspace is fixed; with deterministic algorithms a training run
    # repeats bit for bit, as the equality tests against TRL's GRPOTrainer need.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("EXREPLAY_TEST_DEVICE", "cpu") == "cuda":
    torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_collection_modifyitems(config, items):
    # The fast lane (`-m "not slow"`, the inner loop; README "Tests") is the unit tier and the few integration tests
    # marked `fast`: every other test of tests/integration, tests/distributed and benchmarks/tests is slow.
    for item in items:
        tier = item.path.relative_to(config.rootpath).parts[:2]
        if tier != ("tests", "unit") and "fast" not in item.keywords:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("EXREPLAY_TEST_DEVICE", "cpu") == "cuda" and os.environ.get("EXREPLAY_TEST_BF16", "0") == "1":
        skip = pytest.mark.skip(reason="compares with float32 arithmetic; the bf16 pass trains under bf16 autocast")
        for item in items:
            if "float32" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_torch_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def filled_pool(tmp_path_factory):
    """A saved tiny model and a pool filled by 4 steps with it (`tests/loss_check.build_filled_pool`), built once."""
    from loss_check import build_filled_pool

    return build_filled_pool(tmp_path_factory.mktemp("filled"))
