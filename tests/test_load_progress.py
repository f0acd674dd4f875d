"""The load's progress bar (glmserve/models/loader.py `with_progress`): shown on a terminal only, the tensors passed
through unchanged, and its total the number of tensors each checkpoint format's stream yields."""

from __future__ import annotations

import io

import pytest
import torch

from glmserve.models import loader


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stream() -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((2,), float(i))) for i in range(3)]


def test_a_terminal_sees_the_bar_and_the_tensors_pass_through_unchanged() -> None:
    shown = _Terminal()
    items = _stream()
    assert list(loader.with_progress(iter(items), lambda: 3, "tiny", file=shown)) == items
    assert "loading tiny" in shown.getvalue() and "0/3" in shown.getvalue()  # (refreshed at most every 0.1 s)


def test_logs_and_pipes_get_no_bar() -> None:
    quiet = io.StringIO()
    assert len(list(loader.with_progress(iter(_stream()), lambda: 3, "tiny", file=quiet))) == 3
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("checkpoint", ["gguf", "safetensors"])
def test_the_total_is_what_the_stream_yields(checkpoint: str, tiny_model_dir, monkeypatch) -> None:
    seen: list[tuple[int | None, int]] = []
    real = loader.with_progress

    def counted(weights, total, name, file=None):
        count = 0
        for item in real(weights, total, name, file):
            count += 1
            yield item
        seen.append((total(), count))

    monkeypatch.setattr(loader, "with_progress", counted)
    path = None if checkpoint == "gguf" else str(tiny_model_dir("llama"))  # None: the embedded GGUF
    loader.load_model(path, None, torch.device("cpu"), torch.float32)
    assert len(seen) == 1 and seen[0][0] == seen[0][1] > 0
