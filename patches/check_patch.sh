#!/usr/bin/env bash
# Check that the Megatron-LM patches here apply to a Megatron-LM checkout (nothing is changed):
#   patches/check_patch.sh /path/to/Megatron-LM        # a work tree at tag core_v0.16.1
# Then apply for real with: git -C /path/to/Megatron-LM apply "$(pwd)/patches/<patch>"
set -euo pipefail
checkout="${1:?usage: check_patch.sh MEGATRON_LM_CHECKOUT}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ! -f "${checkout}/pretrain_gpt.py" ]]; then
    echo "check_patch.sh: ${checkout} has no pretrain_gpt.py; pass a Megatron-LM work tree" >&2
    exit 2
fi
if git -C "${checkout}" rev-parse --git-dir > /dev/null 2>&1; then
    tag="$(git -C "${checkout}" describe --tags --exact-match 2> /dev/null || true)"
    if [[ "${tag}" != "core_v0.16.1" ]]; then
        echo "note: ${checkout} is at '${tag:-an untagged commit}', the patch is made for core_v0.16.1" >&2
    fi
fi
status=0
for patch in "${here}"/*.patch; do
    if (cd "${checkout}" && git apply --check "${patch}"); then
        echo "applies: $(basename "${patch}")"
    else
        echo "does NOT apply: $(basename "${patch}")" >&2
        status=1
    fi
done
exit "${status}"
