"""The driver, written once: the training loop over whatever engine makes its calls durable.

An engine supplies `Ops`; the loop never learns which one it runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import Field

from . import _harbor as harbor
from . import _secret_hunt as hunt_env
from ._config import RunConfig
from ._models import PolicyRef, Reward, Rubric, StepResult, Trajectory, TrialSpec, Weights, World, _Frozen

AnyTrajectory = Trajectory | harbor.TaskTrajectory


class UnitFailed(Exception):
    """A unit that failed on every attempt; carries the last attempt's error."""


class TrialOutcome(_Frozen):
    """One trial's end: a reward, or the reason it was skipped."""

    trial_id: str
    reward: Reward | None = None
    error: str | None = Field(None, description="'phase: ExceptionType: message' of a skipped trial.")
    info: dict[str, Any] = Field(default_factory=dict, description="What the trajectory says of itself.")

    @property
    def error_type(self) -> str | None:
        """The exception type of a skipped trial."""
        return self.error.split(": ")[1] if self.error and self.error.count(": ") >= 2 else None

    @property
    def error_message(self) -> str | None:
        """The exception message of a skipped trial."""
        return self.error.split(": ", 2)[2] if self.error and self.error.count(": ") >= 2 else self.error


class StepRecord(_Frozen):
    """What the loop reports about a finished step."""

    result: StepResult
    n_specs: int
    trials: list[TrialOutcome]
    failed_trials: dict[str, str]
    max_turns: int
    wall_s: float


class Ops(Protocol):
    """The durable calls the loop makes; an engine implements them."""

    async def build_worlds(self, world_ids: list[str]) -> dict[str, World]: ...

    async def generate(self, spec: TrialSpec, weights: Weights, world: World) -> AnyTrajectory: ...

    async def verify_and_judge(self, traj: AnyTrajectory, rubric: Rubric) -> Reward: ...

    async def fan_out(
        self, specs: list[TrialSpec], weights: Weights, worlds: dict[str, World], rubric: Rubric
    ) -> list[TrialOutcome]: ...

    async def train_step(self, step: int, weights: Weights, rewards: list[Reward], lr: float) -> StepResult: ...

    async def step_done(self, record: StepRecord) -> None: ...


async def run_trial(ops: Ops, spec: TrialSpec, weights: Weights, world: World, rubric: Rubric) -> TrialOutcome:
    """One trial's pipeline: generate, then judge the trajectory the moment it lands."""
    try:
        traj = await ops.generate(spec, weights, world)
    except UnitFailed as e:
        return TrialOutcome(trial_id=spec.trial_id, error=f"generate: {e}")
    try:
        reward = await ops.verify_and_judge(traj, rubric)
    except UnitFailed as e:
        return TrialOutcome(trial_id=spec.trial_id, error=f"verify_and_judge: {e}")
    return TrialOutcome(trial_id=spec.trial_id, reward=reward, info=traj.summary())


def plan(config: RunConfig) -> tuple[list[str], Callable[[int], list[TrialSpec]], Weights]:
    """The run's worlds, its trials per step and its first weights: secret-hunt, or Harbor tasks."""
    policy = PolicyRef(model=config.policy_model, adapter=config.policy_adapter) if config.uses_llm_policy else None
    if config.tasks is not None:
        tasks = list(harbor.tasks_at(config.tasks))
        return (
            [t.name for t in tasks],
            lambda step: harbor.trial_specs(step, tasks, config.n_samples),
            Weights(policy=policy),
        )
    world_ids = config.world_ids
    return (
        world_ids,
        lambda step: hunt_env.trial_specs(step, world_ids, config.prompts_per_step, config.n_samples),
        hunt_env.initial_weights(world_ids, policy),  # deterministic, so step-0 rollouts are reusable
    )


async def drive(config: RunConfig, ops: Ops) -> list[StepResult]:
    """Run every step: fan out trials, skip failed ones, train, carry the weights forward."""
    world_ids, trial_specs, weights = plan(config)
    worlds = await ops.build_worlds(world_ids)
    history: list[StepResult] = []
    for step in range(config.n_steps):
        t0 = time.monotonic()
        specs = trial_specs(step)
        outcomes = await ops.fan_out(specs, weights, worlds, config.rubric_model)
        # canonical order: a replay must hand the trainer identical inputs whatever finished first
        rewards = sorted((o.reward for o in outcomes if o.reward is not None), key=lambda r: r.trial_id)
        result = await ops.train_step(step, weights, rewards, config.lr)
        await ops.step_done(
            StepRecord(
                result=result,
                n_specs=len(specs),
                trials=outcomes,
                failed_trials={o.trial_id: o.error for o in outcomes if o.error is not None},
                max_turns=max((r.n_turns for r in rewards), default=0),
                wall_s=round(time.monotonic() - t0, 3),
            )
        )
        weights = result.weights
        history.append(result)
    return history
