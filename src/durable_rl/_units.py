"""The units: plain async functions of typed inputs, with their durability declared around them.

They never import the engine, the CLI or the report; each runs as-is in a unit test.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Protocol

from pydantic import Field

from . import _secret_hunt as hunt_env
from ._llm import Endpoint
from ._llm_policy import secret_hunt_with_llm
from ._models import JudgeAnswer, Reward, Rubric, StepResult, Trajectory, TrialSpec, Weights, World, _Frozen
from ._sandbox._process import Limits, sandbox_uid
from ._sandbox._tools import SandboxTools
from ._sandbox._workspace import publish_snapshot, working_copy
from ._unit import unit


class Judge(Protocol):
    """Scores a trajectory against a rubric; `model` is part of every judgment's identity."""

    model: str

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer: ...


class SandboxSettings(_Frozen):
    """Where and how trials get their private working copies, and what their commands may use."""

    trials_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "durable-rl-trials",
        description="Folder of the trials' working copies (swept of dead ones at driver start).",
    )
    method: str = Field("auto", description="Working-copy method: auto, overlay, reflink or copy.")
    limits: Limits = Field(default_factory=Limits, description="Limits of every command a trial runs.")


@unit(name="build_world", version="2", tier="sandbox", retries=1)
async def build_world(world_id: str, *, snapshots_dir: Path) -> World:
    """Publish the world's files as a content-addressed snapshot, once; later calls find it."""

    def publish() -> tuple[Path, str]:
        with tempfile.TemporaryDirectory(prefix=f"world-{world_id}-") as tmp:
            for rel, text in hunt_env.world_files(world_id).items():
                path = Path(tmp) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            return publish_snapshot(Path(tmp), snapshots_dir)

    root, content = await asyncio.to_thread(publish)
    return World(world_id=world_id, root=str(root), content_sha256=content)


@unit(name="generate", version="3", tier="sandbox", retries=1, timeout_s=300.0)
async def generate(
    spec: TrialSpec,
    weights: Weights,
    world: World,
    *,
    sandbox: SandboxSettings | None = None,
    attempt: int = 0,
    flaky_trial_rate: float = 0.0,
    turn_latency: float = 0.2,
    hang: bool = False,
    llm: Endpoint | None = None,
    llm_max_turns: int = 12,
) -> Trajectory:
    """One trial on a private copy of the world, by the bandit or, when the weights name one,
    an LLM policy at `llm`; the bandit's same inputs give the same trajectory."""
    sandbox = sandbox or SandboxSettings()
    uid = sandbox_uid()
    async with working_copy(Path(world.root), sandbox.trials_dir, method=sandbox.method, owner_uid=uid) as ws:
        tools = SandboxTools(ws.path, limits=sandbox.limits, uid=uid)
        if weights.policy is not None:
            if llm is None:
                raise ValueError("the weights name an LLM policy but no endpoint was given")
            if hunt_env.sandbox_flakes(spec.trial_id, attempt, flaky_trial_rate):
                raise hunt_env.InjectedFailure(f"injected sandbox failure for {spec.trial_id} (attempt 0)")
            return await secret_hunt_with_llm(
                spec, weights.version, weights.policy, tools, llm, max_turns=llm_max_turns
            )
        return await hunt_env.hunt(
            spec,
            weights,
            tools,
            attempt=attempt,
            flaky_trial_rate=flaky_trial_rate,
            turn_latency=turn_latency,
            hang=hang,
        )


@unit(name="verify_and_judge", version="1", tier="judge", retries=2)
async def verify_and_judge(
    traj: Trajectory,
    rubric: Rubric,
    *,
    judge: Judge,
    attempt: int = 0,
    judge_flake_rate: float = 0.0,
) -> Reward:
    """The deterministic verifier, then the judge; an engine passes a judge that records answers."""
    verified = hunt_env.verify(traj)
    answer = await judge.judge(traj, rubric)
    if hunt_env.judge_task_flakes(traj.trial_id, attempt, judge_flake_rate):
        raise hunt_env.InjectedFailure(f"injected judge-task failure for {traj.trial_id} after the judge answered")
    return hunt_env.to_reward(traj, verified, answer)


@unit(name="train_step", version="1", tier="trainer", retries=1, timeout_s=600.0)
async def train_step(step: int, weights: Weights, rewards: list[Reward], lr: float = 2.0) -> StepResult:
    """One pure optimizer step: re-running it yields the identical update, never a double one."""
    rewards = sorted(rewards, key=lambda r: r.trial_id)
    n = len(rewards)
    return StepResult(
        step=step,
        weights=hunt_env.bandit_update(weights, rewards, lr),
        mean_reward=round(sum(r.reward for r in rewards) / n, 3) if n else 0.0,
        mean_turns=round(sum(r.n_turns for r in rewards) / n, 2) if n else 0.0,
        n_trials=n,
    )
