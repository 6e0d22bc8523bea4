"""What CHATMESH_REQUIRE_SERVICES=1 (CI) turns into failures: a broken engine backend builder and absent model
files fail the tests that need them, they do not skip; and CI runs the Hypothesis profile it selects.

Each check runs pytest in a child process on the tests in question, with the fault made for it (a plugin that
breaks the builder, an empty model folder), and reads every test's outcome from its JUnit report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

# One test per place that needs the fetched model files (each fixture or helper that checks for them).
NEEDS_MODELS = [
    "tests/model/test_profile.py::test_jinja_text_is_the_templates_own_output",
    "tests/engine/test_model_agreement.py::test_stats_report_the_served_model",
    "tests/engine/test_sim.py::test_scripts_spell_special_tokens_and_bad_scripts_are_refused",
    "tests/chat/test_prompting.py::test_smollm2_renders_the_tokens_it_did_before_turn_after_turn",
    "tests/local/test_executor.py::test_logits_match_the_dense_reference",
    "tests/e2e/test_model_profile.py::test_a_llama_mesh_completes_turns_with_usage_in_llama_tokens",
    "tests/e2e/test_local_model.py::test_capital_of_france_is_paris_and_the_next_turn_hits_the_cache",
    "tests/triton/test_triton_wire.py::test_render_cli_writes_the_profile",
    "tests/engine/test_conformance.py::test_stream_is_started_deltas_finished[local]",
]


def outcomes(tmp: Path, args: list[str], **env: str) -> dict[str, str]:
    """Each test's outcome (passed, skipped, failed) in a child pytest run of `args`."""
    report = tmp / "report.xml"
    child_env = {**os.environ, "CHATMESH_REQUIRE_SERVICES": "1", **env}
    child_env.pop("PYTEST_XDIST_WORKER", None)
    child_env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                          "--basetemp", str(tmp / "base"), *args], cwd=ROOT, env=child_env, capture_output=True,
                         text=True, timeout=240)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                       else "passed")
    assert found, run.stdout[-3000:]
    return found


def test_a_broken_backend_builder_fails_the_conformance_cases(tmp_path: Path) -> None:
    found = outcomes(tmp_path, ["-p", "tests.hooks.broken_backend", "tests/engine/test_conformance.py"])
    cases = {name: outcome for name, outcome in found.items() if name.endswith("]")}  # those run per backend
    assert len(cases) >= 3 * 7 and set(cases.values()) == {"failed"}, cases  # none skipped, none passed


def test_absent_model_files_fail_the_tests_that_need_them(tmp_path: Path) -> None:
    empty = tmp_path / "no-models"
    empty.mkdir()
    found = outcomes(tmp_path, NEEDS_MODELS, CHATMESH_MODEL_DIR=str(empty))
    assert len(found) == len(NEEDS_MODELS), found
    assert set(found.values()) == {"failed"}, found


def test_ci_selects_the_derandomized_profile_without_setting_ci() -> None:
    """.ci/run sets CHATMESH_REQUIRE_SERVICES=1, and that alone selects the profile CI runs."""
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"CHATMESH_REQUIRE_SERVICES": "1"}
    probe = ("import tests.conftest as c; from hypothesis import settings; "
             "print(c.HYPOTHESIS_PROFILE, settings().derandomize, settings().deadline)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["ci", "True", "None"], out.stdout + out.stderr
