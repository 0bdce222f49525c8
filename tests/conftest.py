"""Shared fixtures. `--regen-goldens` rewrites tests/goldens/* from the code.
Tests marked `cuda` are skipped where there is no CUDA device."""

import multiprocessing.util
import os
import shutil
import tempfile

import pytest

from meshplan.runtime.kernel_cache import cache_folder

# The capture cache of this run alone, removed at its end.
_OWN_CACHE = None if "MESHPLAN_CACHE_DIR" in os.environ else \
    tempfile.mkdtemp(prefix="meshplan-test-cache-")
if _OWN_CACHE is not None:
    os.environ["MESHPLAN_CACHE_DIR"] = _OWN_CACHE

# A temporary folder of this process (a pytest worker) and the processes it
# starts, removed at its end: a test that looks for what its ranks left in
# the temporary folder (an AOTInductor loader's unpacked package) sees its
# own, not a concurrent worker's. Inductor's cache stays the machine's one.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_folder().parent))
_OWN_TMP = tempfile.mkdtemp(prefix="meshplan-test-tmp-")
os.environ["TMPDIR"] = tempfile.tempdir = _OWN_TMP


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    # after multiprocessing's own temporary folder (inside it, removed by its
    # finalizer at exit, priority -100) is gone: removing it first made that
    # finalizer print a FileNotFoundError traceback at every pytest exit
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(_OWN_TMP,),
                                  kwargs={"ignore_errors": True}, exitpriority=-101)


def pytest_addoption(parser):
    parser.addoption("--regen-goldens", action="store_true",
                     help="rewrite golden files instead of comparing with them")


@pytest.fixture
def regen(request) -> bool:
    return request.config.getoption("--regen-goldens")


def pytest_collection_modifyitems(config, items):
    import torch

    # The slow tests first, in their own order: with workers (`-n 2`, the
    # README's command) the longest are shared out first, not left for last.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (on a GPU machine: pytest -m cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls on one thread: measured 4x faster on the shared 2-core
    machine (llama tp2*pp2 case: 26.7 s -> 6.6 s), nearly all of it eager."""
    yield from _one_thread()


@pytest.fixture
def one_torch_thread_here():
    """One torch thread for one test: ranks on threads then build (and load)
    the Inductor runs that spawned ranks (one thread each) build."""
    yield from _one_thread()
