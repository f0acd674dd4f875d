"""Export the embedded SmolLM2 GGUF to a bf16 Hugging Face folder for the transformers and vLLM peers.

Run with the bench `transformers` venv (see setup_peers.sh):

    python bench/export_hf.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR

transformers dequantizes the GGUF on load but marks the model as GGUF-quantized, which
`save_pretrained` refuses; so the dequantized weights are copied (strictly) into a plain model
built from the same config, and that one is saved: config.json, a bf16 model.safetensors, the
tokenizer files and generation_config.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def export(gguf: Path, out: Path) -> None:
    """Load `gguf` with transformers' GGUF support and save it as a bf16 safetensors folder at `out`."""
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"exported {gguf} -> {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    export(args.gguf, args.out)


if __name__ == "__main__":
    main()
