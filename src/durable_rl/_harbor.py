"""Harbor-format tasks on a machine with no container engine.

A task folder holds `task.toml` (agent and verifier timeouts, resources), `instruction.md`,
`environment/` (the files the agent works on), `tests/test.sh` and, optionally,
`solution/solve.sh`. A trial: a private working copy of the environment, the agent (`oracle`
runs the solution, `nop` does nothing), then the verifier in the same copy, which writes its
reward to `reward.txt` (one number) or `reward.json` (a flat object of numbers) in the
verifier's log folder. A missing, empty or non-numeric reward fails the verification with
that reason; it is never read as 0.

With no container, the scripts find their folders through variables rather than Harbor's
absolute paths: the working copy is the current folder (also `$WORKDIR`), and `$TESTS_DIR`,
`$SOLUTION_DIR`, `$LOGS_DIR` (with `agent/` and `verifier/`) sit beside it, out of the agent's way.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import shutil
import time
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from ._llm import Endpoint
from ._llm_policy import agent_loop
from ._models import AgentTurn, Reward, TrialSpec, Weights, World, _Frozen
from ._sandbox._process import CommandResult, Limits, sandbox_uid
from ._sandbox._tools import SandboxTools
from ._sandbox._workspace import content_hash, publish_snapshot, working_copy
from ._unit import unit

Agent = Literal["oracle", "nop"]
AGENTS: tuple[str, ...] = ("oracle", "nop", "llm")


class TaskError(ValueError):
    """A task folder that is not a valid Harbor task; the message names the file and the fault."""


class VerificationFailed(RuntimeError):
    """The verifier ran but produced no usable reward (missing, empty, non-numeric, timed out)."""


class AgentSettings(_Frozen):
    timeout_sec: float | None = None

    @property
    def wall_s(self) -> float:
        """The agent phase's deadline: its timeout, or 600 s when the task sets none."""
        return self.timeout_sec or 600.0


class VerifierSettings(_Frozen):
    timeout_sec: float = 600.0
    env: dict[str, str] = Field(default_factory=dict)


class EnvironmentSettings(_Frozen):
    cpus: int = 1
    memory_mb: int = 2048
    storage_mb: int = 10240
    allow_internet: bool = False
    env: dict[str, str] = Field(default_factory=dict)


class SolutionSettings(_Frozen):
    env: dict[str, str] = Field(default_factory=dict)


class TaskToml(_Frozen):
    """The parts of Harbor's task.toml that this runner honours; other sections are kept, unused."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    agent: AgentSettings = Field(default_factory=AgentSettings)
    verifier: VerifierSettings = Field(default_factory=VerifierSettings)
    environment: EnvironmentSettings = Field(default_factory=EnvironmentSettings)
    solution: SolutionSettings = Field(default_factory=SolutionSettings)


class HarborTask(_Frozen):
    """A task, fingerprinted: any change to its files is a change of identity."""

    name: str = Field(description="The task folder's name.")
    path: str = Field(description="Absolute path of the task folder.")
    instruction: str = Field(description="instruction.md: what the agent is asked to do.")
    config: TaskToml = Field(description="task.toml.")
    environment_sha256: str = Field(description="Content hash of environment/.")
    tests_sha256: str = Field(description="Content hash of tests/.")
    solution_sha256: str | None = Field(description="Content hash of solution/, None without one.")


class PhaseResult(_Frozen):
    """How one phase's command ended."""

    exit_code: int | None
    signal: str | None
    ended_by: str
    seconds: float
    stderr_tail: str

    @classmethod
    def of(cls, r: CommandResult) -> PhaseResult:
        return cls(
            exit_code=r.exit_code, signal=r.signal, ended_by=r.ended_by, seconds=r.seconds, stderr_tail=r.stderr[-2000:]
        )


class TaskTrajectory(_Frozen):
    """One Harbor trial: the agent's run, the verifier's rewards and each phase's time."""

    trial_id: str
    world_id: str = Field(description="The task's name.")
    weights_version: int
    agent: str
    agent_result: PhaseResult | None = Field(description="None for the nop agent.")
    verifier_result: PhaseResult
    rewards: dict[str, float] = Field(description="The verifier's rewards; reward.txt gives {'reward': x}.")
    agent_turns: list[AgentTurn] = Field(default_factory=list, description="The LLM agent's turns, tokens included.")
    timings: dict[str, float] = Field(description="Seconds of setup, agent and verifier.")

    def summary(self) -> dict[str, object]:
        """What a per-trial table shows of it."""
        return {
            "rewards": self.rewards,
            "timings": self.timings,
            "agent": self.agent_result.ended_by if self.agent_result else None,
            "agent_exit": self.agent_result.exit_code if self.agent_result else None,
            "verifier": self.verifier_result.ended_by,
        }


def load_tasks(root: Path) -> list[HarborTask]:
    """Every task under `root` (a task folder, or a folder of them), sorted by name."""
    if not root.is_dir():
        raise TaskError(f"{root}: no such folder of Harbor tasks")
    folders = (
        [root] if (root / "task.toml").exists() else sorted(p for p in root.iterdir() if (p / "task.toml").exists())
    )
    if not folders:
        raise TaskError(f"{root}: no task.toml in it or in its subfolders")
    return [load_task(f) for f in folders]


def load_task(folder: Path) -> HarborTask:
    """One task folder, checked."""
    folder = folder.resolve()
    try:
        config = TaskToml.model_validate(tomllib.loads((folder / "task.toml").read_text()))
    except (tomllib.TOMLDecodeError, ValidationError) as e:
        raise TaskError(f"{folder / 'task.toml'}: {str(e).splitlines()[0]}") from None
    for needed in ("instruction.md", "environment", "tests/test.sh"):
        if not (folder / needed).exists():
            raise TaskError(f"{folder}: missing {needed}")
    solution = folder / "solution"
    return HarborTask(
        name=folder.name,
        path=str(folder),
        instruction=(folder / "instruction.md").read_text(),
        config=config,
        environment_sha256=content_hash(folder / "environment"),
        tests_sha256=content_hash(folder / "tests"),
        solution_sha256=content_hash(solution) if (solution / "solve.sh").exists() else None,
    )


@functools.cache
def tasks_at(path: str) -> tuple[HarborTask, ...]:
    """The tasks under `path`, loaded and fingerprinted once per process."""
    return tuple(load_tasks(Path(path)))


def trial_specs(step: int, tasks: list[HarborTask], n_samples: int) -> list[TrialSpec]:
    """Each task, n_samples times per step; the prompt is its instruction."""
    return [
        TrialSpec(trial_id=f"s{step}-{task.name}-n{s}", step=step, world_id=task.name, prompt=task.instruction)
        for task in tasks
        for s in range(n_samples)
    ]


def _environment_without_dockerfile(task: HarborTask, staging: Path) -> None:
    shutil.copytree(
        Path(task.path) / "environment",
        staging,
        symlinks=True,
        dirs_exist_ok=True,
        ignore=lambda d, names: ["Dockerfile"] if Path(d) == Path(task.path) / "environment" else [],
    )


@unit(name="harbor_build_world", version="1", tier="sandbox", retries=1)
async def build_task_world(task: HarborTask, *, snapshots_dir: Path) -> World:
    """The task's environment/ as a content-addressed snapshot (its Dockerfile, if any, is not built)."""

    def publish() -> tuple[Path, str]:
        import tempfile

        with tempfile.TemporaryDirectory(prefix=f"task-{task.name}-") as tmp:
            _environment_without_dockerfile(task, Path(tmp))
            return publish_snapshot(Path(tmp), snapshots_dir)

    root, content = await asyncio.to_thread(publish)
    return World(world_id=task.name, root=str(root), content_sha256=content)


def _limits(task: HarborTask, wall_s: float) -> Limits:
    env = task.config.environment
    return Limits(
        wall_s=wall_s,
        cpu_s=max(1, math.ceil(wall_s * max(1, env.cpus))),
        memory_mb=env.memory_mb,
        file_size_mb=max(1, env.storage_mb),
        network=env.allow_internet,
    )


@unit(name="harbor_trial", version="2", tier="sandbox", retries=1, timeout_s=None)
async def run_task_trial(
    spec: TrialSpec,
    weights: Weights,
    world: World,
    task: HarborTask,
    agent: str,
    *,
    trials_dir: Path,
    method: str = "auto",
    llm: Endpoint | None = None,
    llm_max_turns: int = 12,
) -> TaskTrajectory:
    """Setup, agent, verifier in one private working copy; raises VerificationFailed without a reward."""
    from ._sandbox._process import run_command

    uid = sandbox_uid()
    t0 = time.perf_counter()
    async with working_copy(Path(world.root), trials_dir, method=method, owner_uid=uid) as ws:
        logs = ws.aux / "logs"
        dirs = {
            "WORKDIR": ws.path,
            "TESTS_DIR": ws.aux / "tests",
            "SOLUTION_DIR": ws.aux / "solution",
            "LOGS_DIR": logs,
        }
        await asyncio.to_thread(_prepare_aux, task, ws.aux, uid, agent == "oracle")
        env = {**task.config.environment.env, **{k: str(v) for k, v in dirs.items()}}
        setup_s = time.perf_counter() - t0

        agent_result: PhaseResult | None = None
        agent_turns: list[AgentTurn] = []
        if agent == "llm":
            if llm is None or weights.policy is None:
                raise TaskError("the llm agent needs an LLM policy and its endpoint")
            wall = task.config.agent.wall_s
            tools = SandboxTools(ws.path, limits=_limits(task, wall), uid=uid)
            t_agent, ended_by = time.perf_counter(), "exit"
            try:
                agent_turns = await asyncio.wait_for(
                    agent_loop(llm, weights.policy, task.instruction, tools, max_turns=llm_max_turns), wall
                )
            except TimeoutError:
                ended_by = "deadline"  # still verified, as Harbor does
            agent_result = PhaseResult(
                exit_code=0 if ended_by == "exit" else None,
                signal=None,
                ended_by=ended_by,
                seconds=round(time.perf_counter() - t_agent, 3),
                stderr_tail="",
            )
        elif agent == "oracle":
            if task.solution_sha256 is None:
                raise TaskError(f"task {task.name} has no solution/solve.sh for the oracle agent")
            wall = task.config.agent.wall_s
            ran = await run_command(
                'bash "$SOLUTION_DIR/solve.sh"',
                cwd=ws.path,
                limits=_limits(task, wall),
                uid=uid,
                env={**env, **task.config.solution.env},
            )
            agent_result = PhaseResult.of(ran)  # a failed or timed-out agent is still verified, as Harbor does

        await asyncio.to_thread(_copy_tests, task, ws.aux, uid)
        verifier = task.config.verifier
        checked = await run_command(
            'bash "$TESTS_DIR/test.sh"',
            cwd=ws.path,
            limits=_limits(task, verifier.timeout_sec),
            uid=uid,
            env={**env, **verifier.env},
        )
        verifier_result = PhaseResult.of(checked)
        if checked.ended_by == "deadline":
            raise VerificationFailed(f"verifier passed its {verifier.timeout_sec:g} s timeout and was killed")
        rewards = await asyncio.to_thread(read_rewards, logs / "verifier")
    return TaskTrajectory(
        trial_id=spec.trial_id,
        world_id=task.name,
        weights_version=weights.version,
        agent=agent,
        agent_result=agent_result,
        verifier_result=verifier_result,
        rewards=rewards,
        agent_turns=agent_turns,
        timings={
            "setup": round(setup_s, 3),
            "agent": agent_result.seconds if agent_result else 0.0,
            "verifier": verifier_result.seconds,
        },
    )


def _chown_tree(root: Path, uid: int | None) -> None:
    if uid is None:
        return
    for path in [root, *root.rglob("*")]:
        shutil.chown(path, uid, uid)


def _prepare_aux(task: HarborTask, aux: Path, uid: int | None, with_solution: bool) -> None:
    (aux / "logs" / "agent").mkdir(parents=True)
    (aux / "logs" / "verifier").mkdir(parents=True)
    if with_solution and task.solution_sha256 is not None:
        shutil.copytree(Path(task.path) / "solution", aux / "solution")
    _chown_tree(aux, uid)


def _copy_tests(task: HarborTask, aux: Path, uid: int | None) -> None:
    shutil.copytree(Path(task.path) / "tests", aux / "tests")  # only now: the agent never saw them
    _chown_tree(aux / "tests", uid)


def read_rewards(verifier_logs: Path) -> dict[str, float]:
    """The verifier's rewards from reward.txt or reward.json; VerificationFailed says what is wrong."""
    txt, js = verifier_logs / "reward.txt", verifier_logs / "reward.json"
    if txt.exists():
        text = txt.read_text().strip()
        if not text:
            raise VerificationFailed("reward.txt is empty")
        try:
            value = float(text)
        except ValueError:
            raise VerificationFailed(f"reward.txt is not a number: {text[:80]!r}") from None
        if not math.isfinite(value):
            raise VerificationFailed(f"reward.txt is not a finite number: {text[:80]!r}")
        return {"reward": value}
    if js.exists():
        try:
            data: Any = json.loads(js.read_text())
        except json.JSONDecodeError as e:
            raise VerificationFailed(f"reward.json is not JSON: {e}") from None
        if not isinstance(data, dict) or not data:
            raise VerificationFailed("reward.json is not a non-empty flat object of numbers")
        bad = [
            k for k, v in data.items() if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
        ]
        if bad:
            raise VerificationFailed(f"reward.json has values that are not numbers: {', '.join(sorted(bad))}")
        return {str(k): float(v) for k, v in data.items()}
    raise VerificationFailed("the verifier wrote neither reward.txt nor reward.json")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def scalar_reward(rewards: dict[str, float]) -> float:
    """The number the trainer learns from: `reward` when present, else the mean of the values."""
    if "reward" in rewards:
        return rewards["reward"]
    return sum(rewards.values()) / len(rewards)


@unit(name="harbor_score", version="1", tier="judge", retries=2)
async def score_task(traj: TaskTrajectory) -> Reward:
    """A Harbor trial's reward is its verifier's: no judge call is made for it."""
    reward = round(scalar_reward(traj.rewards), 6)
    return Reward(
        trial_id=traj.trial_id,
        world_id=traj.world_id,
        verified_correct=reward > 0,
        n_turns=1 if traj.agent_result is not None else 0,
        judge_score=0.0,
        reward=reward,
        found_doc=None,
        rewards=traj.rewards,
    )
