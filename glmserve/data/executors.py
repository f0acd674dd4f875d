"""Where `glmserve data clean` runs its datatrove stages: this process (a fork pool for more than one worker)
or a Ray cluster (datatrove's RayPipelineExecutor, one Ray actor per task). Both record finished tasks under the
stage's logging folder, so a rerun skips them whichever executor wrote them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from glmserve.errors import DataPipelineError, InvalidRequestError

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class StageRunner:
    """Runs one stage's pipeline as `tasks` datatrove tasks on the chosen executor."""

    executor: str = "local"
    workers: int = 1
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise InvalidRequestError(f"executor must be one of {list(EXECUTORS)}, not {self.executor!r}")
        if self.workers < 1:
            raise InvalidRequestError(f"workers must be at least 1, not {self.workers}")
        if self.ray_address is not None and self.executor != "ray":
            raise InvalidRequestError("--ray-address needs --executor ray")

    def connect(self) -> AbstractContextManager[None]:
        """The context the stages run in: a Ray connection for the executor "ray", nothing for "local"."""
        return ray_connection(self.ray_address) if self.executor == "ray" else nullcontext()

    def run(self, logging_dir: Path, pipeline: list, tasks: int = 1) -> None:
        if self.executor == "ray":
            _run_ray(logging_dir, pipeline, tasks)
        else:
            _run_local(logging_dir, pipeline, tasks, self.workers)


def _run_local(logging_dir: Path, pipeline: list, tasks: int, workers: int) -> None:
    from datatrove.executor import LocalPipelineExecutor

    # workers=1 runs the tasks in this process one after the other. A pool is started with "fork": under
    # datatrove's default "forkserver" every worker imports the caller's __main__ again, and a script or
    # `python -c` without an `if __name__ == "__main__"` guard starts the pipeline anew in each worker,
    # which fails to bootstrap while the pool waits for it forever (the "MinHash hangs with workers=2").
    LocalPipelineExecutor(pipeline, tasks=tasks, workers=max(1, min(workers, tasks)), logging_dir=str(logging_dir),
                          skip_completed=True, start_method="fork").run()


def _run_ray(logging_dir: Path, pipeline: list, tasks: int) -> None:
    from datatrove.executor.ray import RayPipelineExecutor

    # datatrove/executor/ray.py: one placement group and RankWorker actor per task (tasks_per_job=1), as many at
    # once as the cluster's CPUs allow; a task whose actor crashed is resubmitted, but a task that raised is only
    # logged ("Only k/n tasks completed"), so the completion markers are checked here. 1 GB reserved per task:
    # datatrove's 2 GB default would not fit the small workers it is meant to run on.
    executor = RayPipelineExecutor(pipeline, tasks=tasks, logging_dir=str(logging_dir), skip_completed=True,
                                   cpus_per_task=1, mem_per_cpu_gb=1)
    executor.run()
    missing = executor.get_incomplete_ranks(range(tasks))
    if missing:
        raise DataPipelineError(f"Ray stage {logging_dir.name}: tasks {missing} of {tasks} did not finish; "
                                f"their logs are in {logging_dir / 'logs'} (a rerun resumes from the finished ones)")


@contextmanager
def ray_connection(address: str | None) -> Iterator[None]:
    """Connects to the Ray cluster at `address` (`ray start --head` prints it), or starts a local Ray instance
    without one; a Ray session this process already holds (ray.init called by the caller) is used as it is.
    Only what was started here is shut down."""
    try:
        import ray
    except ImportError as e:
        raise InvalidRequestError("the Ray executor needs the `ray` package: pip install 'glmserve[ray]'") from e
    if ray.is_initialized():
        yield
        return
    try:
        # a cluster's own settings (its dashboard, say) cannot be given when connecting to it
        ray.init(address=address, log_to_driver=False, **({} if address else {"include_dashboard": False}))
    except ConnectionError as e:
        # Ray turns token authentication on for `ray start --head`, but a driver given an explicit address only
        # sends the token (~/.ray/auth_token) with RAY_AUTH_MODE=token (ray/_private/worker.py, init)
        raise DataPipelineError(f"no Ray cluster at {address!r} ({e}); a cluster with token authentication "
                                "needs RAY_AUTH_MODE=token and its ~/.ray/auth_token on this machine") from e
    try:
        yield
    finally:
        ray.shutdown()
