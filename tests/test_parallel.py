"""Sweeps in local worker processes and on a Dask cluster (over TLS, the README's setup): same
tables as the serial run, and a
worker killed mid-run loses only its task (a rerun completes the folder, measuring nothing twice).

Tiny settings (two controls, two training seeds of the untrained one, few short sequences) keep
each run to seconds of work; the cost is mostly starting worker processes.
"""

import multiprocessing
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest

from nopelens.analyses.sweep import TABLES, SweepSettings, parallel, sweep

SETTINGS = SweepSettings(
    models=("circuit", "untrained-nope"), n_sequences=12, seq_len=16, n_boot=20, n_splits=3, train_seeds=(0, 1)
)
N_TASKS = 3


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial") / "run"
    sweep(SETTINGS, out, progress=False)
    return out


def assert_same_tables(run: Path, reference: Path) -> None:
    for name in (*TABLES, "summary", "summary_per_seed", "probes_over_seeds"):
        pd.testing.assert_frame_equal(pd.read_csv(run / f"{name}.csv"), pd.read_csv(reference / f"{name}.csv"))


def done_parts(run: Path) -> int:
    return len(list(run.glob("parts/*/done.json")))


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_jobs_give_the_serial_tables(serial, tmp_path):
    _bounded(sweep, SETTINGS, tmp_path / "run", progress=False, jobs=2)
    assert_same_tables(tmp_path / "run", serial)


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_lost_local_worker_loses_only_unfinished_tasks(serial, tmp_path, capsys):
    out = tmp_path / "run"
    errors = []
    runner = threading.Thread(target=lambda: _sweep_catching(out, errors, jobs=2))
    runner.start()
    _wait_for(lambda: done_parts(out) >= 1 or not runner.is_alive())
    for child in multiprocessing.active_children():  # the pool's workers, mid-task
        os.kill(child.pid, signal.SIGKILL)
    _join(runner)
    finished = done_parts(out)
    if errors:
        assert isinstance(errors[0], ChildProcessError) and "rerun" in str(errors[0])
        assert finished < N_TASKS
    capsys.readouterr()
    _bounded(sweep, SETTINGS, out, progress=True, jobs=2)
    assert capsys.readouterr().err.count("already measured") == finished, "nothing finished is measured twice"
    assert_same_tables(out, serial)


def _start_then_sleep(folder: str, name: str) -> bool:
    """A task: says it started (with whether SIGINT is ignored here), sleeps, says it finished."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    Path(folder, f"{name}.started").write_text(str(ignored))
    time.sleep(60)
    Path(folder, f"{name}.finished").write_text("")
    return ignored


def test_an_interrupt_stops_the_local_workers_which_ignore_ctrl_c(tmp_path, monkeypatch):
    """Ctrl-C reaches the whole process group: the workers start with SIGINT ignored (a worker still
    importing printed its own traceback), and the interrupted run ends them, running tasks
    included, instead of waiting for those to finish, and cancels the waiting ones without a
    traceback from the pool's threads."""
    tasks = [(name, (str(tmp_path), name)) for name in ("a", "b", "c", "d")]  # two wait: cancelled
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    def interrupt_once_both_started():
        while len(list(tmp_path.glob("*.started"))) < 2:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt_once_both_started, daemon=True).start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # an xdist worker ignores SIGINT
    try:
        with pytest.raises(KeyboardInterrupt):
            parallel.run_tasks(_start_then_sleep, tasks, lambda key, result: None, jobs=2)
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p.read_text() for p in sorted(tmp_path.glob("*.started"))] == ["True", "True"]
    assert not list(tmp_path.glob("*.finished")) and not multiprocessing.active_children()
    assert thread_errors == []  # the pool's manager thread raised InvalidStateError on cancelled futures
    assert handler is signal.default_int_handler  # this process's handler is back


def test_run_tasks_reports_failures_after_passing_on_the_rest():
    done = {}
    with pytest.raises(ZeroDivisionError):
        parallel.run_tasks(divmod, [("ok", (7, 2)), ("bad", (1, 0)), ("ok2", (9, 4))], done.__setitem__, jobs=2)
    assert done == {"ok": (3, 1), "ok2": (2, 1)}
    with pytest.raises(ValueError, match="--jobs"):
        parallel.run_tasks(divmod, [], done.__setitem__, jobs=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A LocalCluster that speaks only TLS (the README's safe setup), with a throwaway self-signed
    certificate (``Security.temporary``) and the client's security file in distributed's config format."""
    distributed = pytest.importorskip("distributed", reason='Dask distributed is not installed (pip install ".[dask]")')
    pytest.importorskip("cryptography", reason="Security.temporary() needs the cryptography package")
    security = distributed.security.Security.temporary()
    folder = tmp_path_factory.mktemp("tls")
    for name, pem in (
        ("ca.pem", security.tls_ca_file),
        ("client.pem", security.tls_client_cert),
        ("client-key.pem", security.tls_client_key),
    ):
        (folder / name).write_text(pem)
    config = folder / "dask-tls.yaml"
    config.write_text(
        "distributed:\n  comm:\n    require-encryption: true\n    tls:\n"
        f"      ca-file: {folder / 'ca.pem'}\n"
        f"      client:\n        cert: {folder / 'client.pem'}\n        key: {folder / 'client-key.pem'}\n"
    )
    with distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        protocol="tls://",
        host="127.0.0.1",
        security=security,
    ) as local:
        with distributed.Client(local) as client:
            yield local.scheduler_address, client, config


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_tls_dask_cluster_gives_the_serial_tables(serial, cluster, tmp_path):
    address, _, config = cluster
    assert address.startswith("tls://")
    sweep(SETTINGS, tmp_path / "run", progress=False, scheduler=address, security=config)
    assert_same_tables(tmp_path / "run", serial)


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_dask_worker_killed_mid_task_and_a_rerun_completes_the_folder(serial, cluster, tmp_path, capsys):
    address, client, config = cluster
    out = tmp_path / "run"
    errors = []
    runner = threading.Thread(target=lambda: _sweep_catching(out, errors, scheduler=address, security=config))
    runner.start()
    busy = _wait_for(lambda: [w for w, tasks in client.processing().items() if tasks] or not runner.is_alive())
    killed = busy is not True
    if killed:
        client.run(os._exit, 1, workers=busy[:1], on_error="ignore")  # the worker process dies mid-task
    _join(runner)
    if errors:
        assert isinstance(errors[0], ChildProcessError), errors[0]
    finished = done_parts(out)
    capsys.readouterr()
    sweep(SETTINGS, out, progress=True, scheduler=address, security=config)
    assert capsys.readouterr().err.count("already measured") == finished
    assert done_parts(out) == N_TASKS
    assert_same_tables(out, serial)
    assert killed, "the sweep finished before a worker could be killed"


def _sweep_catching(out: Path, errors: list, **kwargs) -> None:
    try:
        sweep(SETTINGS, out, progress=False, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        errors.append(error)


def _join(thread: threading.Thread, timeout: float = 300.0) -> None:
    """Wait for ``thread``: a hung pool fails the test in minutes instead of holding CI until its
    time limit."""
    thread.join(timeout)
    assert not thread.is_alive(), f"the sweep did not finish in {timeout:.0f} s (a worker hung?)"


def _bounded(function, *args, **kwargs) -> None:
    """``function(*args, **kwargs)`` on a thread, waited for as :func:`_join` waits; its error is raised here."""
    error = _error_within(300.0, function, *args, **kwargs)
    if error is not None:
        raise error


def _wait_for(condition, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError("condition not reached")


# ----------------------------------------------------------------------------- a cluster that lets no one else in


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_tls_scheduler_refuses_clients_without_its_certificate(cluster, tmp_path):
    import distributed

    address, _, _ = cluster
    with pytest.raises(ValueError, match="TLS address, but no TLS settings were given: pass --dask-security"):
        sweep(SETTINGS, tmp_path / "run", progress=False, scheduler=address)
    stranger = distributed.security.Security.temporary()  # a certificate the cluster's CA did not sign
    with pytest.raises((OSError, TimeoutError)):
        distributed.Client(address, security=stranger, timeout="5s")


def test_a_bad_security_file_is_named(tmp_path):
    pytest.importorskip("distributed")
    with pytest.raises(FileNotFoundError, match="no such Dask security file"):
        parallel.dask_security(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("distributed: [unclosed")
    with pytest.raises(ValueError, match="bad.yaml is not a YAML file"):
        parallel.dask_security(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("distributed:\n  comm: {}\n")
    with pytest.raises(ValueError, match="no distributed: comm: tls: section"):
        parallel.dask_security(tmp_path / "empty.yaml")
    with pytest.raises(ValueError, match="tls:// or tcp://"):
        parallel.run_tasks(divmod, [("a", (1, 1))], lambda *a: None, scheduler="ucx://10.0.0.5:8786")


def test_a_plain_tcp_scheduler_off_this_machine_is_warned_about():
    assert parallel.insecure_address("tcp://127.0.0.1:8786") is None
    assert parallel.insecure_address("localhost:8786") is None
    assert parallel.insecure_address("tcp://[::1]:8786") is None
    assert parallel.insecure_address("tls://10.0.0.5:8786") is None
    for address in ("tcp://10.0.0.5:8786", "tcp://0.0.0.0:8786", "node7:8786", "tcp://[2001:db8::1]:8786"):
        assert "anyone who can reach it can run code on the workers" in parallel.insecure_address(address), address


def test_workers_running_several_threads_are_refused(tmp_path):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as local:
        with pytest.raises(ValueError, match=r"dask worker --nthreads 1.*\(2 threads\)"):
            sweep(SETTINGS, tmp_path / "run", progress=False, scheduler=local.scheduler_address)
        with distributed.Client(local) as client:  # a worker that joins later: the task refuses itself
            with pytest.raises(ValueError, match="--nthreads 1"):
                client.submit(parallel.check_alone_in_process).result()
    parallel.check_alone_in_process()  # outside a worker: nothing to refuse


# --------------------------------------------------------------------------- schedulers that are not there, or not Dask


@contextmanager
def _fake_server(reply: bytes | None):
    """A localhost TCP server, at the address it yields, that answers every connection with
    ``reply`` (None: accepts and never speaks)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop, connections = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:  # a timeout: look at stop again
                continue
            connections.append(connection)
            if reply is not None:
                connection.recv(65536)
                connection.sendall(reply)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        server.join()
        for connection in (listener, *connections):
            connection.close()


def _error_within(seconds: float, function, *args, **kwargs) -> BaseException | None:
    """What ``function(*args, **kwargs)`` raised (None if nothing), failing the test if it takes
    more than ``seconds`` (the thread is left behind, a daemon)."""
    errors = []

    def call():
        try:
            function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - returned to the test
            errors.append(error)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds:.0f} s (hung?)"
    return errors[0] if errors else None


def _one_task(address: str, **kwargs) -> BaseException | None:
    return _error_within(30, parallel.run_tasks, divmod, [("a", (7, 2))], lambda *a: None, scheduler=address, **kwargs)


def test_a_server_that_is_not_dask_is_one_clear_error():
    pytest.importorskip("distributed")
    with _fake_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n") as address:
        error = _one_task(address)
    assert type(error) is ValueError, repr(error)  # not distributed's MemoryError ("out of memory" in the CLI)
    assert str(error).startswith(f"cannot talk to a Dask scheduler at {address}: ") and "\n" not in str(error)


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_listener_that_never_speaks_times_out(monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr(parallel, "CONNECT_TIMEOUT", 2.0)
    with _fake_server(None) as address:
        error = _one_task(address)
    assert type(error) is ValueError and str(error) == f"no Dask scheduler answered at {address} within 2 s", repr(
        error
    )


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_scheduler_without_workers_is_named(monkeypatch):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(parallel, "WORKER_TIMEOUT", 1.0)
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as local:
        error = _one_task(local.scheduler_address)
    assert type(error) is ValueError, repr(error)
    assert str(error) == (
        f"the Dask scheduler at {local.scheduler_address} has no workers (none joined within 1 s); "
        f"start one with `dask worker {local.scheduler_address} --nthreads 1`"
    )


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_scheduler_whose_workers_all_leave_mid_run_gives_up_in_one_line(monkeypatch):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(parallel, "WORKER_TIMEOUT", 1.0)
    monkeypatch.setattr(parallel, "POLL_SECONDS", 0.2)
    done = {}
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as local:
        address = local.scheduler_address
        leave = threading.Timer(1.0, local.scale, args=(0,))  # the only worker leaves while the task runs
        leave.start()
        tasks = [("quick", (0.0,)), ("slow", (3.0,))]
        error = _error_within(30, parallel.run_tasks, time.sleep, tasks, done.__setitem__, scheduler=address)
        leave.join()
    assert done == {"quick": None}, "the task that finished is passed on before the run gives up"
    assert type(error) is ChildProcessError, repr(error)
    assert str(error).startswith(
        f"the Dask scheduler at {address} has had no workers (or has not answered) for 1 s; 1 of 2 tasks did not "
        "finish; the finished ones are saved"
    )


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_a_lost_or_frozen_scheduler_is_named_in_one_line(caplog):
    """A scheduler killed mid-run: the unfinished tasks are named as lost with it, and distributed's
    reconnect tracebacks are not logged; a scheduler that stops answering (SIGSTOP, as a network
    partition looks) is given up after WORKER_TIMEOUT instead of waited on forever."""
    pytest.importorskip("distributed")
    import subprocess
    import sys

    for stop, says in (
        (signal.SIGKILL, "did not finish because the Dask scheduler at {} was lost (slow)"),
        (signal.SIGSTOP, "the Dask scheduler at {} has had no workers (or has not answered) for 2 s"),
    ):
        port = _free_port()
        address = f"tcp://127.0.0.1:{port}"
        options = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        scheduler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-dashboard",
            ],
            **options,
        )
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                address,
                "--nthreads",
                "1",
                "--no-nanny",
                "--no-dashboard",
            ],
            **options,
        )
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(parallel, "WORKER_TIMEOUT", 2.0)
                patch.setattr(parallel, "POLL_SECONDS", 0.5)
                done = {}

                def on_done(key, result):
                    done[key] = result
                    if key == "quick":  # the worker runs; stop the scheduler while "slow" sleeps
                        scheduler.send_signal(stop)

                error = _error_within(
                    120,
                    parallel.run_tasks,
                    time.sleep,
                    [("quick", (0.0,)), ("slow", (30.0,))],
                    on_done,
                    scheduler=address,
                )
        finally:
            for process in (scheduler, worker):
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()
        assert done == {"quick": None} and type(error) is ChildProcessError, (done, repr(error))
        assert says.format(address) in str(error), str(error)
        logged = [record.getMessage() for record in caplog.records if record.name.startswith("distributed.client")]
        assert not logged, logged


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_nothing_to_measure_starts_no_executor(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an executor was created for no tasks")

    monkeypatch.setattr(parallel, "_executor", refuse)
    for kwargs in ({"scheduler": "tcp://127.0.0.1:1"}, {"jobs": 4}):
        assert _error_within(5, parallel.run_tasks, divmod, [], lambda *a: None, **kwargs) is None, kwargs


@pytest.mark.parametrize(
    "address, says",
    [
        ("garbage", "tls://HOST:PORT or tcp://HOST:PORT address, got 'garbage'"),
        ("tcp://10.0.0.5", "tls://HOST:PORT or tcp://HOST:PORT address, got 'tcp://10.0.0.5'"),
        ("inproc://foo", "inproc://foo: an inproc:// address names a cluster inside this process"),
    ],
)
def test_a_malformed_address_is_one_line(address, says, capsys):
    pytest.importorskip("distributed")
    error = _one_task(address)
    assert type(error) is ValueError and says in str(error), repr(error)
    assert capsys.readouterr().err == "", "no warning before the error"


def test_a_sweep_with_a_malformed_address_says_so_before_its_progress_bar(tmp_path, capsys):
    from nopelens.analyses.cli import main

    code = main(["sweep", "--models", "circuit", "--scheduler", "garbage", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        "nopelens sweep: error: --scheduler takes a tls://HOST:PORT or tcp://HOST:PORT address, got 'garbage'"
    ], err
    assert not (tmp_path / "run").exists()


def test_missing_tls_files_are_named(tmp_path):
    pytest.importorskip("distributed")
    config = tmp_path / "dask-tls.yaml"
    config.write_text(
        "distributed:\n  comm:\n    tls:\n"
        f"      ca-file: {tmp_path / 'ca.pem'}\n      client:\n        cert: {tmp_path / 'client.pem'}\n"
    )
    error = _one_task("tls://127.0.0.1:1", security=config)
    assert type(error) is FileNotFoundError, repr(error)
    assert str(error) == f"no such file: {tmp_path / 'ca.pem'}, the Dask TLS ca-file (in {config})"


@pytest.mark.slow  # a Dask cluster or worker processes: seconds each
def test_encryption_required_with_a_tcp_address_is_one_clear_error(cluster):
    _, _, config = cluster
    with _fake_server(b"") as address:
        error = _one_task(address, security=config)
    assert type(error) is ValueError, repr(error)
    assert str(error).startswith(f"cannot talk to a Dask scheduler at {address}: RuntimeError: encryption required")
