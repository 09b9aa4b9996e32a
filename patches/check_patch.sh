#!/usr/bin/env bash
# Check which Megatron-LM patch here fits a Megatron-LM checkout (nothing is changed):
#   patches/check_patch.sh /path/to/Megatron-LM        # a work tree at core_v0.16.1 or core_v0.19.0
# One patch per Megatron-LM release line (pretrain_gpt.py differs between them):
#   megatron-lm-core_v0.16.1-pretrain_gpt.patch   core_v0.16.x (pretrain(..., extra_args_provider=...))
#   megatron-lm-core_v0.19.0-pretrain_gpt.patch   core_v0.19.x (parse_and_validate_args(extra_args_provider=...))
# Every patch is tried; the one made for the checkout's version (its megatron/core/package_info.py)
# must apply. Exit 0 when it does (or, version unknown, when exactly one patch applies).
# Then apply for real with: git -C /path/to/Megatron-LM apply "$(pwd)/patches/<patch>"
set -euo pipefail
checkout="${1:?usage: check_patch.sh MEGATRON_LM_CHECKOUT}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ! -f "${checkout}/pretrain_gpt.py" ]]; then
    echo "check_patch.sh: ${checkout} has no pretrain_gpt.py; pass a Megatron-LM work tree" >&2
    exit 2
fi
# The checkout's megatron-core version, major.minor (e.g. 0.19), from package_info.py.
version=""
info="${checkout}/megatron/core/package_info.py"
if [[ -f "${info}" ]]; then
    major="$(sed -n 's/^MAJOR = \([0-9]*\).*/\1/p' "${info}")"
    minor="$(sed -n 's/^MINOR = \([0-9]*\).*/\1/p' "${info}")"
    [[ -n "${major}" && -n "${minor}" ]] && version="${major}.${minor}"
fi
# Git looks at the checkout itself, never a repository around it: inside another work tree (a
# tarball extracted into a project) git apply would skip the paths outside its directory and
# report every patch as applying.
checkout="$(cd "${checkout}" && pwd)"
GIT_CEILING_DIRECTORIES="$(dirname "${checkout}")"
export GIT_CEILING_DIRECTORIES
if git -C "${checkout}" rev-parse --git-dir > /dev/null 2>&1; then
    tag="$(git -C "${checkout}" describe --tags --exact-match 2> /dev/null || true)"
    if [[ -z "${version}" && "${tag}" =~ ^core_v([0-9]+\.[0-9]+)\. ]]; then
        version="${BASH_REMATCH[1]}"
    fi
    echo "checkout: ${checkout} at '${tag:-an untagged commit}', megatron-core ${version:-version unknown}"
else
    echo "checkout: ${checkout} (not a git work tree), megatron-core ${version:-version unknown}"
fi
expected=""
applying=()
made=()
for patch in "${here}"/*.patch; do
    name="$(basename "${patch}")"
    # megatron-lm-core_v0.19.0-pretrain_gpt.patch -> 0.19
    made_for="$(echo "${name}" | sed -n 's/^megatron-lm-core_v\([0-9]*\.[0-9]*\)\..*/\1/p')"
    made+=("${made_for}")
    [[ -n "${version}" && "${made_for}" == "${version}" ]] && expected="${name}"
    if (cd "${checkout}" && git apply --check "${patch}" 2> /dev/null); then
        echo "applies: ${name}"
        applying+=("${name}")
    else
        echo "does not apply: ${name} (made for core_v${made_for}.x)"
    fi
done
if [[ -n "${expected}" ]]; then
    for name in "${applying[@]}"; do
        if [[ "${name}" == "${expected}" ]]; then
            echo "use: ${expected}"
            exit 0
        fi
    done
    echo "check_patch.sh: ${expected} is made for this checkout's version (${version}) but does NOT apply" >&2
    exit 1
fi
if [[ ${#applying[@]} -eq 1 ]]; then
    echo "use: ${applying[0]} (no patch is named for megatron-core ${version:-of this checkout}; this one applies)"
    exit 0
fi
echo "check_patch.sh: no patch here is made for megatron-core ${version:-of this checkout}, and ${#applying[@]} apply;" \
     "patches exist for: ${made[*]}" >&2
exit 1
