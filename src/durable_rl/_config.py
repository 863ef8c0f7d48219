"""A training run's settings: one frozen model, validated before anything is written."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ._models import Rubric, _Frozen
from ._secret_hunt import SIMULATED_JUDGE_MODEL

RUBRICS: dict[str, Rubric] = {
    "v1": Rubric(correctness_weight=1.0, efficiency_weight=0.3, tidiness_weight=0.1, name="v1"),
    "v2-efficiency": Rubric(correctness_weight=1.0, efficiency_weight=1.0, tidiness_weight=0.5, name="v2-efficiency"),
}


class RunConfig(_Frozen):
    """Everything a run needs; the record a resumed or re-scoring run reads back."""

    n_steps: int = Field(3, ge=1, description="Training steps to run.")
    n_worlds: int = Field(3, ge=1, description="Worlds to build; prompt p uses world p mod n_worlds.")
    prompts_per_step: int = Field(3, ge=1, description="Prompts per step.")
    n_samples: int = Field(2, ge=1, description="Trials (samples) per prompt.")
    lr: float = Field(2.0, description="Learning rate of the bandit update.")
    rubric: str = Field("v1", description="Judge rubric: v1 or v2-efficiency.")
    flaky_trial_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of trials whose first sandbox attempt is made to fail."
    )
    judge_flake_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of judge tasks made to fail on their first attempt, after the judge answered.",
    )
    turn_latency: float = Field(0.2, ge=0.0, description="Simulated seconds of one agent tool call.")
    judge_latency: float = Field(0.5, ge=0.0, description="Simulated seconds of one judge call.")
    hang_trials: list[str] = Field(
        default_factory=list,
        description="Trial ids whose tool calls never return, to exercise the trial timeout.",
    )
    trial_timeout: float = Field(300.0, gt=0.0, description="Seconds one trial attempt may run before it is cancelled.")
    workspace: Literal["auto", "overlay", "reflink", "copy"] = Field(
        "auto", description="How a trial gets its private working copy: auto, overlay, reflink or copy."
    )
    sandbox_slots: int = Field(16, ge=1, description="Trials that may run at once.")
    judge_concurrency: int = Field(16, ge=1, description="Judge calls that may run at once.")
    policy: Literal["bandit", "llm"] = Field(
        "bandit", description="Policy: bandit (the spec's) or llm (a tool-calling model)."
    )
    policy_model: str = Field("policy", description="Base model of the LLM policy.")
    policy_adapter: str | None = Field(None, description="LoRA adapter of the LLM policy; versioned per step.")
    policy_base_url: str = Field(
        "http://127.0.0.1:8000/v1", description="Base URL of the LLM policy's OpenAI-compatible API."
    )
    policy_api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the policy's API key.")
    policy_max_turns: int = Field(12, ge=1, description="Model responses an LLM policy may take per trial.")
    judge: Literal["simulated", "llm"] = Field(
        "simulated", description="Judge: simulated (the spec's) or llm (an OpenAI-compatible endpoint)."
    )
    judge_model: str = Field("judge", description="Model the LLM judge asks (part of every judgment's identity).")
    judge_base_url: str = Field(
        "http://127.0.0.1:8000/v1", description="Base URL of the LLM judge's OpenAI-compatible API."
    )
    judge_api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the judge's API key.")
    judge_rpm: int = Field(600, ge=1, description="Judge requests per minute, per driver process.")
    judge_timeout: float = Field(60.0, gt=0, description="Seconds one judge request may take.")
    judge_deadline: float = Field(
        600.0, gt=0, description="Seconds a judgment keeps retrying through an outage before it fails."
    )
    prices: dict[str, tuple[float, float]] = Field(
        default_factory=dict, description="Per model: USD per million prompt and completion tokens."
    )
    crash_driver_at_step: int = Field(
        -1, description="Kill the driver process hard right after this step, on its first attempt."
    )
    tasks: str | None = Field(
        None, description="Folder of Harbor tasks to train on instead of secret-hunt (absolute path)."
    )
    agent: Literal["oracle", "nop", "llm"] = Field(
        "oracle", description="Agent for Harbor tasks: oracle (runs the solution), nop, or llm (the LLM policy)."
    )
    driver_retries: int = Field(2, ge=0, description="Times the supervisor restarts a dead driver.")
    source_run: str | None = Field(None, description="The run this one re-scores, if any.")

    @field_validator("rubric")
    @classmethod
    def _known_rubric(cls, name: str) -> str:
        if name not in RUBRICS:
            raise ValueError(f"unknown rubric {name!r}; known: {', '.join(RUBRICS)}")
        return name

    @property
    def uses_llm_policy(self) -> bool:
        """Whether trials are played by the LLM policy (on secret-hunt worlds or as a Harbor agent)."""
        return self.policy == "llm" or (self.tasks is not None and self.agent == "llm")

    @property
    def judge_model_name(self) -> str:
        """The model that judges this run: part of every judgment's identity."""
        return self.judge_model if self.judge == "llm" else SIMULATED_JUDGE_MODEL

    @property
    def rubric_model(self) -> Rubric:
        """The rubric this run judges with."""
        return RUBRICS[self.rubric]

    @property
    def world_ids(self) -> list[str]:
        """World ids of the run, in order."""
        return [f"w{i}" for i in range(self.n_worlds)]
