"""The typed records that flow between the units, the loop and the engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PolicyRef(_Frozen):
    """The policy's weights, by reference."""

    model: str = Field(description="Base model served by the endpoint.")
    adapter: str | None = Field(None, description="LoRA adapter name, if the policy is an adapter.")
    version: int = Field(0, description="Adapter version: each training step makes a new one.")

    @property
    def served_name(self) -> str:
        """The model name a request asks for."""
        return f"{self.adapter}-v{self.version}" if self.adapter else self.model


class ToolCall(_Frozen):
    """One tool call of a turn and what it returned."""

    name: str
    arguments: dict[str, Any]
    result: str
    error: bool = False


class AgentTurn(_Frozen):
    """One model response: its text, its tool calls, and its tokens when the server gave them."""

    content: str | None
    tool_calls: list[ToolCall]
    logprobs: list[float] | None = None
    token_ids: list[int] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Weights(_Frozen):
    """The whole policy: small enough to travel as an input to every rollout."""

    version: int = Field(0, description="Training steps applied to these weights.")
    doc_prior: dict[str, list[float]] = Field(
        default_factory=dict,
        description="Per world id: the bandit's prior over which document holds the secret.",
    )
    policy: PolicyRef | None = Field(None, description="An LLM policy's weights, by reference; None for the bandit.")


class TrialSpec(_Frozen):
    """What one trial is asked to do."""

    trial_id: str = Field(description="Unique within a run: s{step}-p{prompt}-n{sample}.")
    step: int = Field(description="The training step the trial belongs to.")
    world_id: str = Field(description="The world the trial explores a private copy of.")
    prompt: str = Field(description="The task given to the policy.")
    max_turns: int = Field(6, description="Turns (tool calls) allowed before the agent gives up.")


class World(_Frozen):
    """A built world: an immutable folder every trial copies privately."""

    world_id: str = Field(description="The world's id, w0, w1, ...")
    root: str = Field(description="Absolute path of the world's read-only snapshot folder.")
    content_sha256: str = Field(description="Hash of the snapshot's files, for identity.")


class Turn(_Frozen):
    """One tool call of the agent: which document it read and whether the secret was there."""

    doc: int = Field(description="Index of the document read.")
    found: bool = Field(description="True when the document held the secret's digest.")


class Trajectory(_Frozen):
    """What happened in one trial."""

    trial_id: str = Field(description="The trial's id.")
    world_id: str = Field(description="The world the trial ran in.")
    weights_version: int = Field(description="Version of the weights the policy acted with.")
    turns: list[Turn] = Field(description="The agent's turns, in order.")
    answer: str | None = Field(description="The digest the agent reported, None if it found none.")
    files_written: list[str] = Field(description="Files the agent left in its working copy.")
    agent_turns: list[AgentTurn] = Field(default_factory=list, description="An LLM policy's turns, tokens included.")

    def summary(self) -> dict[str, object]:
        """What a per-trial table shows of it."""
        return {"turns": len(self.turns), "answered": self.answer is not None}


class Rubric(_Frozen):
    """Judge configuration: an input, so changing it re-runs only judging and training."""

    correctness_weight: float = Field(1.0, description="Weight of a verified answer.")
    efficiency_weight: float = Field(0.3, description="Weight of finding it in few turns.")
    tidiness_weight: float = Field(0.1, description="Weight of leaving only answer.txt behind.")
    name: str = Field("v1", description="The rubric's name; part of the judge's seed.")


class JudgeAnswer(_Frozen):
    """What the judge returned for one (trajectory, rubric): the billed part of judging."""

    score: float = Field(description="The judge's score of the trajectory against the rubric.")
    model: str = Field(description="The judge model that answered.")
    scores: dict[str, float] = Field(default_factory=dict, description="Per-criterion scores of an LLM judge.")
    raw: str = Field("", description="The last response body, as the endpoint sent it.")
    requests: int = Field(0, description="HTTP requests it took (retries and re-asks included).")
    prompt_tokens: int = Field(0, description="Prompt tokens billed, over all its requests.")
    completion_tokens: int = Field(0, description="Completion tokens billed, over all its requests.")
    latency_s: float = Field(0.0, description="Seconds from the first request to the answer.")
    cost_usd: float = Field(0.0, description="What its tokens cost at the configured price.")


class Reward(_Frozen):
    """The scored outcome of one trial."""

    trial_id: str = Field(description="The trial's id.")
    world_id: str = Field(description="The world the trial ran in.")
    verified_correct: bool = Field(description="The deterministic verifier's verdict.")
    n_turns: int = Field(description="Turns the agent took.")
    judge_score: float = Field(description="The judge's score.")
    reward: float = Field(description="Verifier plus judge: what the trainer learns from.")
    found_doc: int | None = Field(description="Document where the secret was found, if any.")
    rewards: dict[str, float] = Field(
        default_factory=dict, description="Named rewards of a verifier that reports several (reward.json)."
    )


class StepResult(_Frozen):
    """One training step's output: the new weights are the checkpoint."""

    step: int = Field(description="The step index.")
    weights: Weights = Field(description="Weights after the update: the next step's input.")
    mean_reward: float = Field(description="Mean reward of the step's trials (3 decimals).")
    mean_turns: float = Field(description="Mean turns of the step's trials (2 decimals).")
    n_trials: int = Field(description="Trials that produced a reward.")
