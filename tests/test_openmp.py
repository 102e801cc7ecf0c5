"""OpenMP thread pools (``eagle.utils.openmp``): the thread that loaded a model, and a thread whose generation ended,
hold no pool, so that a server's model worker (another thread) runs torch on every CPU. A pool's threads are the
process's threads (``/proc/self/task``), so these tests count them."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from eagle.application.worker import GenerationParams, Job, ModelWorker
from eagle.model.ea_model import EaModel
from eagle.utils.openmp import release_openmp_threads

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or "OpenMP" not in torch.__config__.parallel_info(),
    reason="counts the threads of a Linux process whose torch runs on OpenMP")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(expected: int, timeout: float = 5.0) -> int:
    """The thread count once it reaches ``expected`` (threads leave asynchronously), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while os_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads()


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def parallel_work() -> torch.Tensor:
    a = torch.randn(256, 256)
    return a @ a  # large enough for torch to run it on its pool


def test_release_frees_the_calling_threads_pool_and_torch_gets_it_back(two_threads):
    parallel_work()
    assert release_openmp_threads()
    without = settle(os_threads())
    reference = parallel_work()
    assert os_threads() == without + 1  # the pool's second thread
    assert release_openmp_threads()
    assert settle(without) == without
    a = torch.randn(256, 256)
    assert torch.allclose(a @ a, a.double().matmul(a.double()).float(), atol=1e-3)  # torch works as before
    assert reference.shape == (256, 256)


def test_the_serving_worker_owns_its_threads_pool(tiny_pair, two_threads):
    """The model is loaded on this thread and generates on the serving worker's (what the server and the web UI
    do): starting the worker frees this thread's pool, and the worker holds none once its batch has ended (while
    it lives on, waiting for the next job)."""
    base_dir, head_dir = tiny_pair
    model = EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir), total_token=6,
                                    depth=2, top_k=2)
    release_openmp_threads()
    before = settle(os_threads())
    parallel_work()
    assert os_threads() == before + 1  # running torch made this thread a pool
    worker = ModelWorker(model)
    worker.start()  # the worker thread (one more thread) and no pool left on this one
    assert settle(before + 1) == before + 1
    done = threading.Event()
    updates = []
    worker.submit(Job([1, 40, 41, 42, 43], GenerationParams(max_new_tokens=6),
                      deliver=lambda update: updates.append(update) or (update.final and done.set())))
    assert done.wait(60)
    assert settle(before + 1) == before + 1  # the worker alone, its pool freed when its batch ended
    worker.close()
    assert updates[-1].finish_reason in ("stop", "length") and sum(len(u.new_tokens) for u in updates) == 6
