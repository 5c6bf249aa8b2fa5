"""`jaxgen serve`: an OpenAI-compatible HTTP server over the engine (`create_app`, `run`)."""

from jaxgen.serve.app import EMBEDDED_NAME, create_app, run
from jaxgen.serve.protocol import TOOL_CALL_PARSERS

__all__ = ["EMBEDDED_NAME", "TOOL_CALL_PARSERS", "create_app", "run"]
