"""The worker process on its own: calls, callbacks, errors, and deaths (with a fake backend)."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from hosted_tinker.core.errors import RolledBack, UserError, WorkerCrashed, WorkerError, WorkerStartFailed
from hosted_tinker.core.messages import Listener, dumps
from hosted_tinker.core.types import Capabilities, ForwardBackwardBatch, LoraSpec
from hosted_tinker.server.workers.backend import ProcessBackend, one_worker
from hosted_tinker.server.workers.process import WorkerProcess

pytestmark = pytest.mark.timeout(120)  # worker processes: slow, but for the watchdog's own test


class FakeBackend:
    """Picklable by name, so the spawned worker can build it. ``loss_fn`` picks the behaviour."""

    capabilities = Capabilities(
        backend="fake", arch="Fake", losses=("cross_entropy",), max_seq_len=8, max_tokens_per_batch=8, vocab_size=8
    )

    def __init__(self) -> None:
        self.adapters: set[str] = set()

    # A worker serves a trainer and a sampler (``rank.serve.Rank``): here both are this fake.
    @property
    def trainer(self) -> FakeBackend:
        return self

    @property
    def sampler(self) -> FakeBackend:
        return self

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        if model_id == "poison" and lora.rank == 2:  # rank 2: as restored (see Recovery below)
            os.kill(os.getpid(), signal.SIGKILL)
        self.adapters.add(model_id)

    def delete_adapter(self, model_id: str) -> None:
        self.adapters.discard(model_id)

    def load_state(self, model_id: str, state: object, *, with_optimizer: bool) -> None:
        pass

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self.adapters

    def forward_backward(self, model_id: str, batch: ForwardBackwardBatch) -> str:
        if batch.loss_fn == "user":
            raise UserError("that is your mistake")
        if batch.loss_fn == "oom":
            raise MemoryError("cannot allocate 1 TiB")
        if batch.loss_fn == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if batch.loss_fn == "hang":
            time.sleep(120)
        if batch.loss_fn == "realtime-signal":
            signal.signal(signal.SIGRTMIN + 1, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGRTMIN + 1)
        return f"{model_id}: ok, pid {os.getpid()}"

    def chatter(self, seconds: float, tick) -> str:
        for i in range(int(seconds * 10)):
            time.sleep(0.1)
            tick(i)
        return "done"

    def generate(self, key: str | None, specs: list, admit=None, on_token=None) -> list:
        specs = [*specs, *admit(), *admit()]
        if on_token is not None:
            for i, spec in enumerate(specs):
                on_token(i, 0, ord(spec), -1.0)
                if spec == "x":
                    on_token(i, 0, 0, "a listener that raises must not stop the call")
        return specs


def batch(loss_fn: str) -> ForwardBackwardBatch:
    return ForwardBackwardBatch(data=[], loss_fn=loss_fn, loss_config={}, forward_only=False)


@pytest.fixture
def backend():
    backend = ProcessBackend(one_worker(FakeBackend))
    assert backend.capabilities.backend == "fake"
    yield backend
    backend.close()


@pytest.mark.slow
def test_calls_and_callbacks_cross_the_process(backend: ProcessBackend):
    backend.trainer.create_adapter("m", LoraSpec(rank=1, seed=0))
    assert backend.trainer.has_adapter("m")
    pid = backend.status()["pid"]
    assert backend.trainer.forward_backward("m", batch("cross_entropy")) == f"m: ok, pid {pid}"
    assert pid != os.getpid()
    arrivals = iter([["b"], ["c"]])
    assert backend.sampler.generate(None, ["a"], admit=lambda: next(arrivals)) == ["a", "b", "c"]


@pytest.mark.slow
def test_listeners_hear_every_notification_in_order(backend: ProcessBackend):
    """A listener (``on_token``) is notified without a round trip per call, in order; one that
    raises is logged and the call still returns."""
    heard = []

    def on_token(request: int, sample: int, token: int, logprob: float) -> None:
        if isinstance(logprob, str):
            raise ValueError(logprob)
        heard.append((request, chr(token)))

    arrivals = iter([["x"], ["c"]])
    assert backend.sampler.generate(None, ["a"], admit=lambda: next(arrivals), on_token=on_token) == [
        "a",
        "x",
        "c",
    ]
    assert heard == [(0, "a"), (1, "x"), (2, "c")]


@pytest.mark.slow
def test_tensors_cross_the_pipe_intact():
    """Tensors travel as numpy buffers: every dtype we send (bfloat16 as its bits), any strides,
    and what numpy cannot hold (sparse) by torch's own reduction."""
    sent = {
        "strided": torch.randn(3, 4)[:, ::2],
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "int64": torch.arange(4),
        "needs_grad": torch.tensor([1.5, -2.0], requires_grad=True),
        "empty": torch.zeros(0, 7),
        "sparse": torch.randn(4).to_sparse(),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "float8": torch.randn(4).to(torch.float8_e4m3fn),  # torch's own pickling fails on this one
        "complex32": torch.randn(3, dtype=torch.complex64).to(torch.complex32),
    }
    got = pickle.loads(dumps(("ok", sent)))[1]
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and not got[name].requires_grad, name
        assert torch.equal(_bytes(got[name]), _bytes(tensor)), name


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Its values as bytes, whatever the dtype (== on float8 or complex32 is not implemented)."""
    return tensor.detach().resolve_conj().to_dense().contiguous().view(torch.uint8)


@pytest.mark.slow
def test_errors_fail_the_call_and_keep_the_worker(backend: ProcessBackend):
    pid = backend.status()["pid"]
    with pytest.raises(UserError, match="your mistake"):
        backend.trainer.forward_backward("m", batch("user"))
    with pytest.raises(WorkerError, match="MemoryError: cannot allocate"):
        backend.trainer.forward_backward("m", batch("oom"))
    with pytest.raises(WorkerError, match="the server's admit failed: ZeroDivisionError"):
        backend.sampler.generate(None, [], admit=lambda: 1 / 0)
    status = backend.status()
    ranks = status.pop("ranks")
    assert status == {"pid": pid, "pids": [pid], "alive": True, "restarts": 0, "last_death": None}
    # Each answer, a failure's too, brings the rank's memory (``rank.memory``).
    assert ranks[0]["pid"] == pid and ranks[0]["device"] == "cpu" and ranks[0]["memory"]["rss"] > 0
    assert backend.trainer.forward_backward("m", batch("cross_entropy")).endswith(str(pid))


class Recovery:
    """Restores every model by recreating it (rank 2 marks a restored one); records the calls."""

    def __init__(self, backend: ProcessBackend) -> None:
        self.backend = backend
        self.restored: list[str] = []
        self.lost: dict[str, str] = {}

    def restore(self, model_id: str) -> str:
        self.backend.trainer.create_adapter(model_id, LoraSpec(rank=2, seed=0))
        self.restored.append(model_id)
        return "was restored from its checkpoint"

    def lose(self, model_id: str, why: str) -> str:
        self.lost[model_id] = why
        return f"{why} and is lost"


@pytest.mark.slow
def test_death_mid_call_restarts_restores_and_tells_the_others(backend: ProcessBackend):
    recovery = backend.recovery = Recovery(backend)
    for model_id in ("a", "b", "c"):
        backend.trainer.create_adapter(model_id, LoraSpec(rank=1, seed=0))
    old_pid = backend.status()["pid"]
    with pytest.raises(WorkerCrashed) as crash:
        backend.trainer.forward_backward("a", batch("die"))
    assert f"pid {old_pid}) was killed by SIGKILL" in crash.value.reason
    assert crash.value.message_for("a").endswith("Model a was restored from its checkpoint")
    assert "Model" not in crash.value.message_for("other")  # other tenants' models go unmentioned
    assert recovery.restored == ["a", "b", "c"]
    status = backend.status()
    assert status["restarts"] == 1 and status["alive"] and status["pid"] != old_pid
    assert backend.trainer.has_adapter("b")

    # a's client was told by its failed request; b's next training call tells b's, once.
    assert backend.trainer.forward_backward("a", batch("cross_entropy")).startswith("a: ok")
    with pytest.raises(RolledBack, match=r"while running another request; .* model b was restored from its"):
        backend.trainer.forward_backward("b", batch("cross_entropy"))
    assert backend.trainer.forward_backward("b", batch("cross_entropy")) == f"b: ok, pid {status['pid']}"
    # Loading a state makes c's rollback moot: no notice after it.
    backend.trainer.load_state("c", None, with_optimizer=True)
    assert backend.trainer.forward_backward("c", batch("cross_entropy")).startswith("c: ok")


@pytest.mark.slow
def test_a_model_that_kills_the_new_worker_too_is_given_up(backend: ProcessBackend):
    recovery = backend.recovery = Recovery(backend)
    for model_id in ("a", "poison", "b"):
        backend.trainer.create_adapter(model_id, LoraSpec(rank=1, seed=0))
    with pytest.raises(WorkerCrashed) as crash:
        backend.trainer.forward_backward("a", batch("die"))
    # a went onto the worker that poison then killed, so a goes onto the next one again.
    assert recovery.restored == ["a", "a", "b"] and list(recovery.lost) == ["poison"]
    assert "killed the new worker too while being restored" in crash.value.restored["poison"]
    assert backend.status()["restarts"] == 2 and backend.status()["alive"]
    assert (
        backend.trainer.has_adapter("a")
        and backend.trainer.has_adapter("b")
        and not backend.trainer.has_adapter("poison")
    )


@pytest.mark.slow
def test_a_worker_that_cannot_start_keeps_the_models_owed(tmp_path: Path):
    broken = tmp_path / "broken"
    backend = ProcessBackend(one_worker(functools.partial(FlakyBackend, str(broken))))
    try:
        recovery = backend.recovery = Recovery(backend)
        for model_id in ("a", "b"):
            backend.trainer.create_adapter(model_id, LoraSpec(rank=1, seed=0))
        broken.touch()
        os.kill(backend.status()["pid"], signal.SIGKILL)
        backend._group.workers[0].process.join(10)
        with pytest.raises(WorkerStartFailed, match="could not start: OSError: the disk is gone"):
            backend.ensure_alive()
        broken.unlink()
        backend.ensure_alive()
        assert recovery.restored == ["a", "b"] and backend.trainer.has_adapter("a") and backend.trainer.has_adapter("b")
    finally:
        backend.close()


class FlakyBackend(FakeBackend):
    """A FakeBackend that cannot start while the file ``broken`` exists."""

    def __init__(self, broken: str) -> None:
        if os.path.exists(broken):
            raise OSError("the disk is gone")
        super().__init__()


@pytest.mark.slow
def test_a_hung_call_kills_the_worker_and_the_next_call_runs():
    backend = ProcessBackend(one_worker(FakeBackend), call_timeout_s=1.0)
    try:
        backend.trainer.create_adapter("m", LoraSpec(rank=1, seed=0))
        with pytest.raises(WorkerCrashed, match=r"did not answer forward_backward within 1.0 s and was killed"):
            backend.trainer.forward_backward("m", batch("hang"))
        assert backend.trainer.forward_backward("m", batch("cross_entropy")).startswith("m: ok")
    finally:
        backend.close()


@pytest.mark.slow
def test_a_long_call_that_keeps_talking_is_not_cut_off():
    """Callbacks and notifications (streamed tokens) are signs of life: the limit starts again."""
    worker = WorkerProcess(FakeBackend, call_timeout_s=1.0)
    try:
        worker.wait_ready(60)
        ticks = []
        assert worker.call("chatter", 2.5, tick=Listener(ticks.append)) == "done"
        assert len(ticks) >= 20
    finally:
        worker.stop()


@pytest.mark.slow
def test_odd_deaths_and_answers_are_reported(backend: ProcessBackend):
    with pytest.raises(WorkerError, match="the answer could not be sent"):
        backend.sampler.generate(None, [], admit=lambda: [lambda: None])  # a lambda cannot be pickled
    with pytest.raises(WorkerCrashed, match=r"was killed by signal \d+"):  # no name: a real-time one
        backend.trainer.forward_backward("m", batch("realtime-signal"))


@pytest.mark.slow
def test_death_while_idle_is_repaired_before_the_next_call(backend: ProcessBackend):
    old_pid = backend.status()["pid"]
    os.kill(old_pid, signal.SIGKILL)
    backend._group.workers[0].process.join(10)
    assert not backend.status()["alive"]
    assert backend.trainer.forward_backward("m", batch("cross_entropy")).startswith("m: ok")  # runs, no error
    assert backend.status()["restarts"] == 1
    assert "killed by SIGKILL" in backend.status()["last_death"]


@pytest.mark.slow
def test_a_backend_that_cannot_start_says_why():
    backend = ProcessBackend(one_worker(_broken_factory))
    with pytest.raises(WorkerStartFailed, match="could not start: OSError: no such model"):
        _ = backend.capabilities
    backend.close()


def _broken_factory() -> FakeBackend:
    raise OSError("no such model")
