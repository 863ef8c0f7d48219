"""The public face: what users import, pinned."""

import ast
from pathlib import Path

import durable_rl

SRC = Path(durable_rl.__file__).parent


PUBLIC = """
    AgentTurn CommandResult Criterion Endpoint HarborTask Judge JudgeAnswer JudgeAnswerInvalid JudgeRubric LLMJudge
    LLMUnavailable Limits Ops PolicyRef RUBRICS Reward Rubric RunConfig SandboxSettings SandboxTools
    ScriptedLLMServer SimulatedJudge StepRecord StepResult TaskTrajectory ToolError Trajectory TrialOutcome
    TrialSpec Turn UnitFailed UnitPolicy Weights World __version__ agent_loop build_world drive generate identity
    load_tasks policy_of publish_snapshot run_command run_trial train_step unit verify_and_judge working_copy
""".split()


def test_public_names_are_pinned() -> None:
    assert sorted(durable_rl.__all__) == sorted(PUBLIC)
    for name in durable_rl.__all__:
        assert hasattr(durable_rl, name)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_units_never_import_the_engine_the_cli_or_the_report() -> None:
    units = [
        "_units.py",
        "_secret_hunt.py",
        "_harbor.py",
        "_llm.py",
        "_llm_judge.py",
        "_llm_policy.py",
        "_models.py",
        "_unit.py",
        "_identity.py",
        "_loop.py",
        "_sandbox/_process.py",
        "_sandbox/_tools.py",
        "_sandbox/_workspace.py",
    ]
    for module in units:
        imported = _imports(SRC / module)
        assert not {i for i in imported if "engine" in i or "_cli" in i or "_report" in i or i.startswith("dbos")}, (
            module
        )


def test_only_the_engine_imports_dbos() -> None:
    for path in SRC.rglob("*.py"):
        if "dbos" in {i.split(".")[0] for i in _imports(path)}:
            assert path.parent.name == "_engine", path
