"""The messages the event loop sends the engine thread, and how the thread applies them.

Each is a small frozen record with the Future its sender waits on (None: nobody
waits). The thread applies them between steps, in the order they were sent.

    AddRequest(request)      -> LLMEngine.add_request; refusal: RequestValidationError
    AbortRequest(request_id) -> LLMEngine.abort_request; its "abort" deltas go out
    CallBetweenSteps(fn)     -> fn(engine), for a consistent read (cache stats, integrity)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from chatsvc.engine.engine import LLMEngine, StepOutput
from chatsvc.protocol import GenerationRequest, RequestValidationError


@dataclass(frozen=True)
class AddRequest:
    """Queue a request; ``done`` gets None, or the refusal."""

    request: GenerationRequest
    done: Future | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request and free its blocks; ``done`` gets None once that happened."""

    request_id: str
    done: Future | None = None


@dataclass(frozen=True)
class CallBetweenSteps:
    """Run ``fn(engine)`` on the engine thread; ``done`` gets its result or its error."""

    fn: Callable[[LLMEngine], Any]
    done: Future | None = None


Command = AddRequest | AbortRequest | CallBetweenSteps


def apply_command(engine: LLMEngine, command: Command) -> tuple[Any, list[StepOutput]]:
    """Carry out one command: ``(what its sender gets, deltas to deliver)``."""
    if isinstance(command, AddRequest):
        engine.add_request(command.request)
        return None, []
    if isinstance(command, AbortRequest):
        return None, engine.abort_request(command.request_id)
    return command.fn(engine), []


def error_is_callers(command: Command, error: Exception) -> bool:
    """Whether ``error`` goes back to the sender with the engine's state intact.

    A refused request changed nothing, and a between-steps function's error is the
    function's own (it only reads). Any other error leaves the engine's state in
    doubt: the thread dies with it.
    """
    return isinstance(error, RequestValidationError) or isinstance(command, CallBetweenSteps)
