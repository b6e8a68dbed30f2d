"""Watch what the live server hands its engine: every request and the deltas it got back.

This observes the real engine (the wrapper forwards everything unchanged); tests use
it to read prompt token ids, which no endpoint returns.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field


@dataclass
class Recorded:
    request: object  # chatsvc.protocol.GenerationRequest
    deltas: list = field(default_factory=list)  # chatsvc.protocol.GenerationDelta

    @property
    def output_token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


def record_engine(monkeypatch, engine) -> list[Recorded]:
    """Record every ``engine.generate`` call from now until the test ends."""
    calls: list[Recorded] = []
    original = engine.generate

    async def generate(request):
        call = Recorded(request)
        calls.append(call)
        async with aclosing(original(request)) as deltas:
            async for delta in deltas:
                call.deltas.append(delta)
                yield delta

    monkeypatch.setattr(engine, "generate", generate)
    return calls
