"""The public face: what users import, pinned."""

import ast
from pathlib import Path

import durable_rl

SRC = Path(durable_rl.__file__).parent


def test_public_names_are_pinned() -> None:
    assert sorted(durable_rl.__all__) == sorted(
        [
            "RUBRICS",
            "Judge",
            "JudgeAnswer",
            "Ops",
            "Reward",
            "Rubric",
            "RunConfig",
            "SimulatedJudge",
            "StepRecord",
            "StepResult",
            "Trajectory",
            "TrialOutcome",
            "TrialSpec",
            "Turn",
            "UnitFailed",
            "UnitPolicy",
            "Weights",
            "World",
            "__version__",
            "build_world",
            "drive",
            "generate",
            "identity",
            "policy_of",
            "run_trial",
            "train_step",
            "unit",
            "verify_and_judge",
        ]
    )
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
    for module in ("_units.py", "_secret_hunt.py", "_models.py", "_unit.py", "_identity.py", "_loop.py"):
        imported = _imports(SRC / module)
        assert not {i for i in imported if "engine" in i or "_cli" in i or "_report" in i or i.startswith("dbos")}, (
            module
        )


def test_only_the_engine_imports_dbos() -> None:
    for path in SRC.rglob("*.py"):
        if "dbos" in {i.split(".")[0] for i in _imports(path)}:
            assert path.parent.name == "_engine", path
