# Sourced by the checks that run Lightning's own tests (tools/test_patched_upstream.sh, tools/test_trainer_drop_in.sh,
# tools/test_fabric_drop_in.sh): the pinned master, and a git repository that holds it.
#
#   CHECK="Fabric drop-in check" ELSEWHERE="what ran instead" WORK=<temporary folder> source tools/lightning_source.sh
#
# Sets PINNED and GIT_DIR_: $LIGHTNING_GIT_DIR, else the local mirror, else a clone from GitHub into $WORK. With none of
# them the check says so and exits 0, skipped (REQUIRE_LIGHTNING_SOURCE=1: exits 1). Lightning's tests are on no
# package registry: without a repository there is nothing to run them from.
PINNED=7f0c3436cd3f6ad3753125672024fc415cbcb414
GIT_DIR_=${LIGHTNING_GIT_DIR:-/work/.mirror/Lightning-AI+pytorch-lightning/repo}
if ! git --git-dir="$GIT_DIR_" cat-file -e "$PINNED" 2>/dev/null; then
    GIT_DIR_=$WORK/lightning.git
    if ! timeout 300 git clone --quiet --bare --filter=blob:none https://github.com/Lightning-AI/pytorch-lightning.git \
        "$GIT_DIR_" 2>/dev/null; then
        echo "$CHECK SKIPPED: no git repository of Lightning holding $PINNED (set LIGHTNING_GIT_DIR) and GitHub not" \
            "reachable. $ELSEWHERE" >&2
        [ "${REQUIRE_LIGHTNING_SOURCE:-0}" = 1 ] && exit 1
        exit 0
    fi
fi
