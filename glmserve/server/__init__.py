"""OpenAI-compatible HTTP server over the glmserve engine (`glmserve serve`).

Entry points: `glmserve.server.app.create_app` (the FastAPI app) and
`glmserve.server.launch.run_server` (uvicorn with graceful shutdown). This package file stays
light so that `glmserve.server.config` imports without FastAPI.
"""
