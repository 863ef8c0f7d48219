"""The units: plain async functions of typed inputs, with their durability declared around them.

They never import the engine, the CLI or the report; each runs as-is in a unit test.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from . import _secret_hunt as hunt_env
from ._models import JudgeAnswer, Reward, Rubric, StepResult, Trajectory, TrialSpec, Weights, World
from ._unit import unit


class Judge(Protocol):
    """Scores a trajectory against a rubric; `model` is part of every judgment's identity."""

    model: str

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer: ...


@unit(name="build_world", version="1", tier="sandbox", retries=1)
async def build_world(world_id: str, *, worlds_dir: Path) -> World:
    """Write the world's snapshot once under `worlds_dir`; later calls find it and reuse it."""
    files = hunt_env.world_files(world_id)
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\x00{files[rel]}\x00".encode())
    content = digest.hexdigest()
    root = worlds_dir / f"{world_id}-{content[:16]}"
    await asyncio.to_thread(_publish_snapshot, root, files)
    return World(world_id=world_id, root=str(root), content_sha256=content)


def _publish_snapshot(root: Path, files: dict[str, str]) -> None:
    if root.exists():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    for rel, text in files.items():
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o444)  # a snapshot is read-only; trials write to their own copy
    try:
        os.rename(staging, root)  # atomic: a reader sees no world or a whole one
    except OSError:
        shutil.rmtree(staging)  # another process published the same snapshot first


def _private_copy(root: str, workdir: Path) -> None:
    shutil.copytree(root, workdir, dirs_exist_ok=True)
    for path in workdir.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the copy is the trial's to change


@unit(name="generate", version="1", tier="sandbox", retries=1, timeout_s=300.0)
async def generate(
    spec: TrialSpec,
    weights: Weights,
    world: World,
    *,
    attempt: int = 0,
    flaky_trial_rate: float = 0.0,
    turn_latency: float = 0.2,
    hang: bool = False,
) -> Trajectory:
    """One trial on a private copy of the world; the same inputs give the same trajectory."""
    workdir = Path(tempfile.mkdtemp(prefix=f"durable-rl-{spec.trial_id}-"))
    try:  # removed however the trial ends, a cancelled (timed-out) one included
        await asyncio.to_thread(_private_copy, world.root, workdir)
        return await hunt_env.hunt(
            spec,
            weights,
            workdir,
            attempt=attempt,
            flaky_trial_rate=flaky_trial_rate,
            turn_latency=turn_latency,
            hang=hang,
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)


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
