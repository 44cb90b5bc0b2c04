"""Which configuration to train: the best of a study, of a finished study of the same model and
budget, or of a search run for the purpose; and what it trains (its task) and how its run evaluates,
which flags given to `train` may repeat but not contradict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.vocabulary.errors import BadInput, BudgetError, ModelNotFound, StudyNotFound
from autotune.levers.evaluation import AUTO, EVAL_RECIPE, LOSS_ONLY, eval_problems, recipe_fields
from autotune.levers.recipes import DEFAULT_TRAINER, trainer_caveat
from autotune.vocabulary.status import StopReason, StudyStatus
from autotune.levers.tasks import Task, resolve_task, stored_fixed_recipe
from autotune.vocabulary.units import format_size

if TYPE_CHECKING:
    from autotune.levers.config import ProbeConfig
    from autotune.specs.models import ModelSpec
    from autotune.store import LeaderboardRow, Store, StudyRecord


@dataclass(frozen=True, slots=True)
class Winner:
    """A study and its best configuration that fits."""

    study: StudyRecord
    row: LeaderboardRow


def study_winner(store: Store, name: str | None) -> Winner:
    """The best of study `name` (the latest study when None); StudyNotFound when nothing fits."""
    study = store.study(name)
    rows = store.leaderboard(study.name, top=1)
    if not rows:
        raise StudyNotFound(
            f"study {study.name!r} has no configuration that fits its {format_size(study.budget_bytes)} "
            f"budget; search again with a larger --gpu-budget (or pass --model and --gpu-budget to train "
            f"searches first)."
        )
    return Winner(study, rows[0])


@dataclass(frozen=True, slots=True)
class FixedRecipe:
    """What a study trains (autotune.levers.tasks) and how its run evaluates (autotune.levers.evaluation): fixed for
    the study, so a flag may not contradict it."""

    task: str
    target_length: int | None = None
    num_labels: int | None = None
    peft: str | None = None
    # autotune.levers.evaluation.EVAL_RECIPE's fields, as the study's probes measured them.
    evaluation: dict[str, Any] = field(default_factory=lambda: dict(EVAL_RECIPE))
    trainer: str = DEFAULT_TRAINER  # whose step the probes timed: `train` runs transformers' Trainer

    @classmethod
    def of_config(cls, config: ProbeConfig) -> FixedRecipe:
        return cls(
            config.task,
            config.target_length,
            config.num_labels,
            config.peft,
            {name: getattr(config, name) for name in EVAL_RECIPE},
            config.trainer,
        )

    @classmethod
    def of_study(cls, study: StudyRecord) -> FixedRecipe:
        # A study stored before tasks existed (or a causal-LM one) has no task in its space; one
        # without evaluation has none of its fields.
        fields = stored_fixed_recipe(study.space or {})
        return cls(
            **{name: fields[name] for name in _TASK_FIELDS},
            evaluation={name: fields.get(name, default) for name, default in EVAL_RECIPE.items()},
            trainer=fields["trainer"],
        )

    def search_fields(self) -> dict[str, Any]:
        """The recipe as `search_for_winner` takes it: the task's fields and `peft` where set, and
        `evaluation` (the command line's form, evaluation.recipe_fields) where the run evaluates."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in _TASK_FIELDS if getattr(self, name) is not None}
        asked = evaluation_flags(self.evaluation)
        if asked is not None:
            fields["evaluation"] = asked
        return fields

    def check(
        self,
        study: str,
        *,
        task: str | None = None,
        target_length: int | None = None,
        num_labels: int | None = None,
        peft: str | None = None,
        evaluation: dict[str, Any] | None = None,
    ) -> None:
        """BadInput for a flag that contradicts what study `study` measured. `peft` is the --peft
        flags' stored text (autotune.levers.recipes.peft_text): the adapters are part of what is trained.
        `evaluation`: the evaluation flags as given (autotune.flags.arguments.evaluation_asked); those left out
        take the study's. `train` runs transformers' Trainer: a study that timed another trainer's
        step measured neither its memory nor its speed."""
        if (caveat := trainer_caveat(self.trainer, DEFAULT_TRAINER, "autotune train")) is not None:
            raise BadInput(f"study {study!r}: {caveat}.")
        if task is not None and resolve_task({}, task, study) != self.task:
            raise BadInput(
                f"--task {task} contradicts study {study!r}, which measured {self.task}; leave --task out to "
                f"train {self.task}, or search for {task.strip().lower()} under a new --study name."
            )
        for flag, given, measured, owner in (
            ("--target-length", target_length, self.target_length, Task.SEQ2SEQ),
            ("--num-labels", num_labels, self.num_labels, Task.CLASSIFICATION),
        ):
            if given is None or given == measured:
                continue
            if measured is None:
                raise BadInput(f"{flag} is for --task {owner}; study {study!r} trains {self.task}: leave it out.")
            raise BadInput(
                f"{flag} {given} contradicts study {study!r}, which measured {measured}; leave it out, or "
                f"search again under a new --study name."
            )
        if peft is not None and peft != self.peft:
            trained = self.peft if self.peft is not None else "full fine-tuning (no --peft)"
            raise BadInput(
                f"--peft {peft} contradicts study {study!r}, which measured {trained}; leave --peft and "
                f"the --lora-* flags out to train what it measured, or search again under a new --study name."
            )
        self._check_evaluation(study, evaluation)

    def _check_evaluation(self, study: str, asked: dict[str, Any] | None) -> None:
        """BadInput for an evaluation flag given that is not what the study's probes measured (their
        memory holds only for the evaluation they ran); a flag left out takes the study's value."""
        given = {name: value for name, value in (asked or {}).items() if value is not None and value is not False}
        if not given:
            return
        recipe_fields(given, self.target_length)  # the flags' own mistakes first, said as search says them
        measured = self.evaluation
        if measured.get("eval_batch") is None:
            flag = _EVAL_FLAGS[next(iter(given))]
            raise BadInput(
                f"{flag} contradicts study {study!r}, whose probes measured no evaluation; leave the "
                f"evaluation flags out (the run then evaluates unmeasured, at its micro-batch), or search "
                f"again with them under a new --study name."
            )
        studied = evaluation_flags(measured) or {}
        for name, value in given.items():
            if name == "eval_logits":
                value = str(value).lower()
            elif name == "eval_batch" and str(value).lower() == AUTO:
                value = AUTO
            had = studied.get(name, False if name == "generate" else None)
            if name == "num_beams" and had is None:
                had = 1
            if value == had:
                continue
            said = "" if value is True else f" {value}"
            if name == "generate":
                what = "generation" if had else "no generation"
            else:
                what = f"{_EVAL_FLAGS[name]} {had}" if had is not None else f"no {_EVAL_FLAGS[name]}"
            raise BadInput(
                f"{_EVAL_FLAGS[name]}{said} contradicts study {study!r}, which measured {what}; leave it "
                f"out to evaluate as the study measured, or search again under a new --study name."
            )


# FixedRecipe's fields of what is trained (the rest of autotune.levers.tasks.FIXED_RECIPE is the evaluation's).
_TASK_FIELDS = ("task", "target_length", "num_labels", "peft")
# The evaluation flags (autotune.flags.arguments.evaluation_asked's keys), as the command line spells them.
_EVAL_FLAGS = {
    "eval_batch": "--eval-batch",
    "eval_logits": "--eval-logits",
    "eval_accumulation_steps": "--eval-accumulation-steps",
    "generate": "--generate",
    "generation_max_length": "--generation-max-length",
    "num_beams": "--num-beams",
}


def asks_evaluation(asked: dict[str, Any] | None) -> bool:
    """Whether any evaluation flag was given (autotune.flags.arguments.evaluation_asked's form)."""
    return any(value is not None and value is not False for value in (asked or {}).values())


def evaluation_flags(fields: dict[str, Any]) -> dict[str, Any] | None:
    """EVAL_RECIPE's fields as the flags that ask for them (evaluation.recipe_fields reads them back
    to the same fields); None for a recipe without evaluation."""
    if fields.get("eval_batch") is None:
        return None
    asked: dict[str, Any] = {
        "eval_batch": AUTO if fields.get("auto_eval_batch") else fields["eval_batch"],
        "eval_logits": fields.get("eval_logits", LOSS_ONLY),
        "eval_accumulation_steps": fields.get("eval_accumulation_steps"),
    }
    if fields.get("generation_max_length") is not None:
        asked.update(
            generate=True,
            generation_max_length=fields["generation_max_length"],
            num_beams=fields.get("generation_num_beams", 1),
        )
    return asked


def planned_fixed_recipe(
    spec: ModelSpec, name: str, existing: StudyRecord | None, flags: dict[str, Any]
) -> tuple[FixedRecipe, dict[str, Any]]:
    """What a run of `spec` under study `name` trains, and the recipe fields (the task's, `peft` and
    `evaluation`) to ask its search for. An `existing` study (finished, or to be resumed) decides:
    `flags` may repeat it, not contradict it, and a resumed search keeps its space. Else the flags
    given, checked, with the task's defaults."""
    if existing is not None:
        recipe = FixedRecipe.of_study(existing)
        recipe.check(name, **flags)
        return recipe, recipe.search_fields()
    task_flags = {field: value for field, value in flags.items() if field not in ("peft", "evaluation")}
    task = spec.task_fields(**task_flags)
    # The adapters and the evaluation are the user's choice alone (no default from the model): as given, or none.
    asked = flags.get("evaluation") if asks_evaluation(flags.get("evaluation")) else None
    fields = recipe_fields(asked, task.get("target_length"))
    problems = eval_problems(fields, task["task"])
    if problems:
        raise BadInput("; ".join(problems) + ".")
    recipe = FixedRecipe(**task, peft=flags.get("peft"), evaluation=fields)
    search = {field: value for field, value in flags.items() if value is not None and field != "evaluation"}
    if asked is not None:
        search["evaluation"] = asked
    return recipe, search


def matching_study(store: Store, name: str, spec: ModelSpec, budget: int) -> StudyRecord | None:
    """Study `name` when it measured this model under this budget (finished or not), else None."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.model_fingerprint == spec.fingerprint and study.budget_bytes == budget else None


def settled_winner(store: Store, name: str, spec: ModelSpec, budget: int) -> Winner | None:
    """The winner of a finished study of this model and budget, or None (the search must run)."""
    study = matching_study(store, name, spec, budget)
    if study is None or study.status != StudyStatus.FINISHED:
        return None
    rows = store.leaderboard(name, top=1)
    return Winner(study, rows[0]) if rows else None


def study_model(winner: Winner, model: str | None) -> ModelSpec:
    """The model the study measured: `model` when given (it must be the same architecture), else
    the study's own reference."""
    from autotune.specs.models import resolve_model

    study = winner.study
    if model is None:
        try:
            return resolve_model(study.model_reference)
        except ModelNotFound:
            raise ModelNotFound(
                f"study {study.name!r} measured model {study.model_reference!r}, which cannot be "
                f"found from here; pass --model with its directory or hub id."
            ) from None
    spec = resolve_model(model)
    if spec.fingerprint != study.model_fingerprint:
        raise BadInput(
            f"--model {model} is not the architecture study {study.name!r} measured "
            f"({study.model_reference}); pass that model, or search for this one."
        )
    return spec


def search_for_winner(
    spec: ModelSpec,
    budget: int,
    name: str,
    device: str | None,
    db: str | None,
    echo: Callable[[str], None],
    on_start: Callable | None,
    on_event: Callable | None,
    **recipe: Any,
) -> Winner:
    """Run `autotune search` with its defaults for this device and the recipe fields in `recipe`
    (task, target_length, num_labels, peft, evaluation); the winner, or BudgetError."""
    # Looked up at call time, not import time: tests narrow the search by replacing autotune.search.search.
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, search

    echo(f"no finished study {name!r} for {spec.reference} under {format_size(budget)}: searching first")
    outcome = search(
        spec.reference,
        budget,
        settings=ProbeSettings(device=device or "auto"),
        options=SearchOptions(study=name),
        db=db,
        on_start=on_start,
        on_event=on_event,
        **recipe,
    )
    if outcome.stop_reason == StopReason.INTERRUPTED:
        raise KeyboardInterrupt
    if outcome.best is None:
        raise BudgetError(
            f"no configuration of {spec.reference} fits {format_size(budget)} (study {name}); "
            f"give a larger --gpu-budget."
        )
    return Winner(outcome.study, outcome.best)
