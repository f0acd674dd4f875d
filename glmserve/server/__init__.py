"""OpenAI-compatible HTTP server over the glmserve engine (`glmserve serve`)."""

from glmserve.server.app import create_app
from glmserve.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
