"""`jaxgen serve`: an OpenAI-compatible HTTP server over the engine (`create_app`, `run`)."""

from jaxgen.serve.app import EMBEDDED_NAME, create_app, run

__all__ = ["EMBEDDED_NAME", "create_app", "run"]
