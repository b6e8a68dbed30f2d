"""What the schema-driven fuzz suites share: strategies per operation, and a hypothesis runner.

``operation_strategies`` yields, for every operation of the service's OpenAPI
document, valid-by-schema (positive) and invalid-by-schema (negative) request
strategies; the session paths are also aimed at a live session, so that
generation, locking and storing run and not just the 404 path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode


def operation_strategies(
    schema, session_id: str, model: str, conversation_id: str | None = None
) -> Iterator[tuple[str, object, object]]:
    """(label, operation, strategy) for every operation and mode, plus the session
    operations aimed at ``session_id``, the conversation operations aimed at
    ``conversation_id`` (a session made by the Conversations API) and the requests
    that name a model naming the served one."""
    live = {"session_id": session_id, "conversation_id": conversation_id}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)
            yield f"{operation.label} {mode.value}", operation, strategy
            # Deleting the live session would turn every later aimed request into a 404.
            for name, value in live.items():
                if value is None or "{" + name + "}" not in operation.path:
                    continue
                if operation.method.upper() == "DELETE":
                    continue
                aimed = operation.as_strategy(generation_mode=mode, path_parameters={name: value})
                label = f"{operation.label} {mode.value} live-{name.removesuffix('_id')}"
                yield label, operation, aimed
            if operation.path in _NAMES_A_MODEL and mode is GenerationMode.POSITIVE:
                yield (
                    f"{operation.label} served-model",
                    operation,
                    strategy.map(lambda case: _with_model(case, model)),
                )


# Operations whose body names the model: a random name only reaches their 404.
_NAMES_A_MODEL = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"}
)


def _with_model(case, model: str):
    # A random model name only reaches the 404 branch; naming the served model
    # lets valid bodies through to generation.
    if isinstance(case.body, dict):
        case.body = {**case.body, "model": model}
    return case


def run_examples(strategy, call: Callable[[object], None], examples: int) -> None:
    """Send ``examples`` cases of ``strategy`` through ``call``; hypothesis shrinks a failure."""

    @given(case=strategy)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    def fuzz(case) -> None:
        call(case)

    fuzz()
