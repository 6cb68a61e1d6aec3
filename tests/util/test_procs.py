"""Worker processes that cannot hang their parent (`fastdata._util.procs`, issue 36).

The old `multiprocessing.Pool` hung for ever when the caller had a Python SIGTERM handler
(pytest-xdist, Lightning, job wrappers): its workers inherited the handler, survived
`terminate()`, and the join never returned. Each case here runs under a hard bound (a child
process killed with SIGKILL, or a short timeout), so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fastdata._util.procs import WorkerDiedError, run_in_processes

ROOT = Path(__file__).resolve().parents[2]


def _run_script(code: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; SIGKILL it after `timeout` s (a recording SIGTERM
    handler would make a plain timeout's SIGTERM useless)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:  # workers left behind by the killed script may hold its output pipes open
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "(its workers still hold the output open)", ""
        pytest.fail(f"hung: killed after {timeout} s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_HANDLER_AND_THREAD = """
    import signal, threading
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))  # records, no exit
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # one more thread running
"""

_WRITE_AND_INDEX = """
    import io, tarfile, tempfile, time
    from pathlib import Path
    import numpy as np
    from PIL import Image
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.index import IndexOptions, index_shards
    from fastdata.write.sources.arrays import ArraySource

    def write_and_index(runs):
        for run in range(runs):
            with tempfile.TemporaryDirectory() as folder:
                images = np.full((48, 8, 8, 3), run, dtype=np.uint8)
                source = ArraySource({"train": (images, np.arange(48) % 4)}, list("abcd"))
                write_shards(source, Path(folder) / "own",
                             ShardOptions(max_count=8, workers=2, progress=False))
                foreign = Path(folder) / "foreign"
                foreign.mkdir()
                for t in range(4):
                    with tarfile.open(foreign / f"part-{t}.tar", "w") as tar:
                        for k in range(3):
                            jpg = io.BytesIO()
                            Image.new("RGB", (8, 8), (t, k, 0)).save(jpg, "JPEG")
                            for ext, data in (("jpg", jpg.getvalue()), ("cls", str(k).encode())):
                                info = tarfile.TarInfo(f"s{t}_{k}.{ext}")
                                info.size = len(data)
                                tar.addfile(info, io.BytesIO(data))
                manifest = index_shards(foreign, options=IndexOptions(workers=2))
                assert sum(manifest.splits["train"].class_counts) == 12
"""


def test_a_caller_with_a_recording_sigterm_handler_and_a_thread_never_hangs(tmp_path):
    # The old pool hung in the first of 5 runs of either call here (issue 36's reproduction).
    result = _run_script(
        _HANDLER_AND_THREAD
        + _WRITE_AND_INDEX
        + """
    write_and_index(8)
    print("ok", got)
    """,
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok []"), result.stdout  # no SIGTERM reached the caller


@pytest.mark.slow
def test_writing_and_indexing_inside_a_lightning_fit(tmp_path):
    # Lightning's fit installs its own SIGTERM handler (its signal connector) for the loop.
    result = _run_script(
        _WRITE_AND_INDEX
        + """
    import signal
    import torch
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                handler = signal.getsignal(signal.SIGTERM)
                print("handler", getattr(handler, "__qualname__", handler))
                write_and_index(3)
            return self.layer(batch[0]).sum()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Model(), data)
    print("fit done")
    """,
        tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fit done" in result.stdout
    handler_line = next(line for line in result.stdout.splitlines() if line.startswith("handler"))
    assert "Handlers.SIG_DFL" not in handler_line, handler_line  # fit had a handler installed


def _square(_shared, task):
    return task * task


def _fail_on_three(_shared, task):
    if task == 3:
        raise ValueError(f"task {task} is bad")
    return task


class _TwoArgumentError(Exception):
    """Pickles, but does not rebuild (as `BadSampleError(origin, reason)` or botocore's)."""

    def __init__(self, origin, reason):
        super().__init__(f"{origin}: {reason}")


def _raise_two_argument_error(_shared, task):
    raise _TwoArgumentError(f"sample-{task}.jpg", "broken")


def _kill_self_on_two(_shared, task):
    if task == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return task


def _sleep_forever(pid_folder, task):
    """Record this worker's pid; task 0 returns once both workers have, the others sleep."""
    (Path(pid_folder) / f"{os.getpid()}").write_text("")
    if task == 0:
        deadline = time.monotonic() + 30
        while len(list(Path(pid_folder).iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        return task
    time.sleep(600)


def test_results_come_back_with_their_task_index():
    results = dict(run_in_processes(_square, None, list(range(7)), 3))
    assert results == {index: index * index for index in range(7)}


def test_a_task_that_raises_is_raised_in_the_caller_with_the_workers_traceback():
    with pytest.raises(ValueError, match="task 3 is bad") as caught:
        list(run_in_processes(_fail_on_three, None, list(range(6)), 2))
    assert "_fail_on_three" in str(caught.value.__cause__)  # the worker's traceback


def test_an_exception_that_does_not_rebuild_arrives_as_its_text_not_a_typeerror():
    with pytest.raises(RuntimeError, match=r"sample-0\.jpg: broken") as caught:
        list(run_in_processes(_raise_two_argument_error, None, [0], 2))
    assert "_raise_two_argument_error" in str(caught.value)  # the worker's traceback


def test_a_worker_killed_mid_task_is_an_error_naming_the_task_not_a_wait():
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"task 2 .*killed by SIGKILL"):
        list(run_in_processes(_kill_self_on_two, None, list(range(5)), 2, describe=str))
    assert time.monotonic() - started < 30


def test_stopping_early_ends_every_worker(tmp_path):
    started = time.monotonic()
    for index, _result in run_in_processes(_sleep_forever, str(tmp_path), [0, 1, 2], 2):
        assert index == 0
        break  # the caller stops with a task still running (or an exception in its loop)
    assert time.monotonic() - started < 40
    pids = [int(path.name) for path in tmp_path.iterdir()]
    assert len(pids) == 2
    for pid in pids:
        assert not _alive(pid), f"worker {pid} outlived the run"


def test_workers_die_with_a_parent_killed_outright(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    _run_script_in_background = f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from fastdata._util.procs import run_in_processes
    from test_procs import _sleep_forever
    list(run_in_processes(_sleep_forever, {str(pids)!r}, [1, 2], 2))
    """
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_run_script_in_background))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            assert parent.poll() is None, "the parent ended before its workers started"
            time.sleep(0.05)
        workers = [int(path.name) for path in pids.iterdir()]
        assert len(workers) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers), "a worker outlived its killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
