"""pagellm's OpenMP wait policy goes to its own compute processes only: the environment of
the engine-core processes it spawns (envs.compute_env), and an in-process engine core's
own libgomp when it is the first to load torch (envs.import_torch_with_openmp_defaults).
`import pagellm` leaves os.environ alone, so programs started afterwards (a user's, or
benchmarks/compare.py's peers) never inherit it; a policy the user chose always wins."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagellm import envs
from pagellm.engine import core_client, prestart

ROOT = Path(__file__).resolve().parents[1]
_OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_USER_CHOICES = [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200")]
_PRINT_CHILD_POLICY = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
                       "'import os; print(os.environ.get(\"OMP_WAIT_POLICY\"))'], check=True)")


def _openmp_free_env(**extra: str) -> dict[str, str]:
    """This environment without any OMP_*/GOMP_*/KMP_* variable (conftest sets
    OMP_WAIT_POLICY for the test process itself), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _libgomp_spincount(stderr: str) -> str:
    """GOMP_SPINCOUNT as libgomp took it, from its OMP_DISPLAY_ENV=VERBOSE report at load
    ('0' under OMP_WAIT_POLICY=PASSIVE, 300000 by default; the report shows PASSIVE
    when no policy is set, so the spin count is what tells them apart)."""
    found = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", stderr)
    if not found:
        pytest.skip("torch's OpenMP runtime is not libgomp (no OMP_DISPLAY_ENV report)")
    return found[0]


@pytest.fixture
def clean_env(monkeypatch):
    for var in _OMP_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# -- import pagellm --------------------------------------------------------------------


def test_import_pagellm_leaves_the_environment_and_later_children_alone() -> None:
    code = ("import os, sys; import pagellm, pagellm.entrypoints.cli.main; from pagellm import LLM; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'), flush=True); "
            + _PRINT_CHILD_POLICY)
    assert _run(code, _openmp_free_env()).stdout.split() == ["False", "None", "None"]


# -- engine-core processes: compute_env ------------------------------------------------


def test_compute_env_adds_passive_when_the_user_set_none(clean_env) -> None:
    before = dict(os.environ)
    env = envs.compute_env()
    assert env == {**before, "OMP_WAIT_POLICY": "PASSIVE"}
    assert envs.OPENMP_DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert dict(os.environ) == before


@pytest.mark.parametrize(("var", "value"), _USER_CHOICES)
def test_compute_env_adds_nothing_over_the_users_choice(clean_env, var: str, value: str) -> None:
    clean_env.setenv(var, value)
    before = dict(os.environ)
    assert envs.compute_env() == before
    assert dict(os.environ) == before
    assert {v: os.environ.get(v) for v in _OMP_VARS} == {v: (value if v == var else None) for v in _OMP_VARS}


class _FakePopen:
    """Records the keyword arguments of each Popen; a process that already exited."""

    calls: list[dict] = []

    def __init__(self, cmd: list[str], **kwargs) -> None:
        _FakePopen.calls.append(kwargs)
        self.stdin = io.BytesIO()
        self.pid = 0

    def poll(self) -> int:
        return 0


@pytest.fixture
def fake_popen(clean_env):
    _FakePopen.calls = []
    clean_env.setattr(subprocess, "Popen", _FakePopen)
    return _FakePopen.calls


def test_launched_engine_cores_get_the_policy_in_their_popen_env(fake_popen) -> None:
    before = dict(os.environ)
    core_client.launch_engines({"config": 1}, [0, 1], "ipc://in", "ipc://out")
    assert [c["env"] for c in fake_popen] == [{**before, "OMP_WAIT_POLICY": "PASSIVE"}] * 2
    assert dict(os.environ) == before


def test_the_prestarted_engine_core_gets_the_policy_in_its_popen_env(fake_popen) -> None:
    before = dict(os.environ)
    prestart.prestart_engine_core()
    engine = prestart.claim_prestarted()  # it "exited": claiming stops it, removes its tmpdir
    assert engine is None
    assert [c["env"] for c in fake_popen] == [{**before, "OMP_WAIT_POLICY": "PASSIVE"}]
    assert dict(os.environ) == before


# -- the in-process engine core: import_torch_with_openmp_defaults -----------------------

_IMPORT_WITH_DEFAULTS = (
    "import os, sys; from pagellm import envs; envs.import_torch_with_openmp_defaults(); "
    "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'), flush=True); "
    + _PRINT_CHILD_POLICY)


def test_in_process_torch_takes_passive_and_the_environment_is_restored() -> None:
    out = _run(_IMPORT_WITH_DEFAULTS, _openmp_free_env(OMP_DISPLAY_ENV="VERBOSE"))
    assert out.stdout.split() == ["True", "None", "None"]
    assert _libgomp_spincount(out.stderr) == "0"  # libgomp runs PASSIVE


@pytest.mark.parametrize(("var", "value"), [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "12345")])
def test_in_process_torch_keeps_the_users_choice(var: str, value: str) -> None:
    code = _IMPORT_WITH_DEFAULTS + f"; print(os.environ.get({var!r}))"
    out = _run(code, _openmp_free_env(OMP_DISPLAY_ENV="VERBOSE", **{var: value}))
    policy = value if var == "OMP_WAIT_POLICY" else "None"
    assert out.stdout.split() == ["True", policy, policy, value]
    spins = _libgomp_spincount(out.stderr)
    if var == "GOMP_SPINCOUNT":
        assert spins == value
    else:
        assert int(spins) > 0  # ACTIVE: spins


def test_torch_imported_first_keeps_libgomps_default() -> None:
    code = "import torch; " + _IMPORT_WITH_DEFAULTS
    out = _run(code, _openmp_free_env(OMP_DISPLAY_ENV="VERBOSE"))
    assert out.stdout.split() == ["True", "None", "None"]
    assert int(_libgomp_spincount(out.stderr)) > 0  # the default: spins before sleeping


def test_an_in_process_engine_imports_torch_with_the_policy_first() -> None:
    """LLMEngine resolves multiprocess_mode before it builds anything: in-process, torch
    is loaded then with PASSIVE; with an engine-core process, torch is not loaded."""
    code = ("import os, sys; from pagellm.engine.llm_engine import resolve_multiprocess_mode; "
            "assert resolve_multiprocess_mode(True) is True and 'torch' not in sys.modules; "
            "os.environ['PAGELLM_ENABLE_MULTIPROCESSING'] = '0'; "
            "print(resolve_multiprocess_mode(None), 'torch' in sys.modules, "
            "os.environ.get('OMP_WAIT_POLICY'))")
    out = _run(code, _openmp_free_env(OMP_DISPLAY_ENV="VERBOSE"))
    assert out.stdout.split() == ["False", "True", "None"]
    assert _libgomp_spincount(out.stderr) == "0"


# -- benchmarks/compare.py's peers ------------------------------------------------------

_PEER_ENVS = (
    "import json, os, sys; sys.path.insert(0, 'benchmarks'); import compare; "
    "from pagellm import envs; envs.import_torch_with_openmp_defaults(); "
    "os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'; os.environ['KMP_BLOCKTIME'] = '0'; "  # as if pagellm set them
    "omp = lambda env: {k: v for k, v in env.items() if k.startswith(('OMP_', 'GOMP_', 'KMP_'))}; "
    "print(json.dumps([omp(compare.system_env()), omp(compare.system_env(compare.PAGELLM_SYSTEM_ENV['pagellm-active'])), "
    "compare.system_env()['HF_HUB_OFFLINE']]))")


@pytest.mark.parametrize("user", [{}, {"GOMP_SPINCOUNT": "1000"}])
def test_compare_peers_start_with_the_users_openmp_settings_only(user: dict[str, str]) -> None:
    env = _openmp_free_env(**user)
    env.pop("HF_HUB_OFFLINE")
    peer, active, offline = json.loads(_run(_PEER_ENVS, env).stdout)
    assert peer == user
    assert active == {**user, "OMP_WAIT_POLICY": "ACTIVE"}  # a pagellm row's explicit setting
    assert offline == "1"
