import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# The default run draws the same examples every time, so a suite that passed once keeps
# passing; `--hypothesis-profile=explore` draws new examples to hunt for
# new counterexamples, each of which then becomes an explicit test.
settings.register_profile("default", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("default")

#: Where the suite's private folder is, for the test that checks nothing escapes it.
SANDBOX_VARIABLE = "WELDER_TEST_SANDBOX"
#: A folder a developer names to keep compiled emulator modules between runs.
KEEP_CACHE_VARIABLE = "WELDER_TEST_CACHE_DIR"

#: Variables that say where programs write caches and state, each pointed into the sandbox:
#: welder's caches (emulator builds, tuning database), HOME and XDG (onnxruntime's state,
#: torch and Hugging Face caches), ONNX's test data and Hypothesis' folder (default: the
#: working directory).
_REDIRECTED = {
    "HOME": "home",
    "XDG_CACHE_HOME": "home/.cache",
    "XDG_CONFIG_HOME": "home/.config",
    "XDG_DATA_HOME": "home/.local/share",
    "ONNX_HOME": "onnx",
    "HYPOTHESIS_STORAGE_DIRECTORY": "hypothesis",
    "WELDER_CACHE_DIR": "welder-cache",
}


def pytest_configure(config: pytest.Config) -> None:
    """Tests write only under temporary folders.  One private folder under the system's
    temporary directory serves the whole run: the first process makes it and points the
    variables above into it, and pytest-xdist's workers, started later, inherit them, so
    they share one emulator cache (each kernel compiles once per run).  Set
    $WELDER_TEST_CACHE_DIR to keep that cache between runs instead."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _share_cores_between_workers()
        return
    sandbox = Path(tempfile.mkdtemp(prefix="welder-tests-"))
    config.stash[_SANDBOX_KEY] = sandbox
    saved = {name: os.environ.get(name) for name in [*_REDIRECTED, SANDBOX_VARIABLE]}
    config.stash[_SAVED_KEY] = saved
    for name, sub in _REDIRECTED.items():
        (sandbox / sub).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(sandbox / sub)
    keep = os.environ.get(KEEP_CACHE_VARIABLE)
    if keep:
        os.environ["WELDER_CACHE_DIR"] = keep
    os.environ[SANDBOX_VARIABLE] = str(sandbox)


def _share_cores_between_workers() -> None:
    """In a pytest-xdist worker: welder's own processes (planning workers, compiles) get
    this worker's share of the cores ($WELDER_JOBS, unless set already), since the other
    workers keep the rest busy."""
    from welder.hostcpu import JOBS_VARIABLE, usable_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if JOBS_VARIABLE not in os.environ:
        os.environ[JOBS_VARIABLE] = str(max(1, usable_cores() // workers))


def pytest_unconfigure(config: pytest.Config) -> None:
    sandbox = config.stash.get(_SANDBOX_KEY, None)
    if sandbox is None:
        return
    for name, value in config.stash[_SAVED_KEY].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(sandbox, ignore_errors=True)


_SANDBOX_KEY = pytest.StashKey[Path]()
_SAVED_KEY = pytest.StashKey[dict]()
