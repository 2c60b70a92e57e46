"""pagellm's OpenMP wait policy: set when pagellm is imported (before torch), inherited
by engine-core processes, and never over a policy the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagellm import envs

_OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@pytest.fixture
def clean_env(monkeypatch):
    for var in _OMP_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_sets_the_default_policy_when_the_user_set_none(clean_env) -> None:
    envs.apply_openmp_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == envs.OPENMP_DEFAULTS["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize(("var", "value"), [
    ("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200"),
])
def test_the_users_choice_wins(clean_env, var: str, value: str) -> None:
    clean_env.setenv(var, value)
    envs.apply_openmp_defaults()
    assert {v: os.environ.get(v) for v in _OMP_VARS} == {
        v: (value if v == var else None) for v in _OMP_VARS}


def test_the_policy_is_in_the_environment_before_torch_loads() -> None:
    code = ("import os, sys; import pagellm.entrypoints.cli.main; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in _OMP_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "PASSIVE"], out.stderr
