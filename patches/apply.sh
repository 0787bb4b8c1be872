#!/usr/bin/env bash
# Apply the megatron-pec patches to a Megatron-LM tree of a supported release.
#
#   patches/apply.sh MEGATRON_LM_DIR
#
# Supported releases: core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0; each has its own
# patches in patches/<tag>/. Checks, in order, before touching anything: the directory is a
# Megatron-LM tree, it is not already patched, it is one of the supported releases (by commit
# for a git checkout, by the contents of the two patched files otherwise), and every patch of
# that release applies (`git apply --check` on all of them). Only then are the patches applied,
# to the working tree only (nothing is staged or committed).
# Exit status: 0 patched, 1 refused or failed, 2 usage error.
set -euo pipefail

# tag, commit, git blob ids of training.py and pretrain_gpt.py at that tag, package_info version
RELEASES=(
    "core_v0.16.1 55ac7082517c3878ae653c07c09c534b8aed49f6 d61b9357a3730f4c3a891972a88ffef170781558 8eff08d24b20655bb640eb8d2f08f9303ef78495 0.16.1"
    "core_v0.17.1 266f1c97dca477ca8b92c16087506da2000b0b84 ecd8eaa6e423adbdaa3a4c3860462f41ac548131 31eee0f4dc609d36b9f7b88357c4fa9f837770d9 0.17.1"
    "core_v0.18.2 571370c829ca768fe37244f4e2e7f28d8accc4ab 3930cc46a217b1cf7c396ba825072edabc99479e 8fc21ed4c0ce3a8bb31b0012216d9b23c0cd39a8 0.18.2"
    # the core_v0.19.0 tree already says 0.19.1 in package_info.py
    "core_v0.19.0 5be9626709af2722333bf54797c954c09edeada3 57b8efe9390eca9ca8596ed5bb073ed62d9d014d 47c1935eb90ccac190b8c2934193e0d91bf99199 0.19.1"
)
SUPPORTED="core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0"
TRAINING=megatron/training/training.py
PRETRAIN=pretrain_gpt.py
VERSION_FILE=megatron/core/package_info.py

PATCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

fail() { echo "apply.sh: $1" >&2; exit "${2:-1}"; }

[[ $# -eq 1 ]] || fail "usage: $0 MEGATRON_LM_DIR (a Megatron-LM tree of one of: $SUPPORTED)" 2
command -v git >/dev/null || fail "git is required (it applies the patches, also outside git checkouts)"
[[ -d "$1" ]] || fail "$1 is not a directory" 2
DIR=$(cd "$1" && pwd -P)

# Keep git from discovering a repository above DIR (git apply would then silently
# skip paths outside the current directory).
GIT_CEILING_DIRECTORIES=$(dirname "$DIR")
export GIT_CEILING_DIRECTORIES
g() { git -C "$DIR" "$@"; }
patches_of() { echo "$PATCH_DIR/$1"/0*.patch; }

# 1. A Megatron-LM tree?
for f in "$TRAINING" "$PRETRAIN" "$VERSION_FILE"; do
    [[ -f "$DIR/$f" ]] || fail "$DIR is not a Megatron-LM tree: $f is missing"
done

# 2. Already patched? (checked first: a patched tree matches no release's contents)
patched=()
for f in "$TRAINING" "$PRETRAIN"; do
    if grep -q megatron_pec "$DIR/$f"; then patched+=("$f"); fi
done
if [[ ${#patched[@]} -gt 0 ]]; then
    for release in "${RELEASES[@]}"; do
        read -r tag _ <<< "$release"
        # shellcheck disable=SC2046
        if (cd "$DIR" && git apply --reverse --check $(patches_of "$tag")) 2>/dev/null; then
            fail "$DIR is already patched for megatron-pec ($tag; ${patched[*]} import megatron_pec); nothing to do"
        fi
    done
    fail "$DIR is already partly patched or edited by hand (${patched[*]} mention megatron_pec): restore ${patched[*]} from the release tag and run again"
fi

# 3. Which release?
version=$(sed -n -E 's/^(MAJOR|MINOR|PATCH) = ([0-9]+).*/\2/p' "$DIR/$VERSION_FILE" | paste -sd. -)
training_blob=$(git hash-object "$DIR/$TRAINING")
pretrain_blob=$(git hash-object "$DIR/$PRETRAIN")
TAG=""
if [[ -e "$DIR/.git" ]]; then
    head=$(g rev-parse --verify -q HEAD) || fail "$DIR has a .git but git cannot read it (try: git -C $DIR status)"
    for release in "${RELEASES[@]}"; do
        read -r tag commit _ <<< "$release"
        if [[ "$head" == "$commit" ]]; then TAG=$tag; fi
    done
    if [[ -z "$TAG" ]]; then
        at=$(g describe --tags --always HEAD 2>/dev/null || echo "$head")
        fail "$DIR is at $at ($head), not a supported release: check out one of $SUPPORTED (git -C $DIR checkout core_v0.19.0)"
    fi
    for release in "${RELEASES[@]}"; do
        read -r tag _ training pretrain _ <<< "$release"
        [[ "$tag" == "$TAG" ]] || continue
        [[ "$training_blob" == "$training" && "$pretrain_blob" == "$pretrain" ]] \
            || fail "$DIR is a git checkout at $TAG, but $TRAINING or $PRETRAIN has local changes: git -C $DIR checkout -- $TRAINING $PRETRAIN, then run again"
    done
    echo "apply.sh: $DIR is a git checkout at $TAG ($head)"
else
    for release in "${RELEASES[@]}"; do
        read -r tag _ training pretrain _ <<< "$release"
        if [[ "$training_blob" == "$training" && "$pretrain_blob" == "$pretrain" ]]; then TAG=$tag; fi
    done
    if [[ -z "$TAG" ]]; then
        for release in "${RELEASES[@]}"; do
            read -r tag _ _ _ release_version <<< "$release"
            if [[ "$version" == "$release_version" ]]; then
                fail "$DIR says megatron-core $version ($tag), but $TRAINING or $PRETRAIN differs from $tag: restore both from $tag and run again"
            fi
        done
        fail "$DIR is megatron-core ${version:-of unknown version} according to $VERSION_FILE, not a supported release: use a tree of one of $SUPPORTED"
    fi
    echo "apply.sh: $DIR is not a git checkout; $TRAINING and $PRETRAIN match $TAG (megatron-core $version)"
fi

# 4. Every patch must apply before any is applied.
read -ra PATCHES <<< "$(patches_of "$TAG")"
[[ -e "${PATCHES[0]}" ]] || fail "no patches for $TAG found in $PATCH_DIR/$TAG"
if ! out=$(cd "$DIR" && git apply --check "${PATCHES[@]}" 2>&1); then
    fail "the patches do not apply to $DIR, nothing was changed:
$out"
fi

# 5. Apply.
(cd "$DIR" && git apply "${PATCHES[@]}") || fail "git apply failed on $DIR after a successful check"
for p in "${PATCHES[@]}"; do
    echo "apply.sh: applied $TAG/$(basename "$p")"
done
echo "apply.sh: $TRAINING now takes load_checkpoint/save_checkpoint from megatron_pec;" \
     "$PRETRAIN adds the --pec-* flags. megatron_pec must be importable when you train (pip install -e <megatron-pec checkout>," \
     "or examples/megatron_lm/launch_pretrain_gpt.sh, which puts this repository on PYTHONPATH)."
