"""Where a sweep's tasks run: in this process, in local worker processes, or on a Dask cluster.

A sweep is embarrassingly parallel per (model, training seed). :func:`run_tasks` hands each task
to an existing engine and gives every result back to the caller *as it finishes*, so the caller
can write it into the run folder at once: a task that finished is never measured again, and a
worker lost mid-task loses only its own tasks (a rerun measures just those).

- ``jobs=1``, no scheduler: a plain loop in this process (progress bars shown);
- ``jobs=N``: :class:`concurrent.futures.ProcessPoolExecutor` with ``N`` workers (a sweep task
  runs on one thread, :func:`nopelens.models.threads.one_thread`, so N workers share N cores
  without oversubscribing them). The workers are spawned, on every platform: each starts a fresh
  interpreter and imports nopelens (about 4 s here, the workers in parallel). Forking would save
  that, but this process is multi-threaded once pandas is imported (pyarrow's jemalloc starts a
  background thread, torch and BLAS keep thread pools), and a child forked from a multi-threaded
  process can deadlock on a lock another thread held at the fork (Python deprecates it from 3.12;
  a test sweep with forked workers hung, rarely, and never again reproduced). A script that calls
  ``sweep(..., jobs=N)`` must
  therefore guard its entry point with ``if __name__ == "__main__":``, as spawned multiprocessing
  always asks. Their progress bars write timed lines (they share a terminal);
- ``scheduler=ADDRESS``: a Dask ``distributed`` cluster through its ``concurrent.futures``
  executor (``Client(ADDRESS).get_executor()``; ``pip install "nopelens[dask]"``). Workers need
  nopelens installed; a worker reads zoo models from its own cache (``$NOPELENS_CACHE``) and
  trains into it what it lacks. A Dask task is pickled code that the workers run, so whoever can
  reach the scheduler can run code on every worker: ``tls://`` addresses with a security file in
  distributed's configuration format (:func:`dask_security`) let in only holders of a certificate
  of your CA, and a plain ``tcp://`` address that is not on this machine gets a warning
  (:func:`insecure_address`). Each worker must run one thread (``dask worker --nthreads 1``):
  a sweep task sets process-wide thread limits (:func:`check_alone_in_process`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import ipaddress
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Sequence

import yaml

from nopelens.models.progress import lines_only

WORKER_LOST = ("BrokenProcessPool", "KilledWorker", "CommClosedError", "FutureCancelledError", "CancelledError")
"""Exception class names that mean "the worker went away", not "the measurement failed"."""

CONNECT_TIMEOUT = 30.0
"""Seconds a Dask scheduler has to answer (connect and handshake) before the sweep gives up."""

WORKER_TIMEOUT = 30.0
"""Seconds to wait, once connected, for the scheduler to have at least one worker; and, mid-run,
how long it may have none before the unfinished tasks are given up as lost."""

POLL_SECONDS = 5.0
"""While no task finishes, how often a Dask run asks the scheduler whether it still has workers."""


def run_tasks(
    function: Callable[..., Any],
    tasks: Sequence[tuple[Hashable, tuple]],
    on_done: Callable[[Hashable, Any], None],
    jobs: int = 1,
    scheduler: str | None = None,
    security: str | Path | None = None,
) -> None:
    """Run ``function(*args)`` for every ``(key, args)`` in ``tasks``; call ``on_done(key, result)``
    in this process as each one finishes (in finishing order).

    Args:
        function: a module-level (picklable) function.
        tasks: ``(key, args)`` pairs; ``args`` must pickle.
        on_done: receives each result; runs in the calling process, one at a time.
        jobs: local worker processes (1: run in this process).
        scheduler: address of a Dask scheduler (``tls://host:8786`` or ``tcp://host:8786``);
            overrides ``jobs``.
        security: a YAML file of distributed's TLS settings for the client (see
            :func:`dask_security`); default: distributed's own configuration.

    Raises:
        ValueError: if ``jobs`` < 1.
        ValueError: if ``scheduler`` is given and ``distributed`` is not installed, is not a
            ``tls://`` or ``tcp://`` HOST:PORT address, is ``tls://`` without TLS settings, does not
            speak Dask, does not answer within :data:`CONNECT_TIMEOUT`, has no worker within
            :data:`WORKER_TIMEOUT`, or has a worker that runs more than one thread; on a bad
            security file (:func:`dask_security`).
        FileNotFoundError: if a certificate or key file of the TLS settings does not exist.
        OSError: if the scheduler cannot be reached.
        ChildProcessError: if workers or the Dask scheduler were lost, or a Dask scheduler has had
            no workers (or has not answered) for :data:`WORKER_TIMEOUT` mid-run; every task that
            finished has been passed to ``on_done`` first, so a rerun measures only what is missing.
        Exception: the first exception a task raised, after every other task was run and passed on.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if not tasks:  # a pure re-read: no pool to start, no scheduler to reach
        return
    jobs = min(jobs, len(tasks))
    if scheduler is None and jobs <= 1:
        for key, args in tasks:
            on_done(key, function(*args))
        return
    failures = []
    with _executor(jobs, scheduler, security) as engine:
        with _sigint_ignored_by_new_workers():  # local workers start as the tasks are submitted
            futures = {engine.executor.submit(function, *args): key for key, args in tasks}
        try:
            for future in _as_completed(futures, engine.has_workers, scheduler):
                key = futures[future]
                try:
                    result = future.result()
                except Exception as error:  # noqa: BLE001 - raised below, once the other tasks are in
                    failures.append((key, error))
                    continue
                on_done(key, result)
        except BaseException:  # an interrupt, or no workers left: drop what has not started
            _stop_local_workers(engine.executor)
            for future in futures:
                future.cancel()
            engine.executor.shutdown(wait=False)
            raise
        lost_scheduler = scheduler if failures and engine.scheduler_lost() else None
    _raise_failures(failures, len(tasks), lost_scheduler)


@contextmanager
def _sigint_ignored_by_new_workers() -> Iterator[None]:
    """Start worker processes with SIGINT ignored (kept across their exec; Python then installs no
    KeyboardInterrupt handler). Ctrl-C reaches the whole process group: without this, a worker
    still importing nopelens printed its own KeyboardInterrupt traceback under the run's one line.
    This process gets the interrupt and stops the workers (:func:`_stop_local_workers`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_local_workers(executor: cf.Executor) -> None:
    """End a local pool's worker processes now (their running tasks included: a part is written
    only when it is finished, so a rerun measures it again); nothing for a Dask executor.

    The pool's manager thread then fails every unfinished future as "broken"; it is waited for
    before the caller cancels them (a future cancelled first makes that thread raise
    InvalidStateError, printed as a traceback)."""
    processes = list((getattr(executor, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=10)
    manager = getattr(executor, "_executor_manager_thread", None)
    if processes and manager is not None:
        manager.join(timeout=10)


@dataclass
class _Engine:
    """Where the tasks run, and how to ask whether it can still run them."""

    executor: cf.Executor
    has_workers: Callable[[], bool] = lambda: True  # a lost local worker breaks the pool, which raises
    scheduler_lost: Callable[[], bool] = lambda: False


def _as_completed(futures: dict, has_workers: Callable[[], bool], scheduler: str | None) -> Iterator[cf.Future]:
    """``futures`` as they finish; raises once the engine has had no worker for :data:`WORKER_TIMEOUT`
    while some are unfinished (a Dask scheduler whose workers all left would wait for new ones forever).

    Raises:
        ChildProcessError: naming how many tasks did not finish.
    """
    pending, idle_since = set(futures), None
    while pending:
        done, pending = cf.wait(pending, timeout=POLL_SECONDS, return_when=cf.FIRST_COMPLETED)
        yield from done
        if done or has_workers():
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since >= WORKER_TIMEOUT:
            raise ChildProcessError(
                f"the Dask scheduler at {scheduler} has had no workers (or has not answered) "
                f"for {WORKER_TIMEOUT:.0f} s; "
                f"{len(pending)} of {len(futures)} tasks did not finish; the finished ones are saved: start workers "
                f"(`dask worker {scheduler} --nthreads 1`) and rerun the same command to measure the rest"
            )


@contextmanager
def _executor(jobs: int, scheduler: str | None, security: str | Path | None = None) -> Iterator[cf.Executor]:
    if scheduler is None:
        # workers share this terminal: their progress bars write lines instead of redrawing
        with cf.ProcessPoolExecutor(
            max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=lines_only
        ) as pool:
            yield _Engine(pool)
        return
    try:
        from distributed import Client  # lazy: distributed is optional (nopelens[dask])
    except ImportError:
        raise ValueError(
            '--scheduler needs Dask distributed, which is not installed: pip install "nopelens[dask]"'
        ) from None
    scheme = check_address(scheduler)
    settings = dask_security(security)
    if scheme == "tls" and not (settings.tls_ca_file and settings.tls_client_cert):
        raise ValueError(
            f"--scheduler {scheduler} is a TLS address, but no TLS settings were given: pass "
            "--dask-security FILE (distributed's ca-file and client cert and key)"
        )
    _check_tls_files(settings, security)
    warning = insecure_address(scheduler)
    if warning:
        print(f"nopelens: warning: {warning}", file=sys.stderr)
    _say_hello(scheduler, settings)
    try:
        client = Client(scheduler, timeout=f"{CONNECT_TIMEOUT}s", security=settings)
    except Exception as error:  # noqa: BLE001 - MemoryError included: distributed parsing a stranger's reply
        raise _connection_error(scheduler, error) from None
    with _quiet("distributed.client"):  # a lost scheduler is said in one line, not logged with tracebacks
        try:
            _wait_for_a_worker(client, scheduler)
            _check_single_threaded(client)
            # pure=False: the same arguments on a rerun must run again, not return a cached key
            yield _Engine(
                client.get_executor(pure=False), lambda: _has_workers(client), lambda: client.status != "running"
            )
        finally:
            client.close()


def check_address(scheduler: str) -> str:
    """The scheme of a scheduler address (``tcp`` when it has none).

    Raises:
        ValueError: if it is not ``tls://HOST:PORT``, ``tcp://HOST:PORT`` (or ``HOST:PORT``), or an
            ``inproc://`` address of a cluster inside this process.
    """
    scheme, _, location = scheduler.rpartition("://")
    scheme = scheme or "tcp"
    if scheme not in ("tcp", "tls", "inproc"):  # inproc: a cluster inside this process
        raise ValueError(f"--scheduler takes a tls:// or tcp:// address, got {scheduler!r}")
    if scheme == "inproc":
        if location.count("/") != 2:
            raise ValueError(
                f"--scheduler {scheduler}: an inproc:// address names a cluster inside this "
                "process (inproc://IP/PID/N); use a tls:// or tcp:// address"
            )
        return scheme
    host, _, port = location.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--scheduler takes a tls://HOST:PORT or tcp://HOST:PORT address, got {scheduler!r}")
    return scheme


def _check_tls_files(settings, security: str | Path | None) -> None:
    """Raise FileNotFoundError naming a certificate or key file of ``settings`` that does not
    exist (a value with a line break is the PEM text itself)."""
    where = f" (in {security})" if security is not None else ""
    for name, value in (
        ("ca-file", settings.tls_ca_file),
        ("client cert", settings.tls_client_cert),
        ("client key", settings.tls_client_key),
    ):
        if isinstance(value, str) and "\n" not in value and not Path(value).is_file():
            raise FileNotFoundError(f"no such file: {value}, the Dask TLS {name}{where}")


def _say_hello(scheduler: str, settings) -> None:
    """Connect to ``scheduler`` and exchange distributed's handshake, within :data:`CONNECT_TIMEOUT`.

    ``Client(..., timeout=...)`` bounds the connection but not the handshake after it, so a
    listener that accepts and never speaks would hang the client forever. The exchange runs on its
    own event loop, in a thread (this thread may run a loop already, as in a notebook).

    Raises:
        OSError: if nothing listens at ``scheduler`` (distributed retries for :data:`CONNECT_TIMEOUT`).
        ValueError: if it does not answer in time, or does not speak Dask.
    """
    from distributed.comm import connect  # lazy: distributed is optional (nopelens[dask])

    async def hello() -> None:
        comm = await connect(scheduler, timeout=CONNECT_TIMEOUT, **settings.get_connection_args("client"))
        await comm.close()

    # 1 s over distributed's own timeout: a port where nothing listens says so itself
    with cf.ThreadPoolExecutor(max_workers=1) as thread:
        try:
            thread.submit(asyncio.run, asyncio.wait_for(hello(), CONNECT_TIMEOUT + 1)).result()
        except asyncio.TimeoutError:
            raise ValueError(f"no Dask scheduler answered at {scheduler} within {CONNECT_TIMEOUT:.0f} s") from None
        except Exception as error:  # noqa: BLE001 - MemoryError included: distributed parsing a stranger's reply
            raise _connection_error(scheduler, error) from None


def _connection_error(scheduler: str, error: BaseException) -> Exception:
    """The one-line error to raise for ``error``, raised while connecting to ``scheduler``."""
    said = " ".join((str(error) or str(error.__cause__ or "") or type(error).__name__).split())
    if isinstance(error, OSError):
        return OSError(f"cannot reach the Dask scheduler at {scheduler}: {said}")
    if isinstance(error, MemoryError):  # distributed read the first bytes of a stranger's reply as a length
        return ValueError(
            f"cannot talk to a Dask scheduler at {scheduler}: its reply is not Dask's protocol "
            "(is it another kind of server?)"
        )
    return ValueError(f"cannot talk to a Dask scheduler at {scheduler}: {type(error).__name__}: {said}")


def _has_workers(client) -> bool:
    """Whether ``client``'s scheduler has a worker now (False if it cannot be asked, or does not answer
    within :data:`POLL_SECONDS`: a frozen scheduler or a network partition)."""
    try:
        return bool(client.nthreads(callback_timeout=POLL_SECONDS))
    except Exception:  # noqa: BLE001 - a scheduler that cannot answer has no workers to give
        return False


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Silence ``logger`` below CRITICAL inside the block."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _wait_for_a_worker(client, scheduler: str) -> None:
    """Wait up to :data:`WORKER_TIMEOUT` for ``client``'s scheduler to have a running worker.

    Raises:
        ValueError: if none joins in time.
    """
    try:
        client.wait_for_workers(n_workers=1, timeout=WORKER_TIMEOUT)
    except (TimeoutError, asyncio.TimeoutError):
        raise ValueError(
            f"the Dask scheduler at {scheduler} has no workers (none joined within "
            f"{WORKER_TIMEOUT:.0f} s); start one with `dask worker {scheduler} --nthreads 1`"
        ) from None


def dask_security(path: str | Path | None = None):
    """The client's ``distributed.Security``: distributed's own configuration, with the TLS
    settings of ``path`` on top.

    ``path`` is a YAML file in distributed's configuration format, so the same file can configure
    the scheduler and workers (``DASK_CONFIG=FILE``)::

        distributed:
          comm:
            require-encryption: true
            tls:
              ca-file: /etc/nopelens/ca.pem
              client: {cert: /etc/nopelens/client.pem, key: /etc/nopelens/client-key.pem}

    Certificates may be paths or the PEM text itself.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if it is not such a YAML file, or names a setting distributed does not know.
    """
    import dask.config  # lazy: distributed is optional (nopelens[dask])
    from distributed.security import Security  # lazy: distributed is optional (nopelens[dask])

    if path is None:
        return Security()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such Dask security file: {path}")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a YAML file ({' '.join(str(error).split())})") from None
    comm = loaded.get("distributed", {}).get("comm") if isinstance(loaded, dict) else None
    if not isinstance(comm, dict) or not isinstance(comm.get("tls"), dict):
        raise ValueError(f"{path} has no distributed: comm: tls: section (see `nopelens sweep --help`)")
    flat = {f"distributed.comm.{key}": value for key, value in _flatten(comm)}
    try:
        with dask.config.set(flat):
            return Security()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {' '.join(str(error).split())}") from None


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def insecure_address(address: str) -> str | None:
    """Why a scheduler address lets others in, or None: a plain ``tcp://`` address that is not on
    this machine (loopback). Anyone who reaches it can send the workers code to run.

    >>> insecure_address("tcp://127.0.0.1:8786") is None, insecure_address("tls://10.0.0.5:8786") is None
    (True, True)
    >>> insecure_address("tcp://10.0.0.5:8786").split(":")[0]
    'tcp'
    """
    scheme, _, rest = address.rpartition("://")
    if (scheme or "tcp") != "tcp":
        return None
    host = rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (
        f"{address} is plain tcp: unencrypted, and anyone who can reach it can run code on the "
        "workers; bind the scheduler and workers to a private interface, or use a tls:// address "
        "with --dask-security (docs/dask.md)"
    )


def _check_single_threaded(client) -> None:
    busy = {
        address: info.get("nthreads", 1)
        for address, info in client.scheduler_info()["workers"].items()
        if info.get("nthreads", 1) > 1
    }
    if busy:
        raise ValueError(_threads_message(", ".join(f"{a} ({n} threads)" for a, n in busy.items())))


def check_alone_in_process() -> None:
    """Refuse to run a sweep task in a Dask worker that runs several tasks at once.

    A sweep task runs torch and BLAS on one thread, and thread limits are process-wide: in a
    worker started with ``--nthreads 2`` the first task to finish would restore them while the
    other still runs. (Local pools run one task per process; a plain process has no Dask worker.)

    Raises:
        ValueError: inside a Dask worker with more than one thread.
    """
    distributed = sys.modules.get("distributed")
    if distributed is None:
        return
    try:
        worker = distributed.get_worker()
    except ValueError:  # not in a worker
        return
    nthreads = getattr(getattr(worker, "state", worker), "nthreads", 1)
    if nthreads > 1:
        raise ValueError(_threads_message(f"{worker.address} ({nthreads} threads)"))


def _threads_message(workers: str) -> str:
    return (
        f"Dask workers must run one thread each (dask worker --nthreads 1): a sweep task sets "
        f"process-wide thread limits; refused: {workers}"
    )


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity), the default number of local workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _raise_failures(
    failures: list[tuple[Hashable, BaseException]], n_tasks: int, lost_scheduler: str | None = None
) -> None:
    if not failures:
        return
    lost = [(key, error) for key, error in failures if type(error).__name__ in WORKER_LOST]
    if len(lost) < len(failures):
        raise next(error for _, error in failures if type(error).__name__ not in WORKER_LOST)
    names = ", ".join(str(key) for key, _ in lost)
    what = f"the Dask scheduler at {lost_scheduler} was lost" if lost_scheduler else "a worker was lost"
    raise ChildProcessError(
        f"{len(lost)} of {n_tasks} tasks did not finish because {what} ({names}); "
        "the finished ones are saved, rerun the same command to measure the rest"
    )
