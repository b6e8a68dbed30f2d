#!/usr/bin/env bash
# Separate virtual environments for the client tools the compatibility runs use:
# lm-evaluation-harness, NVIDIA's AIPerf, and the agent frameworks (LangChain, the
# OpenAI Agents SDK, Pydantic AI). Never installed into the project's .venv: their
# dependency pins are theirs, not the service's.
#
#   bench/compat/envs.sh [lmeval|aiperf|frameworks|all]     (default: all)
#
# Environments go under .chatsvc/venvs/ (git-ignored); an existing one is kept.
# torch is installed first and pinned, so lm-eval's `torch` requirement does not
# pull a multi-GB CUDA build (the CPU wheel of 2.13.0 is what ./dev installs).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=.chatsvc/venvs
PY=${PYTHON:-python3}
which=${1:-all}

make_env() {  # name, packages...
  local name=$1; shift
  local env="$ROOT/$name"
  if [ ! -x "$env/bin/python" ]; then
    mkdir -p "$ROOT"
    "$PY" -m venv "$env"
  fi
  "$env/bin/python" -m pip install --disable-pip-version-check -q "$@"
  echo "$env ready"
}

if [ "$which" = lmeval ] || [ "$which" = all ]; then
  make_env lmeval "torch==${CHATSVC_TORCH_VERSION:-2.13.0}"
  make_env lmeval "lm-eval[api]==${LM_EVAL_VERSION:-0.4.13}" "transformers>=4.46" accelerate
fi
if [ "$which" = aiperf ] || [ "$which" = all ]; then
  make_env aiperf "aiperf==${AIPERF_VERSION:-0.13.0}"
fi
if [ "$which" = frameworks ] || [ "$which" = all ]; then
  make_env frameworks "langchain-openai==1.8.1" "openai-agents==0.24.0" \
    "pydantic-ai-slim[openai]==2.78.0"
fi
