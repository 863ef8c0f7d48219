"""durable-rl: durable agentic reinforcement learning.

Every trial, judgment and training step is a durable, independently retryable unit.
"""

from ._config import RUBRICS, RunConfig
from ._identity import identity
from ._loop import Ops, StepRecord, TrialOutcome, UnitFailed, drive, run_trial
from ._models import JudgeAnswer, Reward, Rubric, StepResult, Trajectory, TrialSpec, Turn, Weights, World
from ._secret_hunt import SimulatedJudge
from ._unit import UnitPolicy, policy_of, unit
from ._units import Judge, build_world, generate, train_step, verify_and_judge

__version__ = "0.1.0"

__all__ = [
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
