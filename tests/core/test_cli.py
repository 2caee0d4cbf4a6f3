"""The moe-core command line, in process (JSON shapes, exit codes) and as the installed script."""

import csv
import importlib.util
import json
import subprocess
import sys

import pytest

from moe_core import cli
from moe_core.config import PRESETS
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
    for row in rows:  # the original keys, and the declared capabilities
        assert set(row) >= {"plugin", "plugin_version", "backend", "role", "available", "code", "message", "hint"}
        assert set(row) >= set(cli.CAPABILITY_KEYS)
    ref = {r["backend"]: r for r in rows if r["plugin"] == "reference"}
    assert ref["reference"]["available"] and ref["standard"]["available"] and ref["reference"]["role"] == "experts"
    assert ref["torch_a2a"]["ep"] == "required" and ref["torch_a2a"]["formats"] == ["ep_normal", "ep_masked"]
    assert ref["reference"]["devices"] == ["cpu", "cuda", "npu", "rocm"] and "nvfp4" in ref["reference"]["quant_schemes"]
    assert ref["standard"]["graph_safe_formats"] == ["standard"] and ref["standard"]["distribution"] == "moe-core"
    keys = [(r["plugin"], r["role"] or "", r["backend"] or "") for r in rows]
    assert keys == sorted(keys)


def test_backends_table_is_sorted_and_fits_100_columns(capsys):
    code, out, _ = run(capsys, "backends")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["BACKEND", "ROLE", "VERSION", "STATUS"]
    assert max(len(line) for line in lines) <= 100
    assert "reference.reference" in out and "available" in out


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


def test_plan_text_shows_what_concerns_the_user(capsys):
    """By default the rejected pairs whose unnamed backends are built for another device are left out
    (with a count); -v lists them all, --json always does."""
    code, out, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--device", "cpu")
    assert code == 0 and "experts:        reference.reference" in out and "dtype chain:" in out
    code, verbose, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--device", "cpu", "-v")
    assert code == 0 and len(verbose.splitlines()) >= len(out.splitlines())
    code, doc, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--device", "cpu", "--json")
    rejected = json.loads(doc)["rejected"]
    foreign = [r for r in rejected if any(name.split(".")[0] in ("cuda", "rocm", "npu")
                                          for name in (r["dispatcher"], r["experts"]))]
    for r in foreign:  # other devices' pairs: only with -v
        assert f"{r['dispatcher']} x {r['experts']}:" not in out and f"{r['dispatcher']} x {r['experts']}:" in verbose
    if foreign:
        assert f"({len(foreign)} rejected candidate(s) built for other devices not shown" in out
    assert len(out.splitlines()) <= 40


def test_explicit_backend_rejections_come_first_for_the_target_device(capsys):
    """An explicit experts backend: the pairs with a dispatcher for this device are shown, the others'
    (another device's dispatchers) only with -v."""
    code, _, err = run(capsys, "plan", "--preset", "deepseek-v3", "--device", "cpu", "--experts-backend", "reference",
                       "--dispatcher", "torch_a2a")
    assert code == 2 and "reference.torch_a2a x reference.reference:" in err and "UNSUPPORTED_PARALLEL" in err


@pytest.mark.parametrize("argv, option, expected", [
    (("plan", "--experts", "0"), "'--experts'", "0 is not in the range x>=1"),
    (("plan", "--preset", "deepseek-v3", "--experts", "0"), "'--experts'", "x>=1"),
    (("plan", "--preset", "deepseek-v3", "--ep", "0"), "'--ep'", "x>=1"),
    (("plan", "--experts", "8", "--top-k", "2"), "--hidden", "give --preset NAME"),
    (("demo", "--repeat", "0"), "'--repeat'", "0 is not in the range x>=1"),
    (("demo", "--scale", "0"), "'--scale'", "0 is not in the range x>=1"),
    (("demo", "--tokens", "-1"), "'--tokens'", "x>=1"),
    (("plan", "--preset", "deepseek-v3", "--quant", "fp8"), "'--quant'", "Did you mean 'fp8_block' or 'fp8_per_token'?"),
    (("plan", "--preset", "deepsek-v3"), "'--preset'", "Did you mean 'deepseek-v3'?"),
    (("plan", "--preset", "deepseek-v3", "--qu", "fp8_block"), "'--qu'", "Did you mean '--quant'?"),
    (("plan", "--preset", "deepseek-v3", "--experts-backend", "refrence"), "--experts-backend",
     "Did you mean 'reference'?"),
    (("plan", "--preset", "deepseek-v3", "--dispatcher", "reference"), "--dispatcher", "an experts backend"),
    (("--allow", "nosuch", "backends"), "--allow", "no installed plugin is named 'nosuch'"),
    (("bench", "--backends", "nosuch"), "--backends", "no experts or fused backend is named 'nosuch'"),
    (("tune", "nosuch-tuner"), "NAME", "no tuner named 'nosuch-tuner'"),
])
def test_usage_errors_exit_2_and_name_the_option(capsys, argv, option, expected):
    code, _, err = run(capsys, *argv)
    assert code == 2 and option in err and expected in err, err


def test_blocking_an_absent_plugin_is_only_noted(capsys):
    code, out, err = run(capsys, "--block", "nosuch", "backends", "--json")
    assert code == 0 and json.loads(out) and "note: --block nosuch: no installed plugin has that name" in err


def test_an_option_is_never_abbreviated(capsys):
    code, _, err = run(capsys, "backends", "--js")
    assert code == 2 and "No such option" in err


def test_version_and_module_entry_point():
    import moe_core

    assert moe_core.__version__ == importlib.metadata.version("moe-core")
    proc = subprocess.run([sys.executable, "-m", "moe_core", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"moe-core {moe_core.__version__} ")
    proc = subprocess.run([sys.executable, "-m", "moe_core", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "plan" in proc.stdout and "doctor" in proc.stdout and not proc.stderr


def test_every_option_has_help():
    import click

    def commands(group):
        for name, command in group.commands.items():
            yield name, command
            if isinstance(command, click.Group):
                yield from commands(command)

    for name, command in [("moe-core", cli.app), *commands(cli.app)]:
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert param.help, f"{name} {param.opts} has no help"


def test_completion_script(capsys):
    code, out, _ = run(capsys, "completion", "bash")
    assert code == 0 and "_MOE_CORE_COMPLETE=bash_complete" in out


def test_doctor_json_has_the_environment(capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    report = json.loads(out)
    env = report["environment"]
    assert code == (1 if report["problems"] else 0)
    assert env["python"] and env["torch"] and env["packages"]["torch"] and "device_kind" in env
    declared = {p for spec in get_plugin_manager().specs for p in spec.packages}  # what the plugins declare
    assert declared <= set(env["packages"]) and all(env["packages"][p] is None or env["packages"][p] for p in declared)
    assert {p["plugin"] for p in report["plugins"]} >= {"reference"}


PROBE_RAISES = """
from moe_core import BackendPlugin, BackendSpec, Role, Format

def broken_probe():
    raise RuntimeError("driver API mismatch")

class P(BackendPlugin):
    def backends(self):
        return [BackendSpec(name="probe_raises", role=Role.EXPERTS, impl="moe_core.reference.experts:ReferenceExperts",
                            formats=(Format.STANDARD,), devices=frozenset({"cpu"}), probe=broken_probe)]

plugin = P()
"""


def test_doctor_fails_whenever_backends_shows_a_load_error(capsys, install_dist):
    install_dist("moe-plugin-probe-raises", "probe_raises_plugin", PROBE_RAISES, entry="probe_raises")
    get_plugin_manager.cache_clear()
    code, out, _ = run(capsys, "backends", "--json")
    row = next(r for r in json.loads(out) if r["backend"] == "probe_raises")
    assert row["code"] == "LOAD_ERROR" and row["distribution"] == "moe-plugin-probe-raises"
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "probe_raises.probe_raises" in out and "driver API mismatch" in out
    code, out, _ = run(capsys, "doctor", "--json")
    assert code == 1 and any("probe_raises" in p for p in json.loads(out)["problems"])


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


def test_unknown_backend_mentions_a_plugin_that_failed_to_load(capsys, install_dist):
    install_dist("moe-plugin-broken", "broken_plugin", RAISES, entry="broken")
    get_plugin_manager.cache_clear()
    code, _, err = run(capsys, "plan", "--preset", "mixtral-8x7b", "--device", "cpu", "--experts-backend", "loop")
    assert code == 2 and "failed to load" in err and "broken" in err


def _bench_files(tmp_path, capsys, *extra):
    path = tmp_path / "b.json"
    code, out, err = run(capsys, "bench", "--presets", "mixtral-8x7b", "qwen3-30b-a3b", "--tokens", "1", "3",
                         "--scale", "64", "--iters", "1", "--warmup", "0", "--backends", "reference",
                         "--device", "cpu", "--json", str(path), *extra)
    return code, out, err, path


def test_bench_on_cpu_writes_json_csv_and_names_the_device(tmp_path, capsys):
    code, out, err, path = _bench_files(tmp_path, capsys)
    assert code == 0, err
    doc = json.loads(path.read_text())
    assert doc["meta"]["device_kind"] == "cpu" and doc["meta"]["device"].strip() and doc["meta"]["scale"] == 64
    assert doc["meta"]["bw"] is None and doc["meta"]["peak_bf16"] is None  # no other device's peaks on a CPU
    cells = {(r["preset"], r["T"]) for r in doc["results"]}
    assert cells == {("mixtral-8x7b", 1), ("mixtral-8x7b", 3), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 3)}
    for r in doc["results"]:  # the keys benchmarks/cuda/vs_bar.py reads, and no made-up floor
        assert r["best_us"] > 0 and r["frac_floor"] is None and r["floor_us"] is None and r["backend"] == "reference"
        assert r["hidden_size"] == PRESETS[r["preset"]]["hidden_size"] // 64
    assert set(doc["meta"]["auto_plan"]) == {"mixtral-8x7b/unquantized", "qwen3-30b-a3b/unquantized"}
    with open(tmp_path / "b.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and float(rows[0]["best_us"]) == pytest.approx(doc["results"][0]["best_us"])
    assert "mixtral-8x7b" in out and "T=3" in out and doc["meta"]["device"] in err
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in err and not (tmp_path / "b.png").exists()
    else:
        assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_keeps_the_double_dash_form_and_gives_a_floor_where_peaks_are_given(tmp_path, capsys):
    """`moe-core bench -- ARGS` (benchmarks/cuda/run_h100.sh) still parses; given peaks give a floor."""
    path = tmp_path / "b.json"
    code, _, err = run(capsys, "bench", "--", "--presets", "mixtral-8x7b", "--tokens", "2", "--scale", "64",
                       "--iters", "1", "--warmup", "0", "--backends", "reference", "--device", "cpu",
                       "--bw", "1e11", "--peak-bf16", "1e12", "--peak-fp8", "2e12", "--json", str(path))
    assert code == 0, err
    [r] = json.loads(path.read_text())["results"]
    assert r["frac_floor"] == pytest.approx(r["floor_us"] / r["best_us"]) and r["frac_floor"] > 0


def test_installed_script_demo_runs_and_checks():
    proc = subprocess.run([sys.executable, "-m", "moe_core.cli", "demo", "--preset", "mixtral-8x7b", "--tokens", "17",
                           "--repeat", "2", "--quant", "fp8_block"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> OK" in proc.stdout and "dispatch dtype: fp8" in proc.stdout
