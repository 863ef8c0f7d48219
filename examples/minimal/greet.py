"""The smallest durable-rl environment: write a greeting into answer.txt, graded by a verifier."""

import random
from pathlib import Path

import durable_rl as drl

NAMES = ["ada", "grace", "alan", "barbara"]


class Greet(drl.Environment):
    kind = "greet"
    default_agent = "greet:Guesser"  # built-in judges and trainers need nothing more
    default_judge = "none"  # reward = the verifier's score
    default_trainer = "version"  # an external trainer would publish each version

    def world_ids(self) -> list[str]:
        return NAMES

    def write_world(self, world_id: str, dest: Path) -> None:
        (dest / "name.txt").write_text(world_id)

    def prompts(self, step: int) -> list[drl.Prompt]:
        return [drl.Prompt(prompt_id=n, world_id=n, text="Greet the person in name.txt") for n in NAMES]

    async def verify(self, spec: drl.TrialSpec, traj: drl.Trajectory, sandbox: drl.Sandbox) -> drl.Verdict:
        answer = drl.read_untrusted(sandbox.path / "answer.txt", 100)  # a trial's file: read it safely
        passed = answer == f"hello {spec.world_id}"
        return drl.Verdict(score=float(passed), passed=passed, details={"answer": answer})


class Guesser(drl.Agent):
    kind = "guesser"

    async def run(self, spec: drl.TrialSpec, weights: drl.Weights, sandbox: drl.Sandbox, ctx: drl.TrialContext):
        name = await sandbox.tools.read_file("name.txt")
        greeting = random.Random(spec.trial_id).choice(["hello", "hi"])  # same trial, same choice
        await sandbox.tools.write_file("answer.txt", f"{greeting} {name}")
        call = drl.ToolCall(name="read_file", arguments={"path": "name.txt"}, result=name)
        return drl.Trajectory(
            trial_id=spec.trial_id,
            world_id=spec.world_id,
            weights_version=weights.version,
            turns=[drl.AgentTurn(content=f"{greeting} {name}", tool_calls=[call])],
        )
