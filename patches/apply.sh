#!/usr/bin/env bash
# Apply the megatron-pec patches to a Megatron-LM checkout at tag core_v0.16.1.
#
#   patches/apply.sh MEGATRON_LM_DIR
#
# Checks, in order, before touching anything: the directory is a Megatron-LM tree,
# it is not already patched, it is at core_v0.16.1 (by commit for a git checkout,
# by version marker and file contents otherwise), and every patch applies
# (`git apply --check` on all of them). Only then are the patches applied, to the
# working tree only (nothing is staged or committed).
# Exit status: 0 patched, 1 refused or failed, 2 usage error.
set -euo pipefail

TAG=core_v0.16.1
TAG_COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6
# Git blob ids of the two files at $TAG, for trees that are not git checkouts.
TRAINING_BLOB=d61b9357a3730f4c3a891972a88ffef170781558
PRETRAIN_BLOB=8eff08d24b20655bb640eb8d2f08f9303ef78495
TRAINING=megatron/training/training.py
PRETRAIN=pretrain_gpt.py
VERSION_FILE=megatron/core/package_info.py

PATCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
PATCHES=("$PATCH_DIR"/0*.patch)

fail() { echo "apply.sh: $1" >&2; exit "${2:-1}"; }

[[ $# -eq 1 ]] || fail "usage: $0 MEGATRON_LM_DIR (a Megatron-LM checkout at tag $TAG)" 2
command -v git >/dev/null || fail "git is required (it applies the patches, also outside git checkouts)"
[[ -d "$1" ]] || fail "$1 is not a directory" 2
DIR=$(cd "$1" && pwd -P)
[[ -e "${PATCHES[0]}" ]] || fail "no patches found in $PATCH_DIR"

# Keep git from discovering a repository above DIR (git apply would then silently
# skip paths outside the current directory).
GIT_CEILING_DIRECTORIES=$(dirname "$DIR")
export GIT_CEILING_DIRECTORIES
g() { git -C "$DIR" "$@"; }

# 1. A Megatron-LM tree?
for f in "$TRAINING" "$PRETRAIN" "$VERSION_FILE"; do
    [[ -f "$DIR/$f" ]] || fail "$DIR is not a Megatron-LM tree: $f is missing"
done

# 2. Already patched? (checked before the version, whose content check would fail on a patched tree)
patched=()
for f in "$TRAINING" "$PRETRAIN"; do
    if grep -q megatron_pec "$DIR/$f"; then patched+=("$f"); fi
done
if [[ ${#patched[@]} -gt 0 ]]; then
    if g apply --reverse --check "${PATCHES[@]}" 2>/dev/null; then
        fail "$DIR is already patched for megatron-pec (${patched[*]} import megatron_pec); nothing to do"
    fi
    fail "$DIR is already partly patched or edited by hand (${patched[*]} mention megatron_pec): restore ${patched[*]} from $TAG and run again"
fi

# 3. At core_v0.16.1?
if [[ -e "$DIR/.git" ]]; then
    head=$(g rev-parse --verify -q HEAD) || fail "$DIR has a .git but git cannot read it (try: git -C $DIR status)"
    if [[ "$head" != "$TAG_COMMIT" ]]; then
        at=$(g describe --tags --always HEAD 2>/dev/null || echo "$head")
        fail "$DIR is at $at ($head), not $TAG ($TAG_COMMIT): run git -C $DIR checkout $TAG"
    fi
    echo "apply.sh: $DIR is a git checkout at $TAG ($TAG_COMMIT)"
else
    version=$(sed -n -E 's/^(MAJOR|MINOR|PATCH) = ([0-9]+).*/\2/p' "$DIR/$VERSION_FILE" | paste -sd. -)
    [[ "$version" == "0.16.1" ]] \
        || fail "$DIR is megatron-core ${version:-of unknown version} according to $VERSION_FILE, not 0.16.1 (tag $TAG)"
    for pair in "$TRAINING:$TRAINING_BLOB" "$PRETRAIN:$PRETRAIN_BLOB"; do
        f=${pair%%:*}
        [[ "$(git hash-object "$DIR/$f")" == "${pair#*:}" ]] \
            || fail "$DIR/$f differs from its $TAG version: restore it from $TAG and run again"
    done
    echo "apply.sh: $DIR is not a git checkout; version 0.16.1 and the contents of $TRAINING and $PRETRAIN match $TAG"
fi

# 4. Every patch must apply before any is applied.
if ! out=$(cd "$DIR" && git apply --check "${PATCHES[@]}" 2>&1); then
    fail "the patches do not apply to $DIR, nothing was changed:
$out"
fi

# 5. Apply.
(cd "$DIR" && git apply "${PATCHES[@]}") || fail "git apply failed on $DIR after a successful check"
for p in "${PATCHES[@]}"; do
    echo "apply.sh: applied $(basename "$p")"
done
echo "apply.sh: $TRAINING now takes load_checkpoint/save_checkpoint from megatron_pec;" \
     "$PRETRAIN adds the --pec-* flags. megatron_pec must be importable when you train (pip install -e <megatron-pec checkout>," \
     "or examples/megatron_lm/launch_pretrain_gpt.sh, which puts this repository on PYTHONPATH)."
