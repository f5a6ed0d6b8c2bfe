from pathlib import Path

import pytest

from halfmoon.sim.profile import Profile, load_profile
from halfmoon.sim.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"


@pytest.fixture(scope="session")
def conversation() -> list[TraceRequest]:
    """The real FAST'25 conversation trace; its absence is an error, not a skip."""
    if not TRACE.is_file():
        raise FileNotFoundError(f"the conversation trace must exist at {TRACE} (the kit beside the clone)")
    return load_trace(TRACE)


@pytest.fixture(scope="session")
def profile() -> Profile:
    return load_profile()
