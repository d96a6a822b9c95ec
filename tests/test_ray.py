"""The scan on Ray: a real cluster on loopback (a head and a second worker node, `ray start` processes),
the map byte-identical to the single-process scan, a SIGKILLed worker costing nothing, resume across
both, and the refusals that come before any work."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from cardfit.scan import scan

RAY = str(Path(sys.executable).with_name("ray"))
# Ray >= 2.5x turns on token authentication for `ray start` clusters; on loopback, off, for every process
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
# float32: bit for bit whatever threads a task gets (bfloat16-differences re-rolls its rounding noise when a
# task's thread count changes the float32 reference's last bits; the shared-dir test below checks that form)
JOB = dict(max_tokens=64, seq_len=64, formats="Q4_K,Q2_K", dtype="float32")


def _cli(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "cardfit.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, **kwargs)


def _job_args(out, *extra):
    return ["scan", "--max-tokens", str(JOB["max_tokens"]), "--seq-len", str(JOB["seq_len"]),
            "--formats", JOB["formats"], "--dtype", JOB["dtype"], "--out", str(out), *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive_nodes(address: str) -> int:
    probe = ("import ray, logging; ray.init(address=%r, logging_level=logging.ERROR, log_to_driver=False); "
             "print(sum(1 for n in ray.nodes() if n['Alive']))" % address)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=ENV)
    return int(done.stdout.strip() or 0)


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node on 127.0.0.1, one CPU each: two worker processes on two 'hosts'."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="cfray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    nodes = [subprocess.Popen([RAY, "start", "--head", "--port", str(port), "--include-dashboard=false",
                               "--temp-dir", temp, *common], start_new_session=True, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        nodes.append(subprocess.Popen([RAY, "start", "--address", address, *common], start_new_session=True, env=ENV,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        while _alive_nodes(address) < 2:
            assert time.time() < deadline, "the loopback Ray cluster did not come up"
            time.sleep(1)
        yield address
    finally:
        for node in reversed(nodes):
            try:
                os.killpg(node.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        for proc in psutil.process_iter(["cmdline"]):  # nothing of this cluster may outlive the tests
            try:
                if any(part.startswith(temp) or f"={temp}" in part for part in proc.info["cmdline"] or []):
                    proc.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def single_map(tmp_path_factory, default_model_dir):
    """The embedded model scanned in one process: the bytes every Ray run must reproduce."""
    out = tmp_path_factory.mktemp("single") / "map.json"
    scan(None, out=out, progress=False, **JOB)
    return out.read_bytes()


def _sweep_workers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[0].startswith("ray::_sweep_task"):
            found.append(proc)
    return found


def test_cluster_map_identical_with_a_worker_killed_mid_scan(cluster, single_map, tmp_path):
    out = tmp_path / "map.json"
    run = _cli(*_job_args(out, "--ray", cluster, "--workers", "2"))
    killed = None
    deadline = time.time() + 600
    while killed is None and run.poll() is None and time.time() < deadline:
        busy = _sweep_workers()
        if busy:
            time.sleep(1.0)  # well inside its sweep: quantized copies made, layers running
            killed = busy[0].pid
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr
    assert killed is not None, "no sweep task was ever seen running"
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
    assert "joined the Ray cluster at" in stdout and "2 nodes" in stdout
    assert out.read_bytes() == single_map


def test_resume_across_single_process_and_ray(cluster, single_map, tmp_path):
    """A partial map from one process, finished on the cluster: the same bytes as either alone."""
    partial = json.loads(single_map)
    for group in partial["groups"][-4:]:  # the last layers, the norm: cheap to re-measure
        group["cells"] = {}
    partial["groups"][3]["cells"].pop("Q2_K")
    partial["complete"] = False
    out = tmp_path / "map.json"
    out.write_text(json.dumps(partial, indent=1))
    run = _cli(*_job_args(out, "--resume", "--ray", cluster))
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr
    assert out.read_bytes() == single_map


@pytest.mark.parametrize("ray_args, says", [
    (["--ray", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
    (["--ray", "not-an-address"], "is not a Ray address"),
    (["--ray", "127.0.0.1:99999"], "is not a Ray address"),
    (["--ray", "--shared-dir", "/nonexistent/dir"], "--shared-dir /nonexistent/dir is not a directory"),
    (["--workers", "2"], "add --ray"),
    (["--ray", "--method", "fast"], "use --method exact"),
])
def test_ray_refusals_are_one_line_before_any_work(tmp_path, ray_args, says):
    out = tmp_path / "map.json"
    run = _cli(*_job_args(out, *ray_args))
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 2
    assert says in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_local_cluster_and_shared_dir_give_the_same_map(tiny_model, tmp_path):
    """A local cluster started by the scan, boundary activations through a shared directory (which is
    left empty), one worker (with the process's threads): the same map as one process, in the default
    compute (bfloat16-differences where the CPU has fast bfloat16: every later layer's reference input
    goes to the worker)."""
    model = tiny_model("llama")
    job = dict(max_tokens=64, seq_len=32, batch=1, formats="Q4_K,Q2_K", progress=False)
    single = tmp_path / "single.json"
    scan(model, out=single, **job)
    shared = tmp_path / "shared"
    shared.mkdir()
    clustered = tmp_path / "ray.json"
    scan(model, out=clustered, ray="local", workers=1, shared_dir=shared, **job)
    assert clustered.read_bytes() == single.read_bytes()
    assert list(shared.iterdir()) == []


def test_projection_schedules_longest_first():
    from cardfit.scan.estimate import ScanEstimate

    guess = ScanEstimate(0, 0, 0, 0, 0.0, 0, 0, 0, 0.0, 0.0, {}, reference_seconds=10.0,
                         group_seconds=[8.0, 7.0, 6.0, 5.0, 4.0])
    assert guess.on_workers(1) == 10.0 + 30.0
    # longest first on two workers: {8, 5, 4} and {7, 6} -> 17 and 13
    assert guess.on_workers(2) == 10.0 + 17.0
    assert guess.on_workers(10) == 10.0 + 8.0  # never below the longest sweep


@pytest.mark.parametrize("args, says", [
    (["--ray", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
    (["--workers", "2"], "add --ray"),
])
def test_fit_refuses_ray_options_before_writing(tmp_path, args, says):
    out = tmp_path / "run"
    run = _cli("fit", "--out", str(out), *args)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 2
    assert says in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists()
