"""Server start imports only what serving needs (bench/RESULTS.md "Startup and memory"): parsing `glmserve serve`'s
command line imports neither the web stack (fastapi, pydantic) nor the other subcommands' packages, so that torch is
the first heavy import and the model's load starts as early as it can; the compression package loads on the first
/v1/compress, and building the embedded GGUF model never imports torch._dynamo (nn.Embedding's
normal_ init on meta and transformers' LlamaConfig both did: 2-4 s of CPU per start), sympy (`empty_like` of meta
tensors in `to_empty`) or transformers (~2.5 s: the GGUF's tokenizer is built on `tokenizers`)."""

from __future__ import annotations

import json
import subprocess
import sys

WATCHED = ("glmserve.compress", "jieba", "torch._dynamo", "sympy", "transformers")
COMMAND_LINE_WATCHED = ("fastapi", "pydantic", "starlette", "numpy", "torch", "glmserve.compress", "glmserve.data")

SERVE_COMMAND_LINE = """
import glmserve.cli as cli
args = cli.build_parser(cli._command(["serve", "--port", "9"])).parse_args(["serve", "--port", "9"])
assert args.handler is cli.cmd_serve and args.port == 9
"""

SERVER_APP = "import glmserve.server.app"
MODEL_ON_META = """
import torch
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf
from glmserve.models.loader import _materialize
from glmserve.models.registry import model_class
checkpoint = load_gguf(embedded_default_gguf())
config = checkpoint.model_config()
with torch.device("meta"):
    model = model_class(config)(config, 64)
assert model.embed_tokens.weight.is_meta
_materialize(model, torch.device("cpu"))
assert model.embed_tokens.weight.device.type == "cpu" and model.embed_tokens.weight.dtype == torch.float32
tokenizer = checkpoint.serving_tokenizer()
assert type(tokenizer).__name__ == "ByteLevelTokenizer"
assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
"""


def _imported_after(code: str, watched: tuple[str, ...] = WATCHED) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_parsing_the_serve_command_line_imports_no_web_stack_torch_or_other_subcommands():
    assert _imported_after(SERVE_COMMAND_LINE, COMMAND_LINE_WATCHED) == []


def test_a_command_line_builds_the_package_subcommands_it_names_or_all_of_them():
    from glmserve import cli

    assert cli._command(["rag", "query"]) == "rag" and cli._command(["--help"]) is None
    subcommands = next(a for a in cli.build_parser("serve")._actions if a.dest == "command").choices
    assert "serve" in subcommands and not set(cli.PACKAGE_COMMANDS) & set(subcommands)
    for command in ("rag", None, "no-such-command"):
        names = next(a for a in cli.build_parser(command)._actions if a.dest == "command").choices
        assert (set(cli.PACKAGE_COMMANDS) <= set(names)) is (command != "rag") and ("rag" in names)


def test_server_app_imports_no_compression_package():
    assert _imported_after(SERVER_APP) == []


def test_embedded_model_and_tokenizer_build_without_dynamo_sympy_or_transformers():
    assert _imported_after(MODEL_ON_META) == []


def test_the_warm_up_runs_on_one_thread_and_restores_the_count(tiny_model_dir):
    """The server's warm-up generation too: a few tokens gain nothing from more threads, and on a shared machine
    their OpenMP barriers stall (bench/RESULTS.md "Startup on the Xeon without AMX")."""
    import torch

    from glmserve.config import EngineConfig
    from glmserve.engine.async_engine import AsyncEngine
    from glmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=64))
    seen: list[int] = []
    step = engine.step
    engine.step = lambda: seen.append(torch.get_num_threads()) or step()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        AsyncEngine(EngineConfig())._warm_up(engine)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
        engine.close()


def test_the_load_runs_on_one_thread_and_restores_the_count(tiny_model_dir, monkeypatch):
    """The load's small ops on one thread (OpenMP barriers stall on a shared machine), the caller's count after."""
    import torch

    from glmserve.models import loader

    seen: list[int] = []
    real_build = loader._build
    monkeypatch.setattr(loader, "_build", lambda *a, **k: seen.append(torch.get_num_threads()) or real_build(*a, **k))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loader.load_model(str(tiny_model_dir("llama")), None, torch.device("cpu"), torch.float32)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
