"""The moe-core command line, in process (JSON shapes, exit codes) and as the installed script."""

import json
import subprocess
import sys

import pytest

from moe_core import cli
from moe_core.plugins import get_plugin_manager

from .test_plugins import GOOD, RAISES


@pytest.fixture(autouse=True)
def fresh_manager():
    get_plugin_manager.cache_clear()
    yield
    get_plugin_manager.cache_clear()


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_backends_json_keys(capsys):
    code, out, _ = run(capsys, "backends", "--json")
    rows = json.loads(out)
    assert code == 0
    for row in rows:
        assert set(row) == {"plugin", "plugin_version", "backend", "role", "available", "code", "message", "hint"}
    ref = {r["backend"]: r for r in rows if r["plugin"] == "reference"}
    assert ref["reference"]["available"] and ref["standard"]["available"] and ref["reference"]["role"] == "experts"


def test_plan_json_and_explicit_failure_exit_2(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--json", "--device", "cpu")
    doc = json.loads(out)
    assert code == 0 and doc["ok"]
    assert set(doc["plan"]) >= {"dispatcher", "experts", "dispatch_dtype", "format", "dtype_trail"}
    code, out, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--json", "--device", "cpu",
                       "--experts-backend", "reference", "--dispatcher", "torch_a2a")
    doc = json.loads(out)
    assert code == 2 and not doc["ok"]
    [rejection] = doc["rejected"]
    assert set(rejection) == {"dispatcher", "experts", "reasons"}
    assert rejection["reasons"][0]["code"] == "UNSUPPORTED_PARALLEL" and rejection["reasons"][0]["hint"]


def test_plan_text_lists_every_reason(capsys):
    code, _, err = run(capsys, "plan", "--experts", "8", "--top-k", "2", "--hidden", "128", "--intermediate", "64",
                       "--cuda-graph", "--device", "cpu")
    assert code == 2 and "reference.standard x reference.reference:\n    - NOT_GRAPH_SAFE" in err


def test_doctor_exit_codes(capsys, install_dist):
    code, out, _ = run(capsys, "doctor")
    assert code == 0, out
    install_dist("moe-plugin-good", "good_plugin", GOOD, entry="good")
    install_dist("moe-plugin-broken", "broken_plugin", RAISES, entry="broken")
    get_plugin_manager.cache_clear()
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "broken" in out and "LOAD_ERROR" in out and "libacme.so" in out
    code, out, _ = run(capsys, "backends", "--json")
    rows = json.loads(out)
    assert any(r["plugin"] == "broken" and r["code"] == "LOAD_ERROR" and r["backend"] is None for r in rows)
    assert any(r["backend"] == "good_experts" and r["available"] for r in rows)


def test_installed_script_demo_runs_and_checks():
    proc = subprocess.run([sys.executable, "-m", "moe_core.cli", "demo", "--preset", "mixtral-8x7b", "--tokens", "17",
                           "--repeat", "2", "--quant", "fp8_block"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> OK" in proc.stdout and "dispatch dtype: fp8" in proc.stdout
