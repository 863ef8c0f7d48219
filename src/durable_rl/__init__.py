"""durable-rl: durable agentic reinforcement learning.

Every trial, judgment and training step is a durable, independently retryable unit.
"""

from ._config import RUBRICS, RunConfig
from ._fake_llm import ScriptedLLMServer
from ._harbor import HarborTask, TaskTrajectory, load_tasks
from ._identity import identity
from ._llm import Endpoint, LLMUnavailable
from ._llm_judge import Criterion, JudgeAnswerInvalid, JudgeRubric, LLMJudge
from ._llm_policy import agent_loop
from ._loop import Ops, StepRecord, TrialOutcome, UnitFailed, drive, run_trial
from ._models import (
    AgentTurn,
    JudgeAnswer,
    PolicyRef,
    Reward,
    Rubric,
    StepResult,
    Trajectory,
    TrialSpec,
    Turn,
    Weights,
    World,
)
from ._sandbox._process import CommandResult, Limits, run_command
from ._sandbox._tools import SandboxTools, ToolError
from ._sandbox._workspace import publish_snapshot, working_copy
from ._secret_hunt import SimulatedJudge
from ._unit import UnitPolicy, policy_of, unit
from ._units import Judge, SandboxSettings, build_world, generate, train_step, verify_and_judge

__version__ = "0.1.0"

__all__ = [
    "RUBRICS",
    "AgentTurn",
    "CommandResult",
    "Criterion",
    "Endpoint",
    "HarborTask",
    "Judge",
    "JudgeAnswer",
    "JudgeAnswerInvalid",
    "JudgeRubric",
    "LLMJudge",
    "LLMUnavailable",
    "Limits",
    "Ops",
    "PolicyRef",
    "Reward",
    "Rubric",
    "RunConfig",
    "SandboxSettings",
    "SandboxTools",
    "ScriptedLLMServer",
    "SimulatedJudge",
    "StepRecord",
    "StepResult",
    "TaskTrajectory",
    "ToolError",
    "Trajectory",
    "TrialOutcome",
    "TrialSpec",
    "Turn",
    "UnitFailed",
    "UnitPolicy",
    "Weights",
    "World",
    "__version__",
    "agent_loop",
    "build_world",
    "drive",
    "generate",
    "identity",
    "load_tasks",
    "policy_of",
    "publish_snapshot",
    "run_command",
    "run_trial",
    "train_step",
    "unit",
    "verify_and_judge",
    "working_copy",
]
