"""The public face: what users import, pinned."""

import ast
from pathlib import Path

import durable_rl

SRC = Path(durable_rl.__file__).parent


PUBLIC = """
    __version__ Agent agent_loop AgentTurn as_config build_world CommandResult Criterion drive Endpoint
    Environment Faults generate identity InjectedFailure Judge JudgeAnswer JudgeAnswerInvalid JudgeContext
    Limits LLMAgent LLMJudge LLMUnavailable load_rubric Mount NoSettings open_run Ops PluginChoice Plugins
    PluginSettings policy_of Prompt publish_snapshot read_untrusted rescore resume Reward Rubric Run run_command
    run_trial RunConfig Sandbox SandboxSettings SandboxUnavailable SandboxTools ScriptedLLMServer StepFailed
    StepRecord StepResult
    TokenTurn ToolCall ToolError train train_step TrainContext Trainer Trajectory trial_specs TrialContext
    TrialOutcome TrialSpec unit
    UnitFailed UnitOverride UnitPolicy UserError Verdict verify_and_judge VersionTrainer VOLATILE Weights
    working_copy World
""".split()


def test_public_names_are_pinned() -> None:
    assert sorted(durable_rl.__all__) == sorted(PUBLIC)
    for name in durable_rl.__all__:
        assert hasattr(durable_rl, name)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = ("." * node.level) + (node.module or "")
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)  # `from .. import _harbor` names _harbor
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


# Plug-ins: environments and the agents, judges and trainers that ship with them.
ENVIRONMENTS = {"_secret_hunt", "_harbor", "_harbor_config", "_harbor_image", "_harbor_trial"}
PLUGINS = ENVIRONMENTS | {"_llm_policy", "_llm_judge", "_trainers"}
# The core that plug-ins build on; it must not import them.
CORE = ["_models.py", "_identity.py", "_unit.py", "_protocols.py", "_registry.py", "_faults.py", "_rubrics.py"]


def _names(imported: set[str]) -> set[str]:
    return {part for i in imported for part in i.lstrip(".").split(".")}


# The edge: what renders, serves or exports the record (it reads the engine's record, never the reverse).
EDGE = {
    "_cli.py",
    "_report.py",
    "_api.py",
    "__init__.py",
    "__main__.py",
    "_progress.py",
    "_views.py",
    "_export.py",
    "_tracking.py",
    "_web.py",
}


def test_units_never_import_the_engine_the_cli_or_the_report() -> None:
    for path in [*SRC.glob("_*.py"), *(SRC / "_sandbox").glob("*.py")]:
        if path.name in EDGE:
            continue
        found = _names(_imports(path)) & {"_engine", "_cli", "_report", "_api", "dbos"}
        assert not found, (path.name, found)


def test_the_loop_the_units_and_the_engine_import_no_plugin() -> None:
    modules = [SRC / "_loop.py", SRC / "_units.py", SRC / "_config.py", *(SRC / "_engine").glob("*.py")]
    for path in modules:
        found = _names(_imports(path)) & PLUGINS
        assert not found, (path.name, found)
    for name in CORE:
        assert not _names(_imports(SRC / name)) & PLUGINS, name


def test_plugins_are_found_by_name_not_imported_by_the_registry() -> None:
    from durable_rl._registry import BUILTINS, resolve

    for category, names in BUILTINS.items():
        for name in names:
            assert resolve(category, name).kind == name  # type: ignore[arg-type]


def test_only_the_engine_imports_dbos() -> None:
    for path in SRC.rglob("*.py"):
        if "dbos" in {i.split(".")[0] for i in _imports(path)}:
            assert path.parent.name == "_engine", path


def test_only_the_engine_imports_flyte() -> None:
    for path in SRC.rglob("*.py"):
        if "flyte" in {i.split(".")[0] for i in _imports(path)}:
            assert path.parent.name == "_engine" and path.name.startswith("_flyte"), path


def test_nothing_but_the_adapters_imports_them_or_their_trainers() -> None:
    # SkyRL, skyrl-gym and TRL are optional extras: the core, the loop, the engine and the edge
    # never import them, nor the adapters (the registry names skyrl-gym's plug-ins as strings);
    # the model libraries of the [train] extra stay in the adapters and the [train] plug-ins
    train_plugins = {"_hf.py", "_grpo.py", "_sampler.py"}
    for path in SRC.rglob("*.py"):
        if path.parent.name == "adapters":
            continue
        found = _names(_imports(path)) & {"adapters", "skyrl", "skyrl_gym", "trl"}
        assert not found, (path.name, found)
        if path.name not in train_plugins:
            found = _names(_imports(path)) & {"transformers", "tokenizers", "peft", "torch"}
            assert not found, (path.name, found)


def test_the_lazy_exports_are_the_type_checkers_imports_and_all() -> None:
    """`durable_rl` imports its names on first use: the table it imports them from, the imports a
    type checker reads and `__all__` name the same things, from the same modules."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    [guard] = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    typed = {
        a.name: "." * n.level + (n.module or "") for n in guard.body if isinstance(n, ast.ImportFrom) for a in n.names
    }
    exports = durable_rl._EXPORTS  # type: ignore[attr-defined]
    assert typed == exports
    assert set(exports) | {"__version__"} == set(durable_rl.__all__)
    import importlib

    for name, module in exports.items():
        assert getattr(durable_rl, name) is getattr(importlib.import_module(module, "durable_rl"), name)
